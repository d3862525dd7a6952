"""The synthetic checkpoint writer: real HF layout (transformers loads it and agrees with moeserve), cached,
deterministic; the GGUF export holds the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.bench.shapes import SHAPES, get_shape
from moeserve.bench.synth import ensure_checkpoint, synthetic_tensor
from moeserve.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_checkpoint(SHAPES["tiny"], tmp_path_factory.mktemp("bench_cache"))


def test_checkpoint_reads_back_with_safetensors(tiny_dir):
    from safetensors import safe_open

    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    names = [n for n, _ in SHAPES["tiny"].outer_tensors()] + [n for n, _ in SHAPES["tiny"].layer_tensors(1)]
    assert set(names) <= set(index["weight_map"])
    for name in names[:5] + names[-3:]:
        with safe_open(str(tiny_dir / index["weight_map"][name]), "pt") as f:
            t = f.get_tensor(name)
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, synthetic_tensor(name, tuple(t.shape), torch.bfloat16, 0))


def test_cache_is_reused_and_deterministic(tiny_dir):
    shard = sorted(tiny_dir.glob("*.safetensors"))[1]
    mtime = shard.stat().st_mtime_ns
    again = ensure_checkpoint(SHAPES["tiny"], tiny_dir.parent)
    assert again == tiny_dir and shard.stat().st_mtime_ns == mtime
    a = synthetic_tensor("model.layers.0.mlp.gate.weight", (8, 64), torch.bfloat16, 0)
    b = synthetic_tensor("model.layers.1.mlp.gate.weight", (8, 64), torch.bfloat16, 0)
    assert torch.equal(a, synthetic_tensor("model.layers.0.mlp.gate.weight", (8, 64), torch.bfloat16, 0))
    assert not torch.equal(a, b)


def test_correlated_routers_keep_their_scale_and_correlate_as_asked():
    """router_correlation c: every pair of layers' routers correlates ~c, each keeps the N(0, INIT_STD^2) scale;
    other matrices, and c = 0, are untouched."""
    from moeserve.bench.synth import INIT_STD

    def router(layer: int, c: float) -> torch.Tensor:
        return synthetic_tensor(f"model.layers.{layer}.mlp.gate.weight", (64, 512), torch.float32, 0, c).flatten()

    a, b = router(0, 0.9), router(5, 0.9)
    assert torch.corrcoef(torch.stack([a, b]))[0, 1].item() == pytest.approx(0.9, abs=0.02)
    assert a.std().item() == pytest.approx(INIT_STD, rel=0.03)
    assert abs(torch.corrcoef(torch.stack([router(0, 0.0), router(5, 0.0)]))[0, 1].item()) < 0.03
    assert torch.equal(router(3, 0.0), synthetic_tensor("model.layers.3.mlp.gate.weight", (64, 512),
                                                        torch.float32, 0).flatten())
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert torch.equal(synthetic_tensor(name, (8, 64), torch.float32, 0, 0.9), synthetic_tensor(name, (8, 64),
                                                                                              torch.float32, 0))


def test_transformers_loads_it_and_greedy_tokens_match_moeserve(tiny_dir):
    transformers = pytest.importorskip("transformers")
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams

    prompt = [5, 17, 42, 99, 7]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(str(tiny_dir), skip_tokenizer_init=True, dtype="float32")
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert list(got[0].outputs[0].token_ids) == want


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_gguf_holds_the_same_weights(tiny_dir, kind):
    gguf = pytest.importorskip("gguf")
    from moeserve.bench.gguf_export import ensure_gguf

    reader = gguf.GGUFReader(ensure_gguf(tiny_dir, SHAPES["tiny"], kind))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 2 * 12
    down = tensors["blk.1.ffn_down_exps.weight"]
    assert list(down.shape) == [32, 64, 8]  # GGUF order: (I, H, E)
    values = torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type).copy()).float()  # [E, H, I]
    want = synthetic_tensor("model.layers.1.mlp.experts.3.down_proj.weight", (64, 32), torch.bfloat16, 0).float()
    if kind == "bf16":
        assert torch.equal(values[3], want)
    else:  # Q8_0: one fp16 scale per 32 values; error half a step, plus up to 127 x the scale's fp16 rounding
        step = want.abs().amax(dim=-1, keepdim=True) / 127
        assert ((values[3] - want).abs() <= step * (0.5 + 127 * 2**-11) + 1e-6).all()
        assert not torch.equal(values[3], want)
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32


def test_unknown_shape_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown benchmark shape 'huge' .valid: .*small"):
        get_shape("huge")
    with pytest.raises(ConfigError, match="did you mean 'hybrid'"):
        get_shape("hybrd")


def test_llama_cpp_on_the_gguf_agrees_with_moeserve(tiny_dir):
    """Optional peer: llama.cpp greedy tokens on the exported GGUF equal moeserve's (fp32) on the checkpoint."""
    pytest.importorskip("llama_cpp")
    from moeserve.bench.engines import LlamaCppEngine, MoeserveEngine
    from moeserve.bench.gguf_export import ensure_gguf

    prompt = [5, 17, 42, 99, 7, 8, 9, 10]
    theirs = LlamaCppEngine(str(ensure_gguf(tiny_dir, SHAPES["tiny"], "bf16")), threads=1, n_ctx=64)
    ours = MoeserveEngine(str(tiny_dir), dtype="float32", threads=1, max_model_len=64)
    assert theirs.decode([prompt], 6).token_ids == ours.decode([prompt], 6).token_ids


