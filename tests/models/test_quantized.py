"""Quantized checkpoints end to end: tokens against transformers on an independent dequantization of the same
bytes, quantized + offloaded == quantized resident bit for bit, and a miss reads exactly the stored bytes.

Formats: NVFP4 (compressed-tensors, written by its own compressor; ModelOpt names of the same bytes), FP8 with
32x32 blocks on dims that are not multiples of 32 (partial edge blocks), compressed-tensors MXFP4, and gpt-oss
MXFP4. transformers is NOT the NVFP4 oracle (its MoE path drops the global scale): the reference model is the
bf16 checkpoint with every quantized Linear replaced by compressed-tensors' / torchao's / a numpy decoder's
dequantization, loaded by transformers as an ordinary model.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.checkpoint.folder import open_checkpoint
from moeserve.errors import UnsupportedModelError
from moeserve.models.experts.plans import expert_plan
from moeserve.models.experts.unit_math import DequantizingKernel
from moeserve.models.inventory import describe_formats
from tests.fixtures import checkpoints as C

STEPS = 16
PROMPTS = [[5, 9], [17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200]]

# name -> (quantizer, reference dequantization, quantization_config, extra files, base overrides, compute dtype).
# NVFP4 is compared in bf16 (compressed-tensors / torchao dequantize to bf16). FP8 and MXFP4 are compared in
# float32, where the numpy decoders are exact and the engine matches transformers to 1e-4: in bf16 a random
# tiny model has near-ties (seen: an exact top-2 tie in transformers' own bf16 logits).
FORMATS = {
    "nvfp4-ct": (C.nvfp4_ct_quantize, C.nvfp4_ct_reference, C.NVFP4_CT_CONFIG, {}, {}, "bfloat16"),
    "nvfp4-modelopt": (C.nvfp4_modelopt_quantize, C.nvfp4_modelopt_reference, None,
                       {"hf_quant_config.json": C.MODELOPT_HF_QUANT_CONFIG}, {}, "bfloat16"),
    "fp8-block": (C.fp8_block_quantize, C.fp8_block_reference, C.FP8_CONFIG, {},
                  {"moe_intermediate_size": 40, "intermediate_size": 72}, "float32"),
    "mxfp4-ct": (C.mxfp4_ct_quantize, C.mxfp4_ct_reference, C.MXFP4_CT_CONFIG, {}, {}, "float32"),
}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory):
    """Builds (quantized folder, reference folder) per format on first use."""
    root = tmp_path_factory.mktemp("quantized")

    @functools.cache
    def make(name: str) -> tuple[Path, Path | None]:
        if name == "gpt-oss-mxfp4":
            bf16 = C.write_gpt_oss(root / "gpt_oss_bf16")
            return C.write_gpt_oss_mxfp4(bf16, root / name), None
        quantize, reference, config, extra, overrides, dtype = FORMATS[name]
        src = C.qwen3_base(root / f"{name}-bf16", **overrides)
        quantized = C.quantize_checkpoint(src, root / name, quantize, config, extra)
        ref_dir = C.dequantized_reference(
            src, quantized, root / f"{name}-ref", reference, getattr(torch, dtype)
        )
        return quantized, ref_dir

    return make


def greedy(llm: LLM, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def hf_greedy(folder: Path, prompt: list[int], dtype: str) -> tuple[list[int], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logps.append(torch.log_softmax(logits, dim=-1))
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :], logps


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tokens_match_transformers_on_independent_dequantization(folders, fmt: str) -> None:
    quantized, reference = folders(fmt)
    dtype = FORMATS[fmt][-1]
    ours = greedy(LLM(str(quantized), skip_tokenizer_init=True, dtype=dtype))
    assert llm_dequantized_attention(quantized)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for prompt, out in zip(PROMPTS, ours):
        ref_tokens, ref_logps = hf_greedy(reference, prompt, dtype)
        assert out.token_ids == ref_tokens, (fmt, len(prompt))
        for lp, ref in zip(out.logprobs, ref_logps):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < tol, (fmt, token_id)


def llm_dequantized_attention(folder: Path) -> bool:
    """The quantized checkpoint really has quantized attention Linears (dense layers are read via the format)."""
    names = open_checkpoint(folder).tensors
    return "model.layers.0.self_attn.q_proj.weight_packed" in names or (
        "model.layers.0.self_attn.q_proj.weight_scale" in names
        or "model.layers.0.self_attn.q_proj.weight_scale_inv" in names
    )


def expert_stored_bytes(folder: Path, fmt: str) -> tuple[int, int]:
    """(bytes of one expert as stored, bytes of the same expert in bf16) from the safetensors headers."""
    ckpt = open_checkpoint(folder)
    if fmt == "gpt-oss-mxfp4":
        stacked = [r for n, r in ckpt.tensors.items() if n.startswith("model.layers.0.mlp.experts.")]
        num_experts = stacked[0].shape[0]
        h = i = ckpt.config["hidden_size"]
        return sum(r.nbytes for r in stacked) // num_experts, (3 * i * h + 2 * i + h) * 2
    mine = [r for n, r in ckpt.tensors.items() if n.startswith("model.layers.0.mlp.experts.0.")]
    h, i = ckpt.config["hidden_size"], ckpt.config["moe_intermediate_size"]
    return sum(r.nbytes for r in mine), 3 * h * i * 2


@pytest.mark.parametrize("fmt", [*FORMATS, "gpt-oss-mxfp4"])
def test_offloaded_equals_resident_and_a_miss_reads_the_stored_bytes(folders, fmt: str) -> None:
    folder, _ = folders(fmt)
    resident = LLM(str(folder), skip_tokenizer_init=True, dtype="float32")
    # A cache of one expert: smaller than one layer's experts, so every layer misses and evicts.
    offloaded = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", expert_cache_gb=1e-9)
    store = offloaded.engine.model.store
    assert not store.resident and store.capacity == 1
    read_before = offloaded.engine.checkpoint.reader.bytes_read
    ours, ref = greedy(offloaded), greedy(resident)
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids
        assert [{t: e.logprob for t, e in lp.items()} for lp in a.logprobs] == [
            {t: e.logprob for t, e in lp.items()} for lp in b.logprobs
        ]
    stored, bf16 = expert_stored_bytes(folder, fmt)
    misses = store.stats.misses
    assert misses > 0
    assert offloaded.engine.checkpoint.reader.bytes_read - read_before == misses * stored  # measured reads
    assert store.stats.bytes_read == misses * stored
    limit = 0.6 if fmt == "fp8-block" else 0.35  # 8 or ~4.5 bits per weight against 16
    assert stored < limit * bf16, (stored, bf16)


def test_kernel_dequantizes_into_the_same_buffers_every_call(folders) -> None:
    folder, _ = folders("nvfp4-ct")
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32")
    kernel = llm.engine.model.layers[0].mlp.experts.math
    assert isinstance(kernel, DequantizingKernel)
    store = llm.engine.model.store
    (chunk,) = list(store.experts(0, [0, 1]))
    first = [t.data_ptr() for t in kernel.dequantize(chunk[0][1])]
    second = [t.data_ptr() for t in kernel.dequantize(chunk[1][1])]
    assert first == second
    x = torch.randn(3, 64)
    out_before = kernel(x, chunk[0][1]).clone()
    kernel(x, chunk[1][1])
    assert torch.equal(kernel(x, chunk[0][1]), out_before)  # nothing of expert 1 leaks into expert 0


def test_excluded_modules_stay_in_stored_dtype(folders) -> None:
    folder, _ = folders("nvfp4-ct")
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    model = llm.engine.model
    assert "model.layers.0.self_attn.q_proj" in model.dequantized_linears
    assert not any(n.endswith(("mlp.gate", "lm_head")) for n in model.dequantized_linears)
    ckpt = open_checkpoint(folder)
    router = ckpt.reader.read(ckpt.ref("model.layers.0.mlp.gate.weight"))
    assert torch.equal(model.layers[0].mlp.router.weight, router)  # read as stored (bf16), not quantized


def test_unknown_quantization_method_is_a_clear_error(folders, copy_checkpoint) -> None:
    folder = copy_checkpoint(folders("nvfp4-ct")[0])
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'awq'"):
        LLM(str(folder), skip_tokenizer_init=True)


def test_describe_formats_reports_groups_and_bytes_per_token(folders) -> None:
    folder, _ = folders("nvfp4-ct")
    report = describe_formats(open_checkpoint(folder))
    groups = {g.group: g for g in report.groups}
    assert report.scheme == "compressed-tensors"
    assert groups["model.layers.*.mlp.experts.*.gate_proj.weight_packed"].format == "nvfp4-ct"
    assert groups["model.layers.*.self_attn.q_proj.weight_scale"].format == "nvfp4-ct"
    assert groups["model.layers.*.mlp.gate.weight"].format == "BF16"
    stored, _ = expert_stored_bytes(folder, "nvfp4-ct")
    assert report.expert_stored_bytes == stored
    ckpt = open_checkpoint(folder)
    experts = sum(r.nbytes for n, r in ckpt.tensors.items() if ".mlp.experts." in n)
    nonexpert = ckpt.total_bytes - experts - ckpt.ref("model.embed_tokens.weight").nbytes
    moe_layers = 2  # 3 layers, layer 1 dense (mlp_only_layers)
    assert report.bytes_per_token == nonexpert + moe_layers * 2 * stored


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4-ct", "gpt-oss-mxfp4"])
def test_cuda_offloaded_equals_resident_and_matches_cpu_tokens(folders, fmt: str) -> None:
    """On CUDA the unit (codes, scales, global scales, biases) moves as one copy and is dequantized on device."""
    folder, _ = folders(fmt)
    resident = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda")
    offloaded = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda", expert_cache_gb=1e-9)
    cpu = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cpu")
    a, b, c = greedy(offloaded), greedy(resident), greedy(cpu)
    assert offloaded.engine.model.store.stats.misses > 0
    for x, y, z in zip(a, b, c):
        assert x.token_ids == y.token_ids == z.token_ids
        assert [{t: e.logprob for t, e in lp.items()} for lp in x.logprobs] == [
            {t: e.logprob for t, e in lp.items()} for lp in y.logprobs
        ]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_resident_estimate_equals_what_the_loader_holds(folders, fmt: str) -> None:
    """The budget's non-expert bytes count quantized Linears at their dequantized size, experts not at all."""
    from moeserve.models.inventory import resident_nbytes

    folder, _ = folders(fmt)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    engine = llm.engine
    plan = expert_plan(engine.checkpoint, engine.arch, engine.spec, torch.bfloat16)
    assert resident_nbytes(engine.checkpoint, plan, torch.bfloat16) == engine.model.resident_bytes


