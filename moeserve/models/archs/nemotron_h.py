"""Nemotron-H (NemotronHForCausalLM, model_type nemotron_h: Nemotron-3-Nano, Nemotron-Cascade-2): a hybrid whose
every layer is ONE block, `h += mixer(norm(h))`, its kind given by `hybrid_override_pattern` (one character per
layer) or `layers_block_type`:

    M  linear_attention  Mamba-2 mixer (models/mixers/mamba2.py): recurrent SSM state and conv state per sequence
    *  full_attention    GQA attention without rotary embeddings (transformers' NemotronHAttention rotates nothing)
    E  moe               noaux_tc routing (sigmoid, correction bias, n_group / topk_group, routed_scaling_factor),
                         non-gated relu2 experts (up -> relu(x)^2 -> down) and one relu2 shared expert
    -  mlp               a relu2 MLP

Each block becomes a DecoderLayer with the other part absent (ModelSpec.mixerless_layers / mlpless_layers): an
absent part adds nothing to the residual stream, so the sums are those of one block per layer. Norms multiply by
their weight in fp32 before the cast (NemotronHRMSNorm), like gpt-oss's. Weights live under `backbone.` as the
published checkpoints (and transformers' save_pretrained) store them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.models.archs.glm4_moe import noaux_tc_moe, require
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import ConfigReader, MambaSpec, ModelSpec, RopeSpec, base_attention

KINDS = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
_P = "backbone.layers.{L}."
NEMOTRON_H_NAMES = WeightNames(
    embed="backbone.embeddings.weight", final_norm="backbone.norm_f.weight", lm_head="lm_head",
    input_norm=_P + "norm.weight", post_norm=_P + "norm.weight",  # one norm per block: the part present reads it
    q_proj=_P + "mixer.q_proj", k_proj=_P + "mixer.k_proj", v_proj=_P + "mixer.v_proj", o_proj=_P + "mixer.o_proj",
    router=_P + "mixer.gate", router_correction_bias=_P + "mixer.gate.e_score_correction_bias",
    expert_up=_P + "mixer.experts.{E}.up_proj", expert_down=_P + "mixer.experts.{E}.down_proj",
    dense_up=_P + "mixer.up_proj", dense_down=_P + "mixer.down_proj",
    shared_up=_P + "mixer.shared_experts.up_proj", shared_down=_P + "mixer.shared_experts.down_proj",
)


def block_kinds(c: ConfigReader) -> list[str]:
    """Per layer: linear_attention / full_attention / moe / mlp, from layers_block_type or hybrid_override_pattern."""
    kinds = c.get("layers_block_type", "layer_types", default=None)
    if kinds is None:
        pattern = c.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or any(ch not in KINDS for ch in pattern):
            raise CheckpointError(f"{c.where}: 'hybrid_override_pattern' must be a string of M, *, E and - (one "
                                  "per layer)")
        kinds = [KINDS[ch] for ch in pattern]
    if not isinstance(kinds, list) or not kinds or any(k not in KINDS.values() for k in kinds):
        raise CheckpointError(f"{c.where}: 'layers_block_type' must list one of {', '.join(KINDS.values())} per layer")
    if len(kinds) > 4096:
        raise CheckpointError(f"{c.where}: {len(kinds)} layers is out of range [1, 4096]")
    return kinds


@register
class NemotronH(Architecture):
    name = "NemotronHForCausalLM"
    names = NEMOTRON_H_NAMES
    unserved = (("mtp.", "multi-token-prediction layers (mtp.*): greedy decoding does not use them"),)

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        require(c, self.name, mlp_hidden_act="relu2", mamba_hidden_act="silu")
        if c.get("moe_latent_size", default=None) is not None:
            raise UnsupportedModelError(f"{where}: moe_latent_size is not supported for {self.name} (experts on the "
                                        "hidden states)")
        kinds = block_kinds(c)
        num_layers = len(kinds)
        layers = {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in KINDS.values()}
        mixers = set(layers["linear_attention"] + layers["full_attention"])
        eps = c.float("layer_norm_epsilon", default=1e-5)
        moe = noaux_tc_moe(c, groups=(1, 1), routed_scaling_factor=1.0)
        moe = replace(moe, expert_kind="relu2",
                      shared_intermediate_size=c.int("moe_shared_expert_intermediate_size", default=0)
                      * c.int("n_shared_experts", default=1))
        return ModelSpec(
            architecture=self.name,
            model_type=str(c.get("model_type", default="nemotron_h")),
            hidden_size=c.int("hidden_size"),
            num_layers=num_layers,
            vocab_size=c.int("vocab_size"),
            rms_norm_eps=eps,
            max_position_embeddings=c.int("max_position_embeddings", default=4096),
            tie_word_embeddings=c.bool("tie_word_embeddings", default=False),
            dense_intermediate_size=c.int("intermediate_size"),
            moe_layers=tuple(k == "moe" for k in kinds),
            attention=base_attention(c, num_layers, qkv_bias=c.bool("attention_bias", default=False),
                                     o_bias=c.bool("attention_bias", default=False)),
            rope=RopeSpec(theta=10000.0, rope_type="none"),  # attention layers rotate nothing
            moe=moe,
            config_dtype=c.optional_str("dtype", "torch_dtype"),
            norm_style="scale_in_fp32",
            mamba=MambaSpec(
                layers=layers["linear_attention"],
                num_heads=c.int("mamba_num_heads"),
                head_dim=c.int("mamba_head_dim"),
                n_groups=c.int("n_groups", default=1),
                state_size=c.int("ssm_state_size"),
                conv_kernel=c.int("conv_kernel", default=4),
                conv_bias=c.bool("use_conv_bias", default=True),
                proj_bias=c.bool("use_bias", default=False),
                eps=eps,
                time_step_min=c.float("time_step_min", default=0.001),
            ),
            mixerless_layers=layers["moe"] + layers["mlp"],
            mlpless_layers=tuple(sorted(mixers)),
            mlp_kind="relu2",
        )
