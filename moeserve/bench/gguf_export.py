"""Write a GGUF of a synthetic benchmark checkpoint, for llama.cpp to run the same weights (one writer per
architecture, `GGUF_WRITERS`, keyed by config.json's model_type; Qwen3-MoE here).

Streaming like the safetensors writer: tensor infos are declared first, then each tensor is read from the
checkpoint, converted (experts of a layer stacked to [E, I, H] as llama.cpp expects) and written before the next.
Weights stay BF16 ("bf16") or are quantized to llama.cpp's Q8_0 ("q8_0"); norms and the router stay F32, as
llama.cpp's own converter keeps them. The vocabulary is declared "no_vocab": the benchmark feeds token ids.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import numpy as np
import torch

from moeserve.bench import pagecache
from moeserve.bench.shape_base import Shape
from moeserve.bench.shapes import BenchShape
from moeserve.checkpoint.folder import Checkpoint, open_checkpoint
from moeserve.errors import ConfigError

GGUF_KINDS = ("bf16", "q8_0")
log = logging.getLogger("moeserve.bench")


def gguf_path(checkpoint_dir: Path, kind: str) -> Path:
    return checkpoint_dir / f"model-{kind}.gguf"


def ensure_gguf(checkpoint_dir: Path, shape: Shape, kind: str = "bf16") -> Path:
    """The GGUF of the checkpoint in `checkpoint_dir`, writing it first if it is not there. A GGUF just written is
    dropped from the page cache (its pages would be charged to this process, and a peer mapping them in a memory
    cgroup of its own would not be: bench/pagecache.py)."""
    out = gguf_path(checkpoint_dir, kind)
    if out.is_file():
        return out
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    write_gguf(open_checkpoint(checkpoint_dir), shape, tmp, kind)
    os.rename(tmp, out)
    log.info("GGUF export %s: %s", out.name, pagecache.drop([out]).describe())
    return out


Loader = tuple[tuple[int, ...], Callable[[], torch.Tensor]]  # (HF-orientation shape, reads the tensor)


def _tensors(ckpt: Checkpoint, shape: BenchShape) -> Iterator[tuple[str, Loader, bool]]:
    """(GGUF name, (shape, loader) in HF orientation, keep-in-F32) in file order."""

    def read(name: str) -> Loader:
        ref = ckpt.ref(name)
        return ref.shape, lambda: ckpt.reader.read(ref)

    def stacked(L: int, proj: str) -> Loader:
        refs = [ckpt.ref(f"model.layers.{L}.mlp.experts.{e}.{proj}.weight") for e in range(shape.num_experts)]
        return (len(refs), *refs[0].shape), lambda: torch.stack([ckpt.reader.read(r) for r in refs])

    yield "token_embd.weight", read("model.embed_tokens.weight"), False
    for L in range(shape.num_layers):
        p, b = f"model.layers.{L}.", f"blk.{L}."
        yield b + "attn_norm.weight", read(p + "input_layernorm.weight"), True
        yield b + "attn_q.weight", read(p + "self_attn.q_proj.weight"), False
        yield b + "attn_k.weight", read(p + "self_attn.k_proj.weight"), False
        yield b + "attn_v.weight", read(p + "self_attn.v_proj.weight"), False
        yield b + "attn_output.weight", read(p + "self_attn.o_proj.weight"), False
        yield b + "attn_q_norm.weight", read(p + "self_attn.q_norm.weight"), True
        yield b + "attn_k_norm.weight", read(p + "self_attn.k_norm.weight"), True
        yield b + "ffn_norm.weight", read(p + "post_attention_layernorm.weight"), True
        yield b + "ffn_gate_inp.weight", read(p + "mlp.gate.weight"), True
        yield b + "ffn_gate_exps.weight", stacked(L, "gate_proj"), False
        yield b + "ffn_up_exps.weight", stacked(L, "up_proj"), False
        yield b + "ffn_down_exps.weight", stacked(L, "down_proj"), False
    yield "output_norm.weight", read("model.norm.weight"), True
    yield "output.weight", read("lm_head.weight"), False


def _info(hf_shape: tuple[int, ...], kind: str, keep_f32: bool) -> tuple[tuple[int, ...], type, int, object]:
    """(numpy shape, numpy dtype, nbytes, GGML type or None) of a tensor as `_encode` will write it."""
    import gguf

    Q = gguf.GGMLQuantizationType
    numel = int(np.prod(hf_shape))
    if keep_f32 or len(hf_shape) == 1:
        return hf_shape, np.float32, 4 * numel, None
    if kind == "bf16":
        return hf_shape, np.uint16, 2 * numel, Q.BF16
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_0]
    byte_shape = (*hf_shape[:-1], hf_shape[-1] // block_elems * block_bytes)
    return byte_shape, np.uint8, int(np.prod(byte_shape)), Q.Q8_0


def _encode(t: torch.Tensor, kind: str, keep_f32: bool) -> tuple[np.ndarray, object]:
    import gguf

    Q = gguf.GGMLQuantizationType
    if keep_f32 or t.dim() == 1:
        return t.float().numpy(), None
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), Q.BF16
    return gguf.quants.quantize(t.float().numpy(), Q.Q8_0), Q.Q8_0


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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if kind == "bf16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    entries = list(_tensors(ckpt, shape))
    # Tensor infos (shapes, byte sizes) go first in the file; they follow from the shapes alone.
    for name, (hf_shape, _), keep in entries:
        np_shape, np_dtype, nbytes, raw = _info(hf_shape, kind, keep)
        w.add_tensor_info(name, np_shape, np.dtype(np_dtype), nbytes, raw_dtype=raw)  # type: ignore[arg-type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, (_, load), keep in entries:
        arr, _ = _encode(load(), kind, keep)
        w.write_tensor_data(arr)
    w.close()


GGUF_WRITERS: dict[str, Callable[[Checkpoint, Shape, Path, str], None]] = {"qwen3_moe": _write_qwen3_moe}
