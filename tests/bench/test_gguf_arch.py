"""GGUF writers of the hybrid, MLA and Mamba-2 bench shapes (bench/gguf_arch.py).

Without llama.cpp: every tensor written is one llama.cpp's tensor names know for the architecture, at the shape its
loader creates (src/models/<arch>.cpp `load_arch_tensors`, computed here from config.json), with the converter's
transforms checked value by value against the checkpoint. With llama-cpp-python installed (slow, optional): llama.cpp
on the GGUF decodes the same greedy tokens as moeserve on the checkpoint, and its prompt logits are those of
transformers within bf16 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.bench.shapes import SHAPES

gguf = pytest.importorskip("gguf")

TOLERANCE = 0.01  # of the step's largest logit: bf16 rounding of llama.cpp's activations
TINY = {"hybrid-tiny": "qwen3next", "mla-tiny": "deepseek2", "mamba-hybrid-tiny": "nemotron_h_moe"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{shape: (checkpoint folder, {kind: GGUFReader})} for the three tiny shapes."""
    from moeserve.bench.gguf_export import ensure_gguf
    from moeserve.bench.synth import ensure_checkpoint

    root = tmp_path_factory.mktemp("gguf-arch")
    out = {}
    for name in TINY:
        folder = ensure_checkpoint(SHAPES[name], root)
        out[name] = folder, {k: gguf.GGUFReader(ensure_gguf(folder, SHAPES[name], k)) for k in ("bf16", "q8_0")}
    return out


def _tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def _ne(t) -> tuple[int, ...]:  # llama.cpp's ne order (innermost first)
    return tuple(int(x) for x in t.shape)


def _values(t) -> torch.Tensor:  # HF (numpy) orientation, fp32
    return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))


def _ckpt(folder, name: str) -> torch.Tensor:
    from moeserve.checkpoint.folder import open_checkpoint

    ckpt = open_checkpoint(folder)
    return ckpt.reader.read(ckpt.ref(name)).float()


@pytest.mark.parametrize("name", TINY)
def test_names_are_llama_cpps_for_the_architecture(written, name: str) -> None:
    arch = TINY[name]
    reader = written[name][1]["bf16"]
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == arch
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    layers = SHAPES[name].num_layers
    known = {gguf.TENSOR_NAMES[t].format(bid=L) for t in gguf.MODEL_TENSORS[arch_id] for L in range(layers)}
    for t in reader.tensors:
        assert t.name.rsplit(".", 1)[0] in known or t.name in known, t.name


def _expected_qwen3next(c: dict) -> dict[str, tuple[int, ...]]:
    H, E, inter = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    dk, nk, nv = c["linear_key_head_dim"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    key_dim, value_dim = dk * nk, dk * nv
    return {"blk.0.attn_qkv.weight": (H, 2 * key_dim + value_dim), "blk.0.attn_gate.weight": (H, value_dim),
            "blk.0.ssm_ba.weight": (H, 2 * nv), "blk.0.ssm_conv1d.weight": (4, 2 * key_dim + value_dim),
            "blk.0.ssm_a": (nv,), "blk.0.ssm_dt.bias": (nv,), "blk.0.ssm_norm.weight": (dk,),
            "blk.0.ssm_out.weight": (value_dim, H), "blk.3.attn_q.weight": (H, 2 * c["num_attention_heads"] * c["head_dim"]),
            "blk.3.attn_q_norm.weight": (c["head_dim"],), "blk.0.ffn_gate_inp_shexp.weight": (H, 1),
            "blk.0.ffn_down_exps.weight": (inter, H, E), "blk.0.ffn_gate_exps.weight": (H, inter, E)}


def _expected_deepseek2(c: dict) -> dict[str, tuple[int, ...]]:
    H, heads, kv, rope, nope = (c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"],
                                c["qk_rope_head_dim"], c["qk_nope_head_dim"])
    return {"blk.1.attn_kv_a_mqa.weight": (H, kv + rope), "blk.1.attn_k_b.weight": (nope, kv, heads),
            "blk.1.attn_v_b.weight": (kv, c["v_head_dim"], heads), "blk.1.attn_q_b.weight":
            (c["q_lora_rank"], heads * (nope + rope)), "blk.0.ffn_gate.weight": (H, c["intermediate_size"]),
            "blk.1.exp_probs_b.bias": (c["n_routed_experts"],), "blk.1.ffn_up_shexp.weight": (H, c["moe_intermediate_size"])}


def _expected_nemotron(c: dict) -> dict[str, tuple[int, ...]]:
    H, heads, groups, state = c["hidden_size"], c["mamba_num_heads"], c["n_groups"], c["ssm_state_size"]
    inner = heads * c["mamba_head_dim"]
    return {"blk.0.ssm_in.weight": (H, 2 * inner + 2 * groups * state + heads),
            "blk.0.ssm_conv1d.weight": (4, inner + 2 * groups * state), "blk.0.ssm_a": (1, heads),
            "blk.0.ssm_d": (1, heads), "blk.0.ssm_norm.weight": (inner // groups, groups),
            "blk.0.ssm_out.weight": (inner, H), "blk.1.ffn_up_exps.weight": (H, c["moe_intermediate_size"], 8),
            "blk.1.ffn_up_shexp.weight": (H, c["moe_shared_expert_intermediate_size"]),
            "blk.3.attn_k.weight": (H, c["num_key_value_heads"] * c["head_dim"])}


EXPECTED = {"hybrid-tiny": _expected_qwen3next, "mla-tiny": _expected_deepseek2, "mamba-hybrid-tiny": _expected_nemotron}


@pytest.mark.parametrize("name", TINY)
def test_shapes_are_those_llama_cpps_loader_creates(written, name: str) -> None:
    tensors = _tensors(written[name][1]["bf16"])
    for tensor, ne in EXPECTED[name](SHAPES[name].hf_config()).items():
        assert _ne(tensors[tensor]) == ne, tensor


@pytest.mark.parametrize("name", TINY)
def test_types_follow_llama_cpps_converter(written, name: str) -> None:
    """Norms, routers, conv kernels, SSM A/D and biases F32; matrices Q8_0 in q8_0 unless a row is not whole
    32-value blocks (BF16 then, e.g. MLA's k_b rows of qk_nope values)."""
    Q = gguf.GGMLQuantizationType
    for t in written[name][1]["q8_0"].tensors:
        f32 = (len(t.shape) == 1 or t.name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight",
                                                     "ffn_gate_inp_shexp.weight")) or not t.name.endswith(".weight"))
        want = Q.F32 if f32 else (Q.Q8_0 if int(t.shape[0]) % 32 == 0 else Q.BF16)
        assert t.tensor_type == want, t.name


