"""moeserve: run Mixture-of-Experts models larger than memory, exactly.

Offline API in vLLM's shape::

    from moeserve import LLM, SamplingParams
    llm = LLM("path/or/hf-id", dtype="bfloat16")
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so `import moeserve` (and the CLI's --help) does not pay for importing torch.
    if name == "LLM":
        from moeserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from moeserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
