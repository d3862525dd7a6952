"""GGUF writers for the hybrid and latent-attention bench shapes, so llama.cpp runs the same weights beside moeserve:
Qwen3-Next (llama.cpp `qwen3next`), DeepSeek-V3 (`deepseek2`) and Nemotron-H with MoE blocks (`nemotron_h_moe`).

One `ArchGGUF` per architecture, registered in `GGUF_ARCH_WRITERS` by config.json's model_type (gguf_export.py
merges it into `GGUF_WRITERS`; nothing branches on the architecture). Each says llama.cpp's metadata keys (those its
loader reads for that architecture: src/models/<arch>.cpp `load_arch_hparams`) and its tensors with the transforms
llama.cpp's converter applies (conversion/qwen.py, deepseek.py, nemotron.py of the llama.cpp bundled with
llama-cpp-python 0.3.36):

- qwen3next: `in_proj_qkvz` (per key-head groups of [q, k, v, z]) regrouped into `attn_qkv` ([all q, all k, all v])
  and `attn_gate` (all z); `A_log` -> `ssm_a` = -exp(A_log); conv1d squeezed to [channels, kernel]; the
  zero-centred norms (all but the gated `linear_attn.norm`) stored as 1 + w, in fp32 (as moeserve and transformers
  compute them; llama.cpp's converter adds 1 in the checkpoint's dtype);
- deepseek2: MLA kept latent: `kv_b_proj` split per head into `attn_k_b` (the nope rows, transposed: [heads,
  kv_lora, nope]) and `attn_v_b`; head_count_kv 1 (one latent row per token), key/value lengths of the latent and
  of the decompressed heads (`_mla`); noaux_tc as sigmoid gating, groups, `exp_probs_b` = the correction bias;
- nemotron_h_moe: `A_log` -> -exp as [heads, 1], `D` as [heads, 1], the grouped norm as [groups, inner / groups],
  per-layer head_count_kv / feed_forward_length arrays (0 where a block has no attention / MLP: how llama.cpp
  tells Mamba blocks apart), relu2 experts (up + down, no gate).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from moeserve.bench.gguf_file import GGUFTensor, file_type, identity, open_writer, write_tensors
from moeserve.bench.shape_base import Shape
from moeserve.checkpoint.folder import Checkpoint
from moeserve.errors import ConfigError

Config = dict[str, Any]


def one_plus(w: torch.Tensor) -> torch.Tensor:
    return 1.0 + w


def neg_exp(w: torch.Tensor) -> torch.Tensor:
    return -torch.exp(w)


def squeeze_conv(w: torch.Tensor) -> torch.Tensor:  # [channels, 1, kernel] -> [channels, kernel]
    return w.reshape(w.shape[0], w.shape[-1])


def column(w: torch.Tensor) -> torch.Tensor:  # [heads] -> [heads, 1]
    return w.reshape(-1, 1)


def stacked_experts(prefix: str, count: int, proj: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{e}.{proj}.weight" for e in range(count))


class ArchGGUF(ABC):
    """The GGUF of one architecture: llama.cpp's name for it, its metadata and its tensors."""

    arch: str  # llama.cpp's architecture name (general.architecture)

    @abstractmethod
    def metadata(self, w: Any, config: Config) -> None:
        """Add every key llama.cpp's loader reads for this architecture (w: a gguf.GGUFWriter)."""

    @abstractmethod
    def tensors(self, config: Config) -> Iterator[GGUFTensor]:
        """Every tensor llama.cpp loads, from the checkpoint's tensors (HF names), converted as its converter does."""

    def write(self, ckpt: Checkpoint, shape: Shape, out: Path, kind: str) -> None:
        config = shape.hf_config()
        w = open_writer(out, self.arch)
        w.add_block_count(config["num_hidden_layers"])
        w.add_context_length(config["max_position_embeddings"])
        w.add_embedding_length(config["hidden_size"])
        w.add_head_count(config["num_attention_heads"])
        w.add_vocab_size(config["vocab_size"])
        w.add_expert_count(config.get("num_experts", config.get("n_routed_experts")))
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        self.metadata(w, config)
        w.add_tokenizer_model("no_vocab")  # the benchmark feeds token ids
        w.add_file_type(file_type(kind))
        write_tensors(w, ckpt, self.tensors(config), kind)