def test_qwen3next_transforms(written) -> None:
    folder, readers = written["hybrid-tiny"]
    c = SHAPES["hybrid-tiny"].hf_config()
    t = _tensors(readers["bf16"])
    p = "model.layers.0."
    qkvz = _ckpt(folder, p + "linear_attn.in_proj_qkvz.weight")  # [k heads x (q, k, v, z), hidden]
    dk, nk, dv = c["linear_key_head_dim"], c["linear_num_key_heads"], c["linear_value_head_dim"]
    group = 2 * dk + 2 * (c["linear_num_value_heads"] // nk) * dv
    qkv, gate = _values(t["blk.0.attn_qkv.weight"]), _values(t["blk.0.attn_gate.weight"])
    v_rows = group // 2 - dk
    for g in range(nk):
        rows = qkvz[g * group:(g + 1) * group]
        assert torch.equal(qkv[g * dk:(g + 1) * dk], rows[:dk])  # q of key head g
        assert torch.equal(qkv[nk * dk + g * dk: nk * dk + (g + 1) * dk], rows[dk:2 * dk])  # its k
        assert torch.equal(qkv[2 * nk * dk + g * v_rows: 2 * nk * dk + (g + 1) * v_rows], rows[2 * dk:2 * dk + v_rows])
        assert torch.equal(gate[g * v_rows:(g + 1) * v_rows], rows[2 * dk + v_rows:])  # z
    assert torch.equal(_values(t["blk.0.ssm_a"]), -torch.exp(_ckpt(folder, p + "linear_attn.A_log")))
    assert torch.equal(_values(t["blk.0.attn_norm.weight"]), 1.0 + _ckpt(folder, p + "input_layernorm.weight"))
    assert torch.equal(_values(t["blk.3.attn_k_norm.weight"]), 1.0 + _ckpt(folder, "model.layers.3.self_attn.k_norm.weight"))
    assert torch.equal(_values(t["output_norm.weight"]), 1.0 + _ckpt(folder, "model.norm.weight"))
    assert torch.equal(_values(t["blk.0.ssm_norm.weight"]), _ckpt(folder, p + "linear_attn.norm.weight"))  # gated: no +1
    assert torch.equal(_values(t["blk.0.ssm_conv1d.weight"]), _ckpt(folder, p + "linear_attn.conv1d.weight")[:, 0])


def test_deepseek2_kv_b_split(written) -> None:
    folder, readers = written["mla-tiny"]
    c = SHAPES["mla-tiny"].hf_config()
    t = _tensors(readers["bf16"])
    kv_b = _ckpt(folder, "model.layers.1.self_attn.kv_b_proj.weight")  # [heads x (nope + v), kv_lora]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    k_b, v_b = _values(t["blk.1.attn_k_b.weight"]), _values(t["blk.1.attn_v_b.weight"])  # [heads, kv, nope], [heads, v, kv]
    for h in range(c["num_attention_heads"]):
        rows = kv_b[h * (nope + v):(h + 1) * (nope + v)]
        assert torch.equal(k_b[h], rows[:nope].T)
        assert torch.equal(v_b[h], rows[nope:])
    bias = _ckpt(folder, "model.layers.1.mlp.gate.e_score_correction_bias")
    assert torch.equal(_values(t["blk.1.exp_probs_b.bias"]), bias)


def test_nemotron_h_transforms(written) -> None:
    folder, readers = written["mamba-hybrid-tiny"]
    t = _tensors(readers["bf16"])
    m = "backbone.layers.0.mixer."
    assert torch.equal(_values(t["blk.0.ssm_a"])[:, 0], -torch.exp(_ckpt(folder, m + "A_log")))
    assert torch.equal(_values(t["blk.0.ssm_d"])[:, 0], _ckpt(folder, m + "D"))
    norm = _values(t["blk.0.ssm_norm.weight"])  # [groups, inner / groups]
    assert torch.equal(norm.flatten(), _ckpt(folder, m + "norm.weight"))
    up = _values(t["blk.1.ffn_up_exps.weight"])  # [E, I, H]
    assert torch.equal(up[5], _ckpt(folder, "backbone.layers.1.mixer.experts.5.up_proj.weight"))
    kv = written["mamba-hybrid-tiny"][1]["bf16"].fields["nemotron_h_moe.attention.head_count_kv"]
    pattern = SHAPES["mamba-hybrid-tiny"].hf_config()["hybrid_override_pattern"]
    assert [int(kv.parts[i][0]) for i in kv.data] == [2 if k == "*" else 0 for k in pattern]


def test_unsupported_layouts_are_one_line_errors(tmp_path) -> None:
    from types import SimpleNamespace

    from moeserve.bench.arch_shapes import nemotron_h_config
    from moeserve.bench.gguf_export import write_gguf
    from moeserve.errors import ConfigError

    def shape(name: str, config: dict) -> SimpleNamespace:  # write_gguf reads only these two
        return SimpleNamespace(name=name, hf_config=lambda: config)

    dense = shape("dense-mlp", nemotron_h_config(64, "M-M*E", 4, 2, 8, 8, 32, 2, 256))
    with pytest.raises(ConfigError, match="pattern 'M-M\\*E' has blocks other than ME\\*"):
        write_gguf(None, dense, tmp_path / "x.gguf")  # type: ignore[arg-type]
    other = shape("other", {**SHAPES["hybrid-tiny"].hf_config(), "model_type": "glm4_moe"})
    with pytest.raises(ConfigError, match="no GGUF export for glm4_moe .shape 'other'; written: qwen3_moe, qwen3_next"):
        write_gguf(None, other, tmp_path / "y.gguf")  # type: ignore[arg-type]


def _llama_greedy(llm, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """llama.cpp's greedy tokens after `prompt` and the logits each was picked from ([steps, vocab])."""
    vocab = llm.n_vocab()
    llm.reset()
    tokens, rows = list(prompt), []
    llm.eval(prompt)
    for _ in range(steps):
        logits = torch.from_numpy(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).copy())
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        llm.eval(tokens[-1:])
    return tokens[len(prompt):], torch.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_llama_cpp_on_the_gguf_agrees_with_transformers_and_moeserve(written, name: str) -> None:
    """llama.cpp (optional: llama-cpp-python) on the bf16 GGUF vs transformers in fp32 on the checkpoint, the same
    bf16 weights: every step's logits within bf16 rounding (llama.cpp rounds activations to bf16 before each bf16
    matmul), and llama.cpp's greedy token is transformers' argmax wherever the two best logits are further apart
    than that tolerance; moeserve (fp32) decodes llama.cpp's tokens."""
    pytest.importorskip("llama_cpp")
    transformers = pytest.importorskip("transformers")
    from moeserve.bench.engines import LlamaCppEngine, MoeserveEngine
    from moeserve.bench.gguf_export import gguf_path

    folder = written[name][0]
    prompt, steps = [5, 17, 42, 99, 7, 8, 9, 10], 6
    llama = LlamaCppEngine(str(gguf_path(folder, "bf16")), threads=1, n_ctx=64)
    theirs, llama_logits = _llama_greedy(llama.llm, prompt, steps)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.inference_mode():
        full = ref(torch.tensor([prompt + theirs])).logits[0, len(prompt) - 1:-1].float()  # [steps, vocab]
    scale = full.abs().amax(dim=-1, keepdim=True)
    err = ((llama_logits - full).abs() / scale).amax(dim=-1)  # measured: 0.002-0.005 on the three tiny shapes
    assert (err < TOLERANCE).all(), f"relative logit error per step {err.tolist()}"
    top2 = full.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * TOLERANCE * scale[:, 0]
    assert clear.sum() >= 2, "fewer than 2 steps with a clear greedy choice: pick another prompt"
    best = full.argmax(dim=-1).tolist()
    assert [t for t, c in zip(theirs, clear) if c] == [b for b, c in zip(best, clear) if c]
    # moeserve in fp32 is transformers within 1e-4 (tests/models): its greedy tokens are transformers' argmax, which
    # is the next token of llama.cpp's sequence until llama.cpp first picks another (a near-tie).
    same = next((i for i, (t, b) in enumerate(zip(theirs, best)) if t != b), steps)
    ours = MoeserveEngine(str(folder), dtype="float32", threads=1, max_model_len=64)
    got = ours.decode([prompt], steps - 1).token_ids[0]
    ours.close()
    assert got[:same + 1] == best[:same + 1]
