"""Write a GGUF of a synthetic benchmark checkpoint, for llama.cpp to run the same weights (one writer per
architecture, `GGUF_WRITERS`, keyed by config.json's model_type: Qwen3-MoE here, Qwen3-Next, DeepSeek-V3 and
Nemotron-H in bench/gguf_arch.py).

Streaming like the safetensors writer (bench/gguf_file.py): tensor infos are declared first, then each tensor is
read from the checkpoint, converted (experts of a layer stacked to [E, I, H] as llama.cpp expects) and written
before the next. Weights stay BF16 ("bf16") or are quantized to llama.cpp's Q8_0 ("q8_0"); norms and the router
stay F32, as llama.cpp's own converter keeps them. The 4-bit kinds ("q4_0", "q4_k_m") are made from the BF16 GGUF
by llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize` runs: Q4_K_M's mix of Q4_K and Q6_K
by its rule), as users make them. The vocabulary is declared "no_vocab": the benchmark feeds
token ids.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch

from moeserve.bench import gguf_arch, gguf_file
from moeserve.bench.gguf_file import GGUF_KINDS, Entry
from moeserve.bench.shape_base import Shape
from moeserve.bench.shapes import BenchShape
from moeserve.checkpoint.folder import Checkpoint, open_checkpoint
from moeserve.errors import ConfigError
from moeserve.memory import pagecache

__all__ = ["GGUF_KINDS", "GGUF_WRITERS", "LLAMA_QUANTIZED", "ensure_gguf", "gguf_path", "write_gguf"]
log = logging.getLogger("moeserve.bench")
# GGUF kinds llama.cpp's quantizer makes from the BF16 GGUF: kind -> its llama_ftype (LLAMA_FTYPE_MOSTLY_*)
LLAMA_QUANTIZED = {"q4_0": 2, "q4_k_m": 15}


def gguf_path(checkpoint_dir: Path, kind: str) -> Path:
    return checkpoint_dir / f"model-{kind}.gguf"


def ensure_gguf(checkpoint_dir: Path, shape: Shape, kind: str = "bf16") -> Path:
    """The GGUF of the checkpoint in `checkpoint_dir`, writing it first if it is not there. A GGUF just written is
    dropped from the page cache (its pages would be charged to this process, and a peer mapping them in a memory
    cgroup of its own would not be: memory/pagecache.py)."""
    out = gguf_path(checkpoint_dir, kind)
    if out.is_file():
        return out
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    if kind in LLAMA_QUANTIZED:
        quantize_gguf(ensure_gguf(checkpoint_dir, shape, "bf16"), tmp, kind)
    else:
        write_gguf(open_checkpoint(checkpoint_dir), shape, tmp, kind)
    os.rename(tmp, out)
    log.info("GGUF export %s: %s", out.name, pagecache.drop([out]).describe())
    return out


def quantize_gguf(src: Path, out: Path, kind: str) -> None:
    """llama.cpp's quantizer (llama-cpp-python's binding of `llama_model_quantize`) from the GGUF `src` to `out`."""
    import llama_cpp

    if kind not in LLAMA_QUANTIZED:
        raise ValueError(f"llama.cpp quantizes to {', '.join(LLAMA_QUANTIZED)}, not {kind!r}")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_QUANTIZED[kind]
    params.nthread = len(os.sched_getaffinity(0))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise ConfigError(f"llama.cpp could not quantize {src.name} to {kind} (llama_model_quantize returned {rc})")


def _tensors(ckpt: Checkpoint, shape: BenchShape) -> Iterator[Entry]:
    """(GGUF name, HF-orientation shape, loader, keep-in-F32) in file order."""

    def read(gguf_name: str, name: str, keep: bool = False) -> Entry:
        ref = ckpt.ref(name)
        return gguf_name, ref.shape, lambda: ckpt.reader.read(ref), keep

    def stacked(gguf_name: str, L: int, proj: str) -> Entry:  # a layer's experts, stacked to [E, out, in]
        refs = [ckpt.ref(f"model.layers.{L}.mlp.experts.{e}.{proj}.weight") for e in range(shape.num_experts)]
        return gguf_name, (len(refs), *refs[0].shape), lambda: torch.stack([ckpt.reader.read(r) for r in refs]), False

    yield read("token_embd.weight", "model.embed_tokens.weight")
    for L in range(shape.num_layers):
        p, b = f"model.layers.{L}.", f"blk.{L}."
        yield read(b + "attn_norm.weight", p + "input_layernorm.weight", True)
        yield read(b + "attn_q.weight", p + "self_attn.q_proj.weight")
        yield read(b + "attn_k.weight", p + "self_attn.k_proj.weight")
        yield read(b + "attn_v.weight", p + "self_attn.v_proj.weight")
        yield read(b + "attn_output.weight", p + "self_attn.o_proj.weight")
        yield read(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", True)
        yield read(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", True)
        yield read(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", True)
        yield read(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", True)
        for proj in ("gate", "up", "down"):
            yield stacked(f"{b}ffn_{proj}_exps.weight", L, f"{proj}_proj")
    yield read("output_norm.weight", "model.norm.weight", True)
    yield read("output.weight", "lm_head.weight")


def write_gguf(ckpt: Checkpoint, shape: Shape, out: Path, kind: str = "bf16") -> None:
    """Write `ckpt` (the synthetic checkpoint of `shape`) as a GGUF at `out`, in `kind` (bf16 or q8_0); ConfigError
    for an architecture without a writer here."""
    if kind not in GGUF_KINDS:
        raise ValueError(f"GGUF kind must be one of {GGUF_KINDS}")
    model_type = shape.hf_config()["model_type"]
    if model_type not in GGUF_WRITERS:
        raise ConfigError(f"no GGUF export for {model_type} (shape '{shape.name}'; written: {', '.join(GGUF_WRITERS)})")
    GGUF_WRITERS[model_type](ckpt, shape, out, kind)


def _write_qwen3_moe(ckpt: Checkpoint, any_shape: Shape, out: Path, kind: str) -> None:
    import gguf

    shape = cast(BenchShape, any_shape)  # the writer of model_type qwen3_moe: only BenchShape has it
    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_block_count(shape.num_layers)
    w.add_context_length(shape.max_position_embeddings)
    w.add_embedding_length(shape.hidden_size)
    w.add_feed_forward_length(4 * shape.moe_intermediate_size)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(shape.num_experts)
    w.add_expert_used_count(shape.top_k)
    w.add_expert_feed_forward_length(shape.moe_intermediate_size)
    w.add_vocab_size(shape.vocab_size)
    w.add_tokenizer_model("no_vocab")
    w.add_file_type(gguf_file.file_type(kind))
    gguf_file.write_entries(w, _tensors(ckpt, shape), kind)


GGUF_WRITERS: dict[str, Callable[[Checkpoint, Shape, Path, str], None]] = {
    "qwen3_moe": _write_qwen3_moe, **gguf_arch.GGUF_ARCH_WRITERS}
