"""One typed settings model for everything a user can set.

The same fields feed three doors, so they can never drift apart:
- Python keywords: ``LLM(model, dtype="bfloat16", expert_cache_gb=2)``
- CLI flags: ``--dtype bfloat16 --expert-cache-gb 2`` (generated from the fields by `add_cli_arguments`)
- environment: ``MOESERVE_DTYPE=bfloat16 MOESERVE_EXPERT_CACHE_GB=2``

Precedence: explicit keyword / flag > environment > default. An unknown keyword or an unknown ``MOESERVE_*``
variable is an error with a "did you mean" (a misspelt setting that is silently ignored is how a server ends up
running a broken kernel for hours). Settings are frozen once built.
"""

from __future__ import annotations

import argparse
import difflib
import os
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moeserve.errors import ConfigError
from moeserve.experts.placement import check_placement

ENV_PREFIX = "MOESERVE_"

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]


class EngineSettings(BaseModel):
    """Settings of the engine (model, numerics, memory budgets, expert cache)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = Field(None, description="model folder, or a Hugging Face id already in the local cache")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: the model folder)")
    dtype: DType = Field("auto", description="compute dtype; auto = the checkpoint's dtype")
    device: Device = Field("auto", description="where compute runs; auto = cuda if available, else cpu")
    max_model_len: int | None = Field(
        None, ge=1, description="context length in tokens (default: the model's max_position_embeddings, lowered "
        "only when one sequence of it cannot fit the memory budget, logged)"
    )
    max_num_seqs: int = Field(8, ge=1, description="sequences decoded together in one batch")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="tokens computed per engine step; long prompts are prefilled in chunks of at most "
        "this many tokens, interleaved with the running decodes (default: 2048)"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV blocks of a prompt prefix already computed (hashed per full block); the "
        "output is bit-identical with or without"
    )
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache block")
    memory_gb: float | None = Field(
        None, gt=0, description="everything the process may hold, GiB (2**30 bytes): resident weights, expert cache, "
        "KV pool, read buffers and runtime; split at start-up (logged) or refused before loading (default: free "
        "memory less headroom)"
    )
    request_memory_mb: float | None = Field(
        None, ge=0, description="what the HTTP server's requests may hold at once (bodies, parsing, tokenization), "
        "MiB, a part of the memory budget; beyond it requests get 503 (default: `moeserve serve` reserves what one "
        "of the largest bodies may take to tokenize, max_request_body_mb x 200; none elsewhere)"
    )
    kv_cache_gb: float | None = Field(
        None, gt=0, description="size of the paged KV pool inside the memory budget, GiB (default: chosen by the "
        "memory split: max_num_seqs full-context sequences beside all experts, else one, up to a quarter)"
    )
    seed: int = Field(0, description="seed of the sampling generator of requests without their own seed "
                                     "(same seed, same requests in the same order: same tokens)")
    threads: int | None = Field(None, ge=1, description="CPU threads for compute (default: all cores)")
    skip_tokenizer_init: bool = Field(False, description="run without tokenizer files, on token-id prompts")
    chat_template: str | None = Field(None, description="path of a jinja chat template overriding the model's")
    expert_cache_gb: float | None = Field(
        None, ge=0, description="fast-tier budget for experts inside the memory budget, GiB (2**30 bytes) "
        "(default: what the memory split leaves beside the KV pool, logged)"
    )
    ngram_cache_gb: float | None = Field(
        None, ge=0, description="memory for the n-gram tables' units (Qwen3.8-Flash-Next's PLE), GiB (2**30 bytes), "
        "inside the memory budget; the rest read from disk on a miss (default: all of them when they take at most "
        "a quarter of the budget, else a sixteenth of the budget, logged)"
    )
    host_cache_gb: float | None = Field(
        None, ge=0, description="host RAM tier for experts on CUDA machines, GiB (2**30 bytes), pinned in chunks; "
        "refused at start-up above what RAM can lock safely (default: free RAM less headroom, logged)"
    )
    unified_memory: Literal["auto", "on", "off"] = Field(
        "auto", description="whether GPU and host share one physical memory (GB10/DGX Spark, Jetson, AMD APUs): on = "
        "one budget, no host tier; off = separate GPU and host budgets; auto = detected (is_integrated, known "
        "device names, device memory close to MemTotal), logged with its evidence"
    )
    cache_policy: str = Field("lfru", description="expert eviction policy: lru, lfu, lfru, reuse, static")
    expert_cache_mode: Literal["shared", "per_layer", "mixed"] = Field(
        "shared", description="how the expert cache's slots are shared among MoE layers: shared = one pool, "
        "per_layer = an equal quota per layer, mixed = a floor of half the equal quota per layer, the rest shared"
    )
    expert_admission: Literal["always", "policy"] = Field(
        "always", description="whether an expert cache miss is always cached: always = every miss takes a slot "
        "(evicting a victim); policy = a miss the eviction policy judges less worth keeping than its victim is "
        "read into a one-unit bypass buffer, used and dropped, the victim kept (docs/policies.md)"
    )
    # Off by default: on the bench models (near-uniform routing) no guess pays for its read. auto measures whether
    # it pays on this run's routing (experts/prefetch/auto.py, docs/policies.md). It never changes the output.
    prefetch: bool | Literal["auto"] = Field(
        False, description="predict and load the next layer's experts in the background: true, false, or auto = "
        "only while the misses it saves pay for its reads (measured online, logged, in /metrics)")
    quantization: Literal["none", "int8", "int4"] = Field(
        "none", description="on-load weight quantization of 16-bit checkpoints: int8 = experts and dense Linears "
        "as int8 with per-row scales; int4 = experts as int4 with a bf16 scale per 32 inputs (compressed-tensors' "
        "W4A16 layout, read as stored by the C++ 4-bit expert op) and dense Linears as int8 (as llama.cpp's "
        "Q4_K_M keeps its dense tensors at more bits than its experts)"
    )
    kernels: Literal["auto", "cpp", "torch"] = Field(
        "auto", description="CPU kernels: cpp = moeserve's C++ ops (built with g++ on first use), torch = "
        "torch ops only, auto = cpp when it builds"
    )
    cpu_isa: Literal["auto", "avx2", "generic"] = Field(
        "auto", description="ISA the C++ kernels are compiled for: auto = this CPU's own (-march=native; on aarch64 "
        "-mcpu=native); avx2 = x86-64-v3 (AVX2, FMA, F16C); generic = baseline x86-64, scalar paths (on aarch64 "
        "armv8-a, NEON; elsewhere the compiler's default). "
        "For tests, and for building kernels that a narrower CPU can run; the bf16 GEMV and expert op give the same "
        "bits on every level. Each level is its own cached library; the start-up log says which was built"
    )
    expert_layout: Literal["auto", "interleaved", "plain"] = Field(
        "auto", description="how experts are held: interleaved = rows in blocks of 4 for the fused C++ op (bf16 or "
        "int8 SwiGLU experts with kernels=cpp), plain = as stored; auto = interleaved where it applies"
    )
    placement: str = Field(
        "auto", description="where a CUDA machine computes experts missing from GPU memory: gpu = copy each to a "
        "GPU slot; hybrid = per layer call, computed by the CPU from host RAM or copied, whichever finishes sooner "
        "(costs probed at start-up, re-checked as the run goes, logged, in /metrics); cpu = on the CPU once the GPU "
        "slots are full; auto = gpu for now (the hybrid's GPU kernel has no GPU figure yet). Any placement gives "
        "the same bits (docs/design/gpu.md)"
    )
    decode_step: Literal["auto", "fused", "per_op"] = Field(
        "auto", description="decode-only steps: fused = every layer in one C++ call (resident row-interleaved "
        "experts, kernels=cpp, bf16 on CPU), per_op = one op call per piece from Python; auto = fused where it applies"
    )
    batch_invariant: bool = Field(
        True, description="a request's numbers never depend on what else is in the batch (every op reduces each "
        "row in one fixed order; torch fallbacks run in fixed blocks of rows); off = torch's faster batch-dependent "
        "paths where moeserve's C++ ops do not apply"
    )
    int8_cache_dir: str | None = Field(
        None, description="where quantization=int8 / int4 writes offloaded experts once, quantized, so misses read "
        "half (a quarter) of the bytes (default ~/.cache/moeserve/units; 'off': quantize on every miss)"
    )
    record_trace: str | None = Field(None, description="write the experts each token used to this file")
    record_trace_format: Literal["moetrace", "jsonl"] = Field(
        "moetrace", description="record_trace's format: moetrace = compact binary, jsonl = the plain JSON-lines "
        "interchange format (docs/trace-format.md)"
    )
    cache_trace: str | None = Field(
        None, description="routing trace (from record_trace) whose most used experts cache_policy=static pins"
    )
    ep_listen: str | None = Field(
        None, description="expert parallelism, head: HOST:PORT where expert workers join (`moeserve ep-worker "
        "--head` that address); binds that interface only (gloo has no authentication: docs/expert-parallel.md)"
    )
    ep_workers: int = Field(0, ge=0, le=63, description="expert parallelism, head: expert workers to wait for "
                            "(0: none, this process computes every expert)")
    ep_timeout: float = Field(
        30.0, gt=0, description="expert parallelism: seconds a rank may take to answer a layer call; beyond, the "
        "engine stops with an error (every open request gets one, /health answers 503)"
    )
    ep_join_timeout: float = Field(
        300.0, gt=0, description="expert parallelism: seconds the head waits for every worker to join (and a worker "
        "for its head) at start-up; beyond, start-up fails naming the address"
    )
    ep_ownership: Literal["contiguous", "round_robin"] = Field(
        "contiguous", description="expert parallelism: which rank owns which experts of every MoE layer: "
        "contiguous ranges sized by each rank's memory_gb, or round_robin (expert e on rank e % ranks)"
    )
    ep_any_interface: bool = Field(
        False, description="expert parallelism: allow ep_listen on 0.0.0.0 / :: (every interface)"
    )

    @field_validator("placement")
    @classmethod
    def _placement_value(cls, value: str) -> str:
        return check_placement(value)

    @field_validator("prefetch", mode="before")
    @classmethod
    def _prefetch_value(cls, value: Any) -> Any:
        words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
                 "off": False, "auto": "auto"}
        if isinstance(value, str) and value.strip().lower() in words:
            return words[value.strip().lower()]
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true, false or auto{did_you_mean(str(value), ['true', 'false', 'auto'])}")


class ServerSettings(BaseModel):
    """Settings of the OpenAI-compatible HTTP server (on top of EngineSettings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    served_model_name: list[str] | None = Field(
        None, description="model name(s) clients use; several: any is accepted, the first is answered (default: "
        "MODEL as given)")
    generation_config: str = Field(
        "auto", description="request sampling defaults: auto (the model's generation_config.json), vllm (none), or "
        "a folder holding a generation_config.json")
    api_key: str | None = Field(None, description="require this bearer token on /v1 endpoints (visible in `ps`: "
                                "prefer api_key_file or MOESERVE_API_KEY)")
    api_key_file: str | None = Field(None, description="read the API key from this file (its first line), so it "
                                     "is not on the command line")
    max_queued_requests: int = Field(64, ge=0, description="requests waiting beyond max_num_seqs before 503")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds to drain in-flight requests on SIGTERM")
    disable_log_requests: bool = Field(
        False, description="no log line per request (uvicorn's access log; vLLM's name); errors are still logged, "
        "and GET /health polls never are"
    )
    max_request_body_mb: float = Field(
        4.0, gt=0, description="largest request body accepted, in MB (413 beyond); serve reserves x200 of it in "
        "memory_gb for tokenizing (request_memory_mb)")
    max_connections: int | None = Field(
        None, ge=1, description="open connections at most; one beyond closes the oldest idle one (default: 3/4 of "
        "the open-file limit, at most 4096)")
    max_concurrent_requests: int = Field(
        256, ge=1, description="requests in progress at most (/health and /metrics apart); 503 beyond")
    header_timeout_s: float = Field(
        10.0, gt=0, description="seconds a connection may take to send a request's head (line and headers), from "
        "its opening or its previous answer; closed beyond")
    body_timeout_s: float = Field(60.0, gt=0, description="seconds a request body may take to arrive; 408 beyond")
    timeout_keep_alive_s: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    template_timeout_s: float = Field(
        10.0, gt=0, description="seconds a chat template may take to render one request; 400 beyond")
    template_max_output_mb: float = Field(
        64.0, gt=0, description="largest text a chat template may render for one request, MB; 400 beyond")
    responses_store_max: int = Field(
        1000, ge=0, description="responses kept in memory for /v1/responses previous_response_id (oldest evicted "
        "first; 0 keeps none)")
    responses_store_mb: float = Field(
        64.0, ge=0, description="bytes (MiB, as JSON) those stored responses may take, beyond memory_gb")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, names: Any) -> Any:
        if isinstance(names, str):  # MOESERVE_SERVED_MODEL_NAME="a b" or "a,b"
            names = names.replace(",", " ").split()
        if isinstance(names, list) and not [n for n in names if str(n).strip()]:
            raise ValueError("give at least one name, or leave served_model_name unset")
        return names

    @model_validator(mode="after")
    def _one_key_source(self) -> ServerSettings:
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give api_key or api_key_file, not both")
        return self

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, key: str | None) -> str | None:
        if key is not None and not key.strip():  # `--api-key "$UNSET_VAR"` must not silently turn auth off
            raise ValueError("an empty API key would turn authentication off; give a key, or leave api_key unset "
                             "to serve without one")
        return key