def _outer(embed: str, norm: str, norm_transform: Callable[[torch.Tensor], torch.Tensor] = identity
           ) -> list[GGUFTensor]:
    return [GGUFTensor("token_embd.weight", (embed,)), GGUFTensor("output_norm.weight", (norm,), norm_transform),
            GGUFTensor("output.weight", ("lm_head.weight",))]


def _experts(b: str, prefix: str, count: int, projs: tuple[str, ...]) -> Iterator[GGUFTensor]:
    for proj in projs:  # a layer's experts stacked to [E, out, in]: GGUF [in, out, E]
        yield GGUFTensor(f"{b}ffn_{proj}_exps.weight", stacked_experts(prefix, count, f"{proj}_proj"))


class Qwen3NextGGUF(ArchGGUF):
    arch = "qwen3next"

    def metadata(self, w: Any, config: Config) -> None:
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_head_count_kv(config["num_key_value_heads"])
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
        w.add_rope_freq_base(config["rope_theta"])
        w.add_rope_dimension_count(int(config["head_dim"] * config["partial_rotary_factor"]))
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if config["linear_key_head_dim"] != config["linear_value_head_dim"]:
            raise ConfigError("llama.cpp's qwen3next needs linear_key_head_dim == linear_value_head_dim")
        w.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
        w.add_ssm_state_size(config["linear_key_head_dim"])
        w.add_ssm_group_count(config["linear_num_key_heads"])
        w.add_ssm_time_step_rank(config["linear_num_value_heads"])
        w.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
        w.add_full_attention_interval(config["full_attention_interval"])

    def tensors(self, config: Config) -> Iterator[GGUFTensor]:
        yield from _outer("model.embed_tokens.weight", "model.norm.weight", one_plus)
        interval = config["full_attention_interval"]
        for L in range(config["num_hidden_layers"]):
            p, b = f"model.layers.{L}.", f"blk.{L}."
            yield GGUFTensor(b + "attn_norm.weight", (p + "input_layernorm.weight",), one_plus)
            yield GGUFTensor(b + "post_attention_norm.weight", (p + "post_attention_layernorm.weight",), one_plus)
            yield from (self._full(p, b) if (L + 1) % interval == 0 else self._linear(p, b, config))
            yield GGUFTensor(b + "ffn_gate_inp.weight", (p + "mlp.gate.weight",))
            yield from _experts(b, p + "mlp.experts", config["num_experts"], ("gate", "up", "down"))
            yield GGUFTensor(b + "ffn_gate_inp_shexp.weight", (p + "mlp.shared_expert_gate.weight",))
            for proj in ("gate", "up", "down"):
                yield GGUFTensor(f"{b}ffn_{proj}_shexp.weight", (f"{p}mlp.shared_expert.{proj}_proj.weight",))

    def _full(self, p: str, b: str) -> Iterator[GGUFTensor]:
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            yield GGUFTensor(f"{b}attn_{ours}.weight", (f"{p}self_attn.{theirs}_proj.weight",))
        yield GGUFTensor(b + "attn_q_norm.weight", (p + "self_attn.q_norm.weight",), one_plus)
        yield GGUFTensor(b + "attn_k_norm.weight", (p + "self_attn.k_norm.weight",), one_plus)

    def _linear(self, p: str, b: str, config: Config) -> Iterator[GGUFTensor]:
        a = p + "linear_attn."
        qkv, gate = qkvz_regrouped(config)
        yield GGUFTensor(b + "attn_qkv.weight", (a + "in_proj_qkvz.weight",), qkv)
        yield GGUFTensor(b + "attn_gate.weight", (a + "in_proj_qkvz.weight",), gate)
        yield GGUFTensor(b + "ssm_ba.weight", (a + "in_proj_ba.weight",))
        yield GGUFTensor(b + "ssm_conv1d.weight", (a + "conv1d.weight",), squeeze_conv)
        yield GGUFTensor(b + "ssm_a", (a + "A_log",), neg_exp)
        yield GGUFTensor(b + "ssm_dt.bias", (a + "dt_bias",))
        yield GGUFTensor(b + "ssm_norm.weight", (a + "norm.weight",))  # the gated norm: plain weight, no + 1
        yield GGUFTensor(b + "ssm_out.weight", (a + "out_proj.weight",))


