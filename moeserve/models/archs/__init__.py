"""One small module per model family; importing this package registers them all."""

from moeserve.models.archs import deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen3_next, qwen_moe  # noqa: F401
