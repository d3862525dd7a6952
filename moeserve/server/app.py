"""The FastAPI application: routes, API-key check, lifespan. Built around a ServerState, so it can be tested with a
fake engine (anything with LLMEngine's add_request / abort_request / step / has_unfinished_requests).

    state = ServerState(AsyncEngine(make_engine, max_in_flight), server_settings, "my-model", ServerMetrics(...))
    app = build_app(state)        # uvicorn.run(app, ...)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from moeserve.engine.async_engine import State
from moeserve.server.chat import create_chat_completion
from moeserve.server.completions import create_completion
from moeserve.server.errors import APIError, install_error_handlers, model_not_found
from moeserve.server.guard import GuardLimits, RequestGuard, key_matches
from moeserve.server.messages.protocol import CountTokensRequest, MessagesRequest
from moeserve.server.messages.serving import count_tokens, create_message
from moeserve.server.metrics import StatsLogger
from moeserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from moeserve.server.responses.protocol import ResponsesRequest
from moeserve.server.responses.serving import create_response, delete_response, stored_response
from moeserve.server.responses.store import ResponseStore
from moeserve.server.state import ServerState

log = logging.getLogger("moeserve.server")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 503)
}


def _api_key_check(state: ServerState) -> Any:
    expected = state.settings.api_key

    async def check(request: Request) -> None:  # the guard checked first (before the body); kept for the route
        if expected is not None and not key_matches(dict(request.scope.get("headers") or []), expected):
            raise APIError(401, "Incorrect API key provided.", param=None, code="invalid_api_key")

    return Depends(check)


async def _log_stats(stats: StatsLogger) -> None:
    while True:
        await asyncio.sleep(stats.interval_s)
        try:
            line = stats.line()
        except Exception as err:  # a side channel: it stops alone, with one line; serving goes on
            log.error("periodic stats log failed (%s: %s); no more stats lines", type(err).__name__, err)
            return
        if line is not None:
            log.info("%s", line)


def _keyed_docs(app: FastAPI, auth: list[Any]) -> None:
    """/openapi.json, /docs and /redoc behind the API key (the schema lists every route and field: with a key set
    the server is not open to browse). The HTML pages load the schema from the browser without the key, so with a
    key set, read the schema with `curl -H "Authorization: Bearer KEY" .../openapi.json`."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False, dependencies=auth)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")


def build_app(state: ServerState, manage_engine: bool = True) -> FastAPI:
    """The app. With `manage_engine`, startup starts the engine thread (the model loads in the background while
    /health answers 503) and shutdown stops it."""
    keyed = state.settings.api_key is not None
    app = FastAPI(title="moeserve", version="0.1.0", lifespan=_lifespan(state, manage_engine),
                  description="OpenAI-compatible server for Mixture-of-Experts models larger than memory.",
                  openapi_url=None if keyed else "/openapi.json", docs_url=None if keyed else "/docs",
                  redoc_url=None if keyed else "/redoc")
    app.state.server = state
    install_error_handlers(app)
    settings = state.settings
    app.add_middleware(RequestGuard, limits=GuardLimits(
        int(settings.max_request_body_mb * 1e6), settings.api_key, settings.max_concurrent_requests,
        settings.body_timeout_s, state.request_memory))
    auth = [_api_key_check(state)]
    if keyed:
        _keyed_docs(app, auth)
    _add_service_routes(app, state)
    _add_openai_routes(app, state, auth)
    _add_agent_routes(app, state, auth)
    _add_token_routes(app, state, auth)
    return app


def _lifespan(state: ServerState, manage_engine: bool) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Startup and shutdown: the engine thread and the periodic stats line (with `manage_engine`)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        stats_task = None
        if manage_engine:
            state.engine.start()
            stats_task = asyncio.ensure_future(_log_stats(StatsLogger(state.metrics, state.engine)))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            if manage_engine:
                state.engine.shutdown()
            state.close()

    return lifespan


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    """/health (no key: load balancers probe it) and /metrics (Prometheus text)."""

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def health(strict: bool = False) -> Response:
        if state.draining:
            return APIError(503, "shutting down", "server_error", code="shutting_down").response()
        if state.engine.state == State.LOADING:
            return APIError(503, "Loading model", "server_error", code="model_loading",
                            headers={"Retry-After": "5"}).response()
        if state.engine.state == State.DEAD:
            return APIError(503, f"the engine has stopped: {state.engine.error}", "server_error",
                            code="engine_dead").response()
        problem = state.engine.degraded()
        if problem is not None and strict:  # for a load balancer that should route around a degraded replica
            return APIError(503, problem, "server_error", code="degraded").response()
        if problem is not None:  # still serving what does not need the bad units: 200, and says why
            return JSONResponse({"status": "degraded", "reason": problem})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(state.engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_openai_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """The OpenAI endpoints: /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions."""

    @app.get("/v1/models", response_model=ModelList, response_model_exclude_none=True, dependencies=auth,
             responses=ERROR_RESPONSES)
    async def models(verbose: bool = False) -> ModelList:
        return ModelList(data=state.model_cards(verbose))

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, response_model_exclude_none=True,
             dependencies=auth, responses=ERROR_RESPONSES)
    async def model(model_id: str, verbose: bool = False) -> ModelCard:
        cards = {card.id: card for card in state.model_cards(verbose)}
        if model_id not in cards:
            raise model_not_found(model_id)
        return cards[model_id]

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=auth, responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(body, raw, state)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=auth,
              responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(body, raw, state)


def _add_agent_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """The APIs agent tools speak: OpenAI's Responses (/v1/responses) and Anthropic's Messages (/v1/messages), both
    on the chat path (chat.start_chat)."""
    settings = state.settings
    store = ResponseStore(settings.responses_store_max, int(settings.responses_store_mb * 2**20))
    log.debug("/v1/responses keeps the last %d responses (at most %g MiB) in memory for previous_response_id "
              "(responses_store_max, responses_store_mb)", store.max_count, settings.responses_store_mb)

    @app.post("/v1/responses", dependencies=auth, responses=ERROR_RESPONSES)
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await create_response(body, raw, state, store)

    @app.get("/v1/responses/{response_id}", dependencies=auth, responses=ERROR_RESPONSES)
    async def response(response_id: str) -> dict[str, Any]:
        return stored_response(response_id, store)

    @app.delete("/v1/responses/{response_id}", dependencies=auth, responses=ERROR_RESPONSES)
    async def forget_response(response_id: str) -> dict[str, Any]:
        return delete_response(response_id, store)

    @app.post("/v1/messages", dependencies=auth, responses=ERROR_RESPONSES)
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await create_message(body, raw, state)

    @app.post("/v1/messages/count_tokens", dependencies=auth, responses=ERROR_RESPONSES)
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_tokens(body, state)


def _add_token_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """vLLM's /tokenize and /detokenize."""

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=auth, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.accept(body.model, body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            rendered = await state.off_loop(state.chat_format().render, body.messages, body.add_generation_prompt)
            ids = rendered.token_ids
        else:
            if state.tokenizer is None:
                raise APIError(400, "this server runs without a tokenizer", param="prompt")
            ids = await state.off_loop(state.tokenizer.encode, body.prompt or "",
                                       add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.max_model_len)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=auth, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.accept(body.model, body)
        if state.tokenizer is None:
            raise APIError(400, "this server runs without a tokenizer", param="tokens")
        vocab = int(state.tokenizer.vocab_size)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range for vocabulary size {vocab}", param="tokens")
        text = await state.off_loop(state.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