def qkvz_regrouped(config: Config) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """Transforms of `in_proj_qkvz` [k_heads x (q, k, v, z rows of the group), hidden] into [all q, all k, all v]
    rows and all z rows (the order of the conv channels and of the gate)."""
    nk, dk, dv = config["linear_num_key_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"]
    v_per_group = config["linear_num_value_heads"] // nk * dv
    sizes = [dk, dk, v_per_group, v_per_group]

    def parts(w: torch.Tensor) -> list[torch.Tensor]:
        groups = w.reshape(nk, sum(sizes), w.shape[-1])  # [k heads, q+k+v+z rows, hidden]
        return [t.reshape(-1, w.shape[-1]) for t in torch.split(groups, sizes, dim=1)]

    return (lambda w: torch.cat(parts(w)[:3])), (lambda w: parts(w)[3])


class DeepseekV3GGUF(ArchGGUF):
    arch = "deepseek2"

    def metadata(self, w: Any, config: Config) -> None:
        kv_lora, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_head_count_kv(1)  # MLA as MQA over one latent row per token
        w.add_rope_freq_base(config["rope_theta"])
        w.add_rope_dimension_count(rope)
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        if config.get("q_lora_rank"):
            w.add_q_lora_rank(config["q_lora_rank"])
        w.add_kv_lora_rank(kv_lora)
        w.add_key_length(kv_lora + rope)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(config["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(config["v_head_dim"])
        _grouped_routing(w, config)
        w.add_expert_gating_func(_gating(config["scoring_func"]))

    def tensors(self, config: Config) -> Iterator[GGUFTensor]:
        yield from _outer("model.embed_tokens.weight", "model.norm.weight")
        k_b, v_b = kv_b_split(config)
        for L in range(config["num_hidden_layers"]):
            p, b = f"model.layers.{L}.", f"blk.{L}."
            a = p + "self_attn."
            yield GGUFTensor(b + "attn_norm.weight", (p + "input_layernorm.weight",))
            yield GGUFTensor(b + "ffn_norm.weight", (p + "post_attention_layernorm.weight",))
            if config.get("q_lora_rank"):
                yield GGUFTensor(b + "attn_q_a.weight", (a + "q_a_proj.weight",))
                yield GGUFTensor(b + "attn_q_a_norm.weight", (a + "q_a_layernorm.weight",))
                yield GGUFTensor(b + "attn_q_b.weight", (a + "q_b_proj.weight",))
            else:
                yield GGUFTensor(b + "attn_q.weight", (a + "q_proj.weight",))
            yield GGUFTensor(b + "attn_kv_a_mqa.weight", (a + "kv_a_proj_with_mqa.weight",))
            yield GGUFTensor(b + "attn_kv_a_norm.weight", (a + "kv_a_layernorm.weight",))
            yield GGUFTensor(b + "attn_k_b.weight", (a + "kv_b_proj.weight",), k_b)
            yield GGUFTensor(b + "attn_v_b.weight", (a + "kv_b_proj.weight",), v_b)
            yield GGUFTensor(b + "attn_output.weight", (a + "o_proj.weight",))
            yield from self._mlp(p + "mlp.", b, L < config["first_k_dense_replace"], config)

    def _mlp(self, m: str, b: str, dense: bool, config: Config) -> Iterator[GGUFTensor]:
        if dense:
            for proj in ("gate", "up", "down"):
                yield GGUFTensor(f"{b}ffn_{proj}.weight", (f"{m}{proj}_proj.weight",))
            return
        yield GGUFTensor(b + "ffn_gate_inp.weight", (m + "gate.weight",))
        yield GGUFTensor(b + "exp_probs_b.bias", (m + "gate.e_score_correction_bias",))
        yield from _experts(b, m + "experts", config["n_routed_experts"], ("gate", "up", "down"))
        for proj in ("gate", "up", "down"):
            yield GGUFTensor(f"{b}ffn_{proj}_shexp.weight", (f"{m}shared_experts.{proj}_proj.weight",))


def kv_b_split(config: Config) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """Transforms of `kv_b_proj` [heads x (nope + v rows), kv_lora] into k_b [heads, kv_lora, nope] (transposed, for
    the absorbed query) and v_b [heads, v, kv_lora]."""
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]

    def split(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(w.reshape(heads, nope + v, w.shape[-1]), [nope, v], dim=1)

    return (lambda w: split(w)[0].transpose(1, 2)), (lambda w: split(w)[1])


def _grouped_routing(w: Any, config: Config) -> None:
    """The keys of DeepSeek-style routing (noaux_tc and Nemotron-H's): shared experts, scaling, groups."""
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_weights_scale(config["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(config["norm_topk_prob"]))
    w.add_expert_group_count(config["n_group"])
    w.add_expert_group_used_count(config["topk_group"])


def _gating(scoring_func: str) -> Any:
    import gguf

    funcs = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
    if scoring_func not in funcs:
        raise ConfigError(f"no GGUF gating function for scoring_func {scoring_func!r} (known: {', '.join(funcs)})")
    return funcs[scoring_func]


class NemotronHGGUF(ArchGGUF):
    """Nemotron-H with MoE blocks (llama.cpp's nemotron_h_moe): M (Mamba-2), E (MoE) and * (attention) blocks."""

    arch = "nemotron_h_moe"
    KINDS = "ME*"

    def _pattern(self, config: Config) -> str:
        pattern = config["hybrid_override_pattern"]
        if set(pattern) - set(self.KINDS):
            raise ConfigError(f"GGUF export of nemotron_h: block pattern {pattern!r} has blocks other than "
                              f"{self.KINDS} (llama.cpp's nemotron_h_moe has no dense MLP block)")
        return pattern

    def metadata(self, w: Any, config: Config) -> None:
        pattern = self._pattern(config)
        w.add_feed_forward_length([config["moe_intermediate_size"] if k == "E" else 0 for k in pattern])
        w.add_head_count_kv([config["num_key_value_heads"] if k == "*" else 0 for k in pattern])
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
        w.add_layer_norm_eps(config["layer_norm_epsilon"])
        w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
        w.add_rope_scaling_finetuned(False)  # no rotary embedding in this hybrid
        w.add_ssm_conv_kernel(config["conv_kernel"])
        w.add_ssm_state_size(config["ssm_state_size"])
        w.add_ssm_group_count(config["n_groups"])
        w.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
        w.add_ssm_time_step_rank(config["mamba_num_heads"])
        w.add_expert_shared_feed_forward_length(config["moe_shared_expert_intermediate_size"])
        _grouped_routing(w, config)  # sigmoid in llama.cpp's nemotron_h_moe graph whatever the key says

    def tensors(self, config: Config) -> Iterator[GGUFTensor]:
        yield from _outer("backbone.embeddings.weight", "backbone.norm_f.weight")
        blocks = {"M": self._mamba, "E": self._moe, "*": self._attention}
        for L, kind in enumerate(self._pattern(config)):
            p, b = f"backbone.layers.{L}.", f"blk.{L}."
            yield GGUFTensor(b + "attn_norm.weight", (p + "norm.weight",))
            yield from blocks[kind](p + "mixer.", b, config)

    def _mamba(self, m: str, b: str, config: Config) -> Iterator[GGUFTensor]:
        groups = config["n_groups"]
        yield GGUFTensor(b + "ssm_in.weight", (m + "in_proj.weight",))
        yield GGUFTensor(b + "ssm_conv1d.weight", (m + "conv1d.weight",), squeeze_conv)
        yield GGUFTensor(b + "ssm_conv1d.bias", (m + "conv1d.bias",))
        yield GGUFTensor(b + "ssm_dt.bias", (m + "dt_bias",))
        yield GGUFTensor(b + "ssm_a", (m + "A_log",), lambda w: column(neg_exp(w)))
        yield GGUFTensor(b + "ssm_d", (m + "D",), column)
        yield GGUFTensor(b + "ssm_norm.weight", (m + "norm.weight",), lambda w: w.reshape(groups, -1))
        yield GGUFTensor(b + "ssm_out.weight", (m + "out_proj.weight",))

    def _moe(self, m: str, b: str, config: Config) -> Iterator[GGUFTensor]:
        yield GGUFTensor(b + "ffn_gate_inp.weight", (m + "gate.weight",))
        yield GGUFTensor(b + "exp_probs_b.bias", (m + "gate.e_score_correction_bias",))
        yield from _experts(b, m + "experts", config["n_routed_experts"], ("up", "down"))
        for proj in ("up", "down"):
            yield GGUFTensor(f"{b}ffn_{proj}_shexp.weight", (f"{m}shared_experts.{proj}_proj.weight",))

    def _attention(self, m: str, b: str, config: Config) -> Iterator[GGUFTensor]:
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            yield GGUFTensor(f"{b}attn_{ours}.weight", (f"{m}{theirs}_proj.weight",))


GGUF_ARCH_WRITERS: dict[str, Callable[[Checkpoint, Shape, Path, str], None]] = {
    "qwen3_next": Qwen3NextGGUF().write, "deepseek_v3": DeepseekV3GGUF().write, "nemotron_h": NemotronHGGUF().write}
