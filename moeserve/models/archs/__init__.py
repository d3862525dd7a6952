"""One small module per model family; importing this package registers them all."""

from moeserve.models.archs import glm4_moe, gpt_oss, mixtral, olmoe, qwen3_next, qwen_moe  # noqa: F401
