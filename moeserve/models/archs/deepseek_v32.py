"""DeepSeek Sparse Attention models: DeepSeek-V3.2 (DeepseekV32ForCausalLM, model_type deepseek_v32) and GLM-5.x
(GlmMoeDsaForCausalLM, glm_moe_dsa). DeepSeek-V3's model (deepseek_v3.py: MLA, noaux_tc routing, shared experts,
dense first layers) with a lightning indexer in every attention layer choosing the index_topk cached latent rows each
query attends (models/mixers/indexer.py; its keys cached beside the latent: state/kinds.py IndexedLatentKV).

- MLA's rotary is always DeepSeek's interleaved pairs (transformers' classes have no rope_interleave); the indexer's is
  half-split in DeepSeek-V3.2 and interleaved in GLM-5.
- The indexer reads MLA's query latent, so q_lora_rank is required.
- GLM-5's "shared" indexer layers (indexer_types, index_topk_pattern, index_topk_freq): no indexer of their own,
  they attend the keys the last "full" layer before them chose (IndexerSpec.shared). transformers' default is every
  layer "full".
- Defaults for fields config.json leaves out: transformers 5.24's config classes (DeepSeek-V3.2: 8 groups of which
  4 kept, 64 indexer heads; GLM-5: one group, 32 indexer heads, rms_norm_eps 1e-5).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moeserve.errors import UnsupportedModelError
from moeserve.models.archs.deepseek_v3 import deepseek_v3_spec
from moeserve.models.archs.glm4_moe import SHARED_EXPERTS_NAMES
from moeserve.models.registry import Architecture, register
from moeserve.models.spec import ConfigReader, IndexerSpec, ModelSpec


def dsa_spec(spec: ModelSpec, c: ConfigReader, index_heads: int, interleaved: bool) -> ModelSpec:
    """`spec` (DeepSeek-V3's, of config `c`) with the lightning indexer of config.json's index_* fields
    (`index_heads`: index_n_heads' default) and MLA's rotary interleaved."""
    assert spec.mla is not None
    if spec.mla.q_lora_rank is None:
        raise UnsupportedModelError(f"{c.where}: {spec.architecture} needs q_lora_rank (its indexer reads the "
                                    "query's low-rank latent)")
    indexer = IndexerSpec(n_heads=c.int("index_n_heads", default=index_heads),
                          head_dim=c.int("index_head_dim", default=128), topk=c.int("index_topk", default=2048),
                          interleaved_rope=interleaved)
    if indexer.head_dim < spec.mla.qk_rope_head_dim:
        raise UnsupportedModelError(f"{c.where}: index_head_dim={indexer.head_dim} is less than qk_rope_head_dim="
                                    f"{spec.mla.qk_rope_head_dim} (the indexer rotates that many of its values)")
    return replace(spec, mla=replace(spec.mla, interleaved_rope=True, indexer=indexer))


@register
class DeepseekV32(Architecture):
    name = "DeepseekV32ForCausalLM"
    names = SHARED_EXPERTS_NAMES

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        spec = deepseek_v3_spec(self.name, config, where, model_type="deepseek_v32", max_positions=163840)
        return dsa_spec(spec, ConfigReader(config, where), index_heads=64, interleaved=False)


@register
class GlmMoeDsa(Architecture):
    name = "GlmMoeDsaForCausalLM"
    names = SHARED_EXPERTS_NAMES

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        types = indexer_types(c)
        if types and types[0] != "full":
            raise UnsupportedModelError(f"{where}: indexer_types[0] is {types[0]!r}: the first layer has no earlier "
                                        "layer's key choice to reuse")
        spec = deepseek_v3_spec(self.name, config, where, model_type="glm_moe_dsa", max_positions=202752,
                                rms_norm_eps=1e-5, groups=(1, 1))
        spec = dsa_spec(spec, c, index_heads=32, interleaved=True)
        assert spec.mla is not None and spec.mla.indexer is not None
        shared = tuple(i for i, kind in enumerate(types) if kind == "shared")
        return replace(spec, mla=replace(spec.mla, indexer=replace(spec.mla.indexer, shared=shared)))


def indexer_types(c: ConfigReader) -> list[str]:
    """GLM-5's per-layer indexer kinds as transformers' GlmMoeDsaConfig derives them: indexer_types, else
    index_topk_pattern ("F" full, "S" shared), else every layer i with max(i - offset + 1, 0) % index_topk_freq == 0
    full (offset index_skip_topk_offset, 2)."""
    num_layers = c.int("num_hidden_layers")
    types = c.get("indexer_types", default=None)
    pattern = c.get("index_topk_pattern", default=None)
    if types is None and isinstance(pattern, str):
        types = [{"F": "full", "S": "shared"}.get(ch, ch) for ch in pattern]
    elif types is None and pattern is not None:
        types = pattern
    if types is None:
        freq, offset = max(c.int("index_topk_freq", default=1), 1), c.int("index_skip_topk_offset", default=2)
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"full", "shared"}:
        raise UnsupportedModelError(f"{c.where}: 'indexer_types' must list 'full' or 'shared' for each of the "
                                    f"{num_layers} layers")
    return types
