"""Kimi-K2.5 / K2.6 (Kimi_K25ForConditionalGeneration in transformers, KimiK25ForConditionalGeneration in the
published config.json; model_type kimi_k25): the DeepSeek-V3 text model of Kimi-K2 (deepseek_v3.py: MLA, noaux_tc
routing, shared experts, dense first layers) under a multimodal wrapper.

- config.json nests the text model's fields under `text_config` (model_type kimi_k2 or deepseek_v3); the wrapper's
  own tie_word_embeddings decides the head (transformers' default: tied), a stored lm_head is read whatever it says.
- The checkpoint holds the language model under `language_model.model.*` and `language_model.lm_head` (the names
  transformers' save_pretrained writes back, and the published layout), beside the vision tower (`vision_tower.*`)
  and the projector into the text model (`mm_projector.*`; `model.mm_projector.*` as transformers writes its norm):
  the language model is served, text input only; the rest is never read, and named in the start-up log.
- The text model's num_nextn_predict_layers MTP layers are skipped as DeepSeek-V3's are.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from moeserve.errors import CheckpointError
from moeserve.models.archs.deepseek_v3 import deepseek_v3_spec
from moeserve.models.archs.glm4_moe import SHARED_EXPERTS_NAMES
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import ConfigReader, ModelSpec

VISION = "the vision tower and its projector: text input only"


def _under_language_model(names: WeightNames) -> WeightNames:
    """`names` with every checkpoint name under `language_model.` (model.* and lm_head alike)."""
    return WeightNames(**{k: "language_model." + v for k, v in asdict(names).items()})


@register
class KimiK25(Architecture):
    name = "Kimi_K25ForConditionalGeneration"
    names = _under_language_model(SHARED_EXPERTS_NAMES)
    unserved = (("vision_tower.", VISION), ("mm_projector.", VISION), ("model.mm_projector.", VISION))

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: {self.name} needs a 'text_config' object (the language model's fields)")
        outer = ConfigReader(config, where)
        fields = {**text, "tie_word_embeddings": outer.bool("tie_word_embeddings", default=True)}
        if fields.get("dtype") is None and fields.get("torch_dtype") is None:
            fields["dtype"] = outer.optional_str("dtype", "torch_dtype")
        return deepseek_v3_spec(self.name, fields, where)


@register
class KimiK25RemoteCode(KimiK25):
    """The same model as its published config.json names it (the checkpoint's own modeling code)."""

    name = "KimiK25ForConditionalGeneration"