def test_unlisted_plain_lm_head_is_read_as_stored(folders, copy_checkpoint) -> None:
    """FP8 configs may omit lm_head from modules_to_not_convert; a plain bf16 lm_head is still read as is."""
    folder = copy_checkpoint(folders("fp8-block")[0])
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["mlp.gate"]
    (folder / "config.json").write_text(json.dumps(config))
    model = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16").engine.model
    assert "lm_head" not in model.dequantized_linears
    assert "model.layers.0.self_attn.q_proj" in model.dequantized_linears
    ckpt = open_checkpoint(folder)
    assert torch.equal(model.lm_head, ckpt.reader.read(ckpt.ref("lm_head.weight")))


def test_a_projection_whose_format_changes_across_layers_is_refused_unless_gguf() -> None:
    from moeserve.formats.catalog import CompressedTensorsInt4Format
    from moeserve.formats.gguf import GGUF_FORMATS, LayerMixedGGUFFormat
    from moeserve.models.experts.plans import _projection_format

    q4k, q6k = GGUF_FORMATS["Q4_K"](), GGUF_FORMATS["Q6_K"]()
    mixed = _projection_format("blk.{L}.down", {0: q6k, 1: q4k, 2: q6k})
    assert isinstance(mixed, LayerMixedGGUFFormat) and set(mixed.formats) == {q4k, q6k} and mixed.largest == q6k
    assert _projection_format("blk.{L}.down", {0: q4k, 1: q4k}) == q4k
    with pytest.raises(UnsupportedModelError, match="different formats across layers"):
        _projection_format("model.layers.{L}.mlp.experts.{E}.down_proj", {0: q4k, 1: CompressedTensorsInt4Format()})
