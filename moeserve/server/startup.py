"""A server's state from its settings, the same for `moeserve serve` (cli/serve.py, one uvicorn process) and a Ray
Serve replica (server/ray_serve.py): the names the model answers to, the API key read from its file, the memory a
request body may take, and the lines logged once the model has loaded.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeserve.config import EngineSettings, ServerSettings
from moeserve.engine.sampling_defaults import describe_defaults
from moeserve.errors import ConfigError
from moeserve.server.request_memory import RequestMemory

if TYPE_CHECKING:  # torch comes with these: `moeserve serve` refuses a bad setting before importing it
    from moeserve.server.state import ServerState

log = logging.getLogger("moeserve")


def served_names(settings: ServerSettings, model: str | None) -> tuple[str, ...]:
    """The names clients may put in `model`, the one answered first: --served-model-name's (as vLLM: any of them is
    accepted, the first is answered); else MODEL as given (a Hugging Face id `org/model`, or the folder as typed)
    and the folder's own name."""
    if settings.served_model_name:
        return tuple(dict.fromkeys(settings.served_model_name))
    if not model:
        return ("moeserve-demo",)
    return tuple(dict.fromkeys((model, Path(model.rstrip("/")).name or model)))


def with_key_from_file(settings: ServerSettings) -> ServerSettings:
    """`api_key_file`'s first line as the API key (ConfigError, one line, when it cannot be read or is empty)."""
    if settings.api_key_file is None:
        return settings
    try:
        lines = Path(settings.api_key_file).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"api_key_file {settings.api_key_file}: cannot read it ({err})") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"api_key_file {settings.api_key_file}: its first line is empty; write the key there")
    return settings.model_copy(update={"api_key": key})


def with_request_memory(engine: EngineSettings, server: ServerSettings) -> EngineSettings:
    """request_memory_mb, when unset: what one of the largest bodies takes (server/request_memory.py's charge), so
    that a body of max_request_body_mb can always be served."""
    if engine.request_memory_mb is not None:
        return engine
    largest = RequestMemory.cost(int(server.max_request_body_mb * 1e6))
    return engine.model_copy(update={"request_memory_mb": math.ceil(largest / 2**20)})


def describe_model(engine: Any) -> str:
    spec = engine.spec
    moe = spec.moe
    return (f"{spec.architecture} (model_type {spec.model_type}): {spec.num_layers} layers, "
            f"{len(spec.moe_layer_ids)} MoE layers x {moe.num_experts} experts, top-{moe.top_k}; "
            f"weights stored as {engine.checkpoint.stored_dtype()}, computed in {engine.dtype_name}")


def chat_format_name(state: Any) -> str:
    try:
        return str(state.chat_format().name)
    except Exception as err:  # a model without a usable chat format still serves completions
        return f"none ({err}); /v1/chat/completions will answer 400"


def log_loaded(state: ServerState) -> None:
    """The lines logged once the model has loaded: the model, its chat format, the request sampling defaults.
    Raises MoeserveError for a bad generation_config.json value (read with the checkpoint: it stops start-up)."""
    sampling = describe_defaults(state.sampling_defaults())
    log.info("model: %s", describe_model(state.engine.engine))
    log.info("chat format: %s", chat_format_name(state))
    log.info("sampling defaults: %s", sampling)


def make_state(engine_settings: EngineSettings, server_settings: ServerSettings,
               on_loaded: Callable[[BaseException | None], None]) -> ServerState:
    """The server's state around an engine that loads on its own thread when the app starts (`on_loaded(error or
    None)` once it has); engine_settings already with_request_memory, server_settings with_key_from_file."""
    from moeserve.engine.llm_engine import LLMEngine

    names = served_names(server_settings, engine_settings.model)
    log.info("serving %s as model '%s'; API key %s; at most %d requests in flight (max_num_seqs %d + "
             "max_queued_requests %d)", engine_settings.model or "the bundled demo model", names[0],
             "required" if server_settings.api_key else "not required",
             engine_settings.max_num_seqs + server_settings.max_queued_requests, engine_settings.max_num_seqs,
             server_settings.max_queued_requests)
    from moeserve.engine.async_engine import AsyncEngine
    from moeserve.server.metrics import ServerMetrics
    from moeserve.server.state import ServerState

    async_engine = AsyncEngine(lambda: LLMEngine(engine_settings),
                               engine_settings.max_num_seqs + server_settings.max_queued_requests, on_loaded)
    memory = RequestMemory(int((engine_settings.request_memory_mb or 0) * 2**20))
    return ServerState(async_engine, server_settings, names[0], ServerMetrics(names[0]), aliases=names,
                       request_memory=memory)
