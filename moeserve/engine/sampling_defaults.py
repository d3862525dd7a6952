"""The sampling `moeserve chat` starts with: the model's recommendation (generation_config.json), flags over it;
and the defaults `moeserve serve` gives a request's unset fields (`server_sampling`, vLLM's `--generation-config`).

Pure Python (no torch): tested without a model. The fields read from generation_config.json are vLLM's
(`--generation-config auto`): temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as
max_tokens. `do_sample` is not read, as vLLM does not: transformers writes `do_sample: false` into files whose
authors never chose greedy decoding, and greedy decoding is what makes a chat loop (`I am sure I am sure ...`).
A model that recommends no sampling value at all gets CHAT_FALLBACK (llama.cpp's defaults), said as such.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeserve.errors import ConfigError

# generation_config.json field -> SamplingParams field, with its type
RECOMMENDED_FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}

# When the model recommends no sampling value: llama.cpp's llama-cli defaults (Ollama's are close), so a chat does
# not loop as greedy decoding does. max_tokens None: the reply runs to its end token or the context's end.
CHAT_FALLBACK: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}

SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


@dataclass(frozen=True)
class ChosenSampling:
    values: dict[str, Any]  # SamplingParams keywords: the ones set here, the rest keep SamplingParams' defaults
    sources: dict[str, str]  # name -> where its value came from ("generation_config.json", "flag", ...)

    def describe(self) -> str:
        """One line: every value, each run of values from one source followed by it once, e.g.
        `temperature 0.6, top_p 0.95 (generation_config.json), top_k 20 (flag)`."""
        if not self.values:
            return "greedy"
        names = list(self.values)
        return ", ".join(f"{name} {self.values[name]}" + (
            f" ({self.sources[name]})" if i + 1 == len(names) or self.sources[names[i + 1]] != self.sources[name]
            else "") for i, name in enumerate(names))


def recommended_sampling(generation_config: Mapping[str, Any], file: str = "generation_config.json"
                         ) -> dict[str, Any]:
    """The sampling values the model's generation_config.json recommends, as SamplingParams keywords.
    A value of the wrong type is a ConfigError naming the file and the field."""
    values: dict[str, Any] = {}
    for key, (name, kind) in RECOMMENDED_FIELDS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
            raise ConfigError(f"{file}: '{key}' must be {'an integer' if kind is int else 'a number'}, "
                              f"got {str(value)[:40]}")
        values[name] = kind(value)
    return values


def choose_sampling(generation_config: Mapping[str, Any], flags: Mapping[str, Any],
                    file: str = "generation_config.json") -> ChosenSampling:
    """Flags (values not None) over the model's recommendation; CHAT_FALLBACK when the model recommends no sampling
    value (max_new_tokens alone is not a sampling recommendation)."""
    model = recommended_sampling(generation_config, file)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    base, where = (model, file) if set(model) - {"max_tokens"} else (
        {**CHAT_FALLBACK, **model}, f"moeserve's chat default: {file} recommends no sampling")
    for name in SAMPLING_NAMES:
        if flags.get(name) is not None:
            values[name], sources[name] = flags[name], "flag"
        elif name in base:
            values[name] = base[name]
            sources[name] = file if name in model else where
    return ChosenSampling(values, sources)


GENERATION_CONFIG_FILE = "generation_config.json"


def server_sampling(setting: str, generation_config: Mapping[str, Any]) -> ChosenSampling:
    """What `serve` gives a request's unset sampling fields, as vLLM's `--generation-config` does: "auto" (the
    default) the model's generation_config.json; "vllm" nothing (temperature 1, top_p 1, no top_k, the rest of the
    context); any other value a folder holding a generation_config.json. No chat fallback: a model that recommends
    nothing gets vLLM's defaults. `max_tokens` (max_new_tokens) is a default, not a cap: a request's own wins."""
    if setting == "vllm":
        return ChosenSampling({}, {})
    if setting == "auto":
        values, where = recommended_sampling(generation_config, GENERATION_CONFIG_FILE), GENERATION_CONFIG_FILE
    else:
        file = Path(setting) / GENERATION_CONFIG_FILE
        values, where = recommended_sampling(read_generation_config(file), str(file)), str(file)
    return ChosenSampling(values, dict.fromkeys(values, where))


def read_generation_config(file: Path) -> dict[str, Any]:
    """A generation_config.json named by the generation_config setting: a JSON object, else ConfigError."""
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"generation_config={file.parent}: no {GENERATION_CONFIG_FILE} there (use 'auto' for "
                          "the model's own, 'vllm' for none)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{file}: cannot read it as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: must hold a JSON object")
    return data


def describe_defaults(chosen: ChosenSampling) -> str:
    """The serve start-up line: the values and, once, where they came from."""
    if not chosen.values:
        return "none: vLLM's (temperature 1, top_p 1, no top_k; generation_config=vllm, or the model recommends none)"
    sources = sorted(set(chosen.sources.values()))
    values = ", ".join(f"{name} {value}" for name, value in chosen.values.items())
    return (f"{values} (from {', '.join(sources)}; a request's own fields win; generation_config=vllm turns these "
            "off)")