# Every settings model whose fields may appear as MOESERVE_* variables. An env var must name a field of one.
SETTINGS_MODELS: tuple[type[BaseModel], ...] = (EngineSettings, ServerSettings)

# Variables that are ours but not settings (read elsewhere, documented in README).
_EXTRA_ENV = frozenset({"MOESERVE_LOG_LEVEL"})


def _all_field_names() -> list[str]:
    return [name for cls in SETTINGS_MODELS for name in cls.model_fields]


def did_you_mean(word: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or a list of valid ones when nothing is close."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (valid: {', '.join(sorted(choices))})"


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError for any MOESERVE_* variable that names no setting."""
    environ = os.environ if environ is None else environ
    known = {ENV_PREFIX + f.upper() for f in _all_field_names()} | _EXTRA_ENV
    for key in sorted(environ):
        if key.startswith(ENV_PREFIX) and key not in known:
            raise ConfigError(f"unknown environment variable {key}{did_you_mean(key, sorted(known))}")


def _env_values(cls: type[BaseModel], environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in cls.model_fields:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = raw  # pydantic coerces "2.5", "true", "none" ... to the field type
    return values


def build_settings(
    cls: type[BaseModel], overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> Any:
    """Build a frozen settings object: overrides (keywords/flags) over MOESERVE_* env over defaults.

    Unknown override keys and unknown MOESERVE_* variables raise ConfigError with a "did you mean".
    """
    environ = os.environ if environ is None else environ
    check_environment(environ)
    fields = list(cls.model_fields)
    for key in overrides:
        if key not in fields:
            raise ConfigError(f"unknown setting '{key}'{did_you_mean(key, fields)}")
    values = _env_values(cls, environ)
    values.update({k: v for k, v in overrides.items() if v is not None or k not in values})
    try:
        return cls(**values)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"invalid setting {where}: {first['msg']} (got {first.get('input')!r})") from None


def split_settings(
    kwargs: Mapping[str, Any], classes: tuple[type[BaseModel], ...]
) -> list[dict[str, Any]]:
    """Route keywords to the settings model that owns them; unknown keywords raise ConfigError."""
    parts: list[dict[str, Any]] = [{} for _ in classes]
    all_names = [n for cls in classes for n in cls.model_fields]
    for key, value in kwargs.items():
        for i, cls in enumerate(classes):
            if key in cls.model_fields:
                parts[i][key] = value
                break
        else:
            raise ConfigError(f"unknown setting '{key}'{did_you_mean(key, all_names)}")
    return parts


# ---------------------------------------------------------------------------------------------- CLI flags
def _flag_type(annotation: Any) -> tuple[Any, list[str] | None]:
    """(argparse type, choices) for a field annotation such as `float | None` or `Literal[...]`."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return str, [str(a) for a in get_args(annotation)]
    if args and get_origin(args[0]) is Literal:
        return str, [str(a) for a in get_args(args[0])]
    base = args[0] if args else annotation
    return (base if base in (int, float, str) else str), None


def add_cli_arguments(parser: argparse.ArgumentParser, cls: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per field of `cls`. Defaults are None so that unset flags fall back to env/defaults."""
    group = parser.add_argument_group(cls.__name__)
    for name, field in cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} (env {ENV_PREFIX}{name.upper()}; default {field.default})"
        if field.annotation is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        if bool in get_args(field.annotation):  # bool | Literal[...]: a bare --flag is true, --no-flag false
            _, choices = _flag_type(Literal[tuple(a for a in get_args(field.annotation) if a is not bool)])
            group.add_argument(flag, dest=name, nargs="?", const="true", default=None, help=help_text,
                               metavar="{true,false," + ",".join(choices or []) + "}")
            group.add_argument("--no-" + flag[2:], dest=name, action="store_const", const="false", help=argparse.SUPPRESS)
            continue
        typ, choices = _flag_type(field.annotation)
        many = "+" if any(get_origin(a) is list for a in get_args(field.annotation)) else None  # list[str] fields
        group.add_argument(flag, dest=name, type=typ, choices=choices, default=None, help=help_text, nargs=many)


def settings_from_args(cls: type[BaseModel], args: argparse.Namespace, **extra: Any) -> Any:
    """Build `cls` from parsed CLI flags (only those given) plus `extra`, over env and defaults."""
    given = {n: getattr(args, n) for n in cls.model_fields if getattr(args, n, None) is not None}
    given.update({k: v for k, v in extra.items() if v is not None})
    return build_settings(cls, given)
