"""One small module per model family; importing this package registers them all."""

from moeserve.models.archs import (  # noqa: F401
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    gemma4,
    glm4_moe,
    gpt_oss,
    kimi_k25,
    minimax_m2,
    mixtral,
    nemotron_h,
    olmoe,
    qwen3_next,
    qwen4_exp,
    qwen_moe,
)