def test_llama_cpp_batched_decode_gives_each_sequence_its_tokens_alone(tiny_dir):
    """The llama.cpp peer at batch > 1 (one context of several sequences, bench/llama_batch.py): each sequence's
    greedy tokens are those the Llama API gives it alone, up to the first step whose top two logits (alone) lie
    within 0.005 of each other: llama.cpp's numbers depend on the batch (on this checkpoint a margin of 6e-4 flips a
    token), so a near-tie may break either way. The timing counts every sequence's tokens."""
    pytest.importorskip("llama_cpp")
    import numpy as np

    from moeserve.bench.engines import LlamaCppEngine
    from moeserve.bench.gguf_export import ensure_gguf

    prompts = [[5, 17, 42, 99, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8], [200, 100, 50, 25, 12, 6, 3, 4, 150]]
    theirs = LlamaCppEngine(str(ensure_gguf(tiny_dir, SHAPES["tiny"], "bf16")), threads=1, n_ctx=64)
    together = theirs.decode(prompts, 6)
    alone = [theirs.decode([p], 6).token_ids[0] for p in prompts]

    def sure_steps(prompt: list[int], tokens: list[int]) -> int:  # leading steps without a near-tie, alone
        llm = theirs.llm
        for i in range(len(tokens)):
            llm.reset()
            llm.eval(prompt + tokens[:i])
            top = np.sort(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)))[-2:]
            if top[1] - top[0] < 0.005:
                return i
        return len(tokens)

    sure = [sure_steps(p, t) for p, t in zip(prompts, alone)]
    theirs.close()
    assert sum(sure) >= 12  # most steps are decided
    assert [t[:n] for t, n in zip(together.token_ids, sure)] == [t[:n] for t, n in zip(alone, sure)]
    assert (together.tokens, together.steps, [len(t) for t in together.token_ids]) == (18, 6, [7, 7, 7])


def test_llama_cpp_quantizes_the_gguf_and_its_bytes_are_read_from_the_file(tiny_dir):
    """The Q4_0 peer's GGUF is made by llama.cpp's own quantizer from the BF16 one; gguf_file.bytes_per_param reads
    each file's (dense, expert) bytes per weight: BF16 experts 2 bytes, Q4_0 ones 18 bytes per block of 32."""
    pytest.importorskip("llama_cpp")
    import gguf

    from moeserve.bench.gguf_export import ensure_gguf
    from moeserve.bench.gguf_file import bytes_per_param

    bf16 = bytes_per_param(ensure_gguf(tiny_dir, SHAPES["tiny"], "bf16"))
    path = ensure_gguf(tiny_dir, SHAPES["tiny"], "q4_0")
    q4 = bytes_per_param(path)
    experts = [t for t in gguf.GGUFReader(str(path)).tensors if "_exps." in t.name]
    assert experts and {t.tensor_type for t in experts} == {gguf.GGMLQuantizationType.Q4_0}
    assert bf16[1] == 2.0 and q4[1] == 18 / 32
    assert 2.0 < bf16[0] < 4.0 and q4[0] < bf16[0]  # norms and routers stay F32 in both


def test_moeserve_decode_times_only_decode_steps_after_a_chunked_prefill(tiny_dir):
    """A prompt longer than max_num_batched_tokens is prefilled in several steps; the timed part starts once every
    request has its first token, so it holds exactly new_tokens steps (and tokens) per request."""
    from moeserve.bench.engines import MoeserveEngine

    ours = MoeserveEngine(str(tiny_dir), dtype="float32", threads=1, max_model_len=128, max_num_batched_tokens=16)
    prompts = [[(7 * i + 3) % 200 + 1 for i in range(50)], [5, 6, 7]]
    timing = ours.decode(prompts, 4)
    ours.close()
    assert timing.steps == 4 and timing.tokens == 8
    assert [len(t) for t in timing.token_ids] == [5, 5]  # the first token (untimed) and the 4 timed
