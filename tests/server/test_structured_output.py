"""Structured output end to end with the official `openai` client on the tiny random model: response_format
json_schema / json_object, vLLM's guided_* and structured_outputs forms, streaming, a batch mixing constrained and
plain requests, 400s for bad constraints, and tool calls constrained to the tool's schema (Qwen3 template).

A random model writes whatever the mask allows, so these outputs are the grammar's work alone: each is parsed and
validated (jsonschema), never compared with a hard-coded text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from moeserve.bench.checkpoints import write_tiny_checkpoint, write_tiny_tokenizer
from tests.server.conftest import MODEL_NAME, ThreadServer, engine_factory, make_state

MESSAGES = [{"role": "user", "content": "Describe a person as JSON"}]
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1,
                  "maxItems": 4}}, "required": ["color", "sizes"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                                   "y": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]}},
     "required": ["point", "label"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 5},
]


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    return exc.response.json()["error"]


def test_json_schema_output_validates_greedy_and_sampled(live_server: ThreadServer) -> None:
    client = live_server.client()
    for schema in SCHEMAS:
        runs = [{"temperature": 0}] + [{"temperature": 1.0, "seed": seed} for seed in range(5)]
        for sampling in runs:
            resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=150,
                                                  response_format=_format(schema), **sampling)  # type: ignore
            choice = resp.choices[0]
            assert choice.finish_reason == "stop", (schema, sampling, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_schema_twenty_samples_at_temperature_1(live_server: ThreadServer) -> None:
    """The issue's check: 20 sampled generations parse and validate (n=20 samples of one request)."""
    schema = SCHEMAS[0]
    resp = live_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=150, n=16,
                                                        temperature=1.0, seed=11, response_format=_format(schema))
    extra = live_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=150, n=4,
                                                         temperature=1.0, response_format=_format(schema))
    choices = resp.choices + extra.choices
    assert len(choices) == 20
    for choice in choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_gives_an_object(live_server: ThreadServer) -> None:
    """Any object: a random model writes keys of any length, so some samples run to max_tokens (still an object's
    beginning); every one that ends is a whole object."""
    resp = live_server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=300, n=10,
                                                        temperature=1.0, seed=1,
                                                        response_format={"type": "json_object"})
    ended = [c for c in resp.choices if c.finish_reason == "stop"]
    assert len(ended) >= 3
    for choice in resp.choices:
        assert (choice.message.content or "").startswith("{")
    for choice in ended:
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_streamed_equals_whole(live_server: ThreadServer) -> None:
    client = live_server.client()
    for schema in SCHEMAS[:2]:
        args: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 150, "temperature": 1.0,
                                "seed": 3, "response_format": _format(schema)}
        whole = client.chat.completions.create(**args).choices[0].message.content
        chunks = list(client.chat.completions.create(stream=True, **args))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        jsonschema.validate(json.loads(streamed), schema)


def test_completions_take_every_form(live_server: ThreadServer) -> None:
    client = live_server.client()
    regex = r"[0-9]{3}-[a-z]{2,4}"
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"response_format": _format(SCHEMAS[1])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1])),
        ({"guided_json": SCHEMAS[0]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0])),
        ({"guided_json": json.dumps(SCHEMAS[3])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[3])),
        ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t) or pytest.fail(t)),
        ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma") or pytest.fail(t)),
        ({"structured_outputs": {"choice": ["x1", "y22"]}}, lambda t: t in ("x1", "y22") or pytest.fail(t)),
        ({"structured_outputs": {"regex": "(ab|cd)+!"}}, lambda t: re.fullmatch("(ab|cd)+!", t) or pytest.fail(t)),
        ({"guided_grammar": 'start: "<" NUM ">"\nNUM: /[0-9]{1,3}/'},
         lambda t: re.fullmatch("<[0-9]{1,3}>", t) or pytest.fail(t)),
        ({"guided_grammar": 'root ::= "(" [a-c]+ ")"'}, lambda t: re.fullmatch(r"\([a-c]+\)", t) or pytest.fail(t)),
    ]
    for extra, check in cases:
        for seed in (0, 1):
            resp = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=120, temperature=1.0,
                                             seed=seed, extra_body=extra)
            assert resp.choices[0].finish_reason == "stop", (extra, resp.choices[0].text)
            check(resp.choices[0].text)
    # a list of prompts: each one constrained
    resp = client.completions.create(model=MODEL_NAME, prompt=["A", "B", "C"], max_tokens=30, temperature=1.0,
                                     seed=4, extra_body={"guided_choice": ["one", "two"]})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2] and all(c.text in ("one", "two") for c in resp.choices)


def test_plain_requests_beside_constrained_ones_get_their_solo_tokens(live_server: ThreadServer) -> None:
    client = live_server.client()
    prompts = ["The cat", "Once upon a time", "1 2 3", "Hello there"]

    def plain(prompt: str) -> tuple[str, Any, Any]:
        resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
        lp = resp.choices[0].logprobs
        assert lp is not None
        return resp.choices[0].text, lp.tokens, lp.token_logprobs  # the tokens and their exact logprobs

    def constrained(seed: int) -> str:
        resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=150, temperature=1.0,
                                              seed=seed, response_format=_format(SCHEMAS[0]))
        return resp.choices[0].message.content or ""

    solo = [plain(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        json_jobs = [pool.submit(constrained, s) for s in range(4)]
        plain_jobs = [pool.submit(plain, p) for p in prompts]
        for job in json_jobs:
            jsonschema.validate(json.loads(job.result()), SCHEMAS[0])
        assert [job.result() for job in plain_jobs] == solo


def test_bad_constraints_are_400_in_one_line(live_server: ThreadServer) -> None:
    client = live_server.client()
    bad: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": _format({"type": "foo"})}, "response_format", "invalid JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "shema": {}}}},
         "response_format.json_schema.shema", "did you mean 'schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema", "schema is required"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format.json_schema.schema", "must be an object"),
        ({"guided_regex": "(ab"}, "guided_regex", "invalid regex"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "invalid grammar"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
        ({"structured_outputs": {"regx": "a"}}, "structured_outputs.regx", "did you mean 'regex'"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend", "guidance"),
    ]
    for extra, param, words in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=extra)
        err = _error(info.value)
        assert err["param"] == param and words in err["message"] and "\n" not in err["message"], (extra, err)
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                                  extra_body={"response_format": _format({"type": "object", "required": 5})})
    # the server goes on serving
    assert httpx.get(live_server.url + "/health").status_code == 200


# ------------------------------------------------------------------------------------------------ tool calls
TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


# A random model left free to reason would rarely close its <think>: these tests constrain the answer only.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    """A tiny random model with Qwen3's template (JSON tool calls) and room for its long tool prompt."""
    from tokenizers import Tokenizer

    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("qwen3_tools"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    write_tiny_checkpoint(folder, "qwen3_moe", vocab_size=tok.get_vocab_size(),
                          eos_token_id=tok.token_to_id("<|im_end|>"), max_position_embeddings=4096)
    state = make_state(engine_factory(folder, max_num_seqs=8, chat_template=str(TEMPLATES / "qwen3.jinja")))
    server = ThreadServer(state)
    yield server
    server.stop()


def test_forced_tool_calls_follow_the_parameters_schema(qwen3_server: ThreadServer) -> None:
    client = qwen3_server.client()
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    choices: list[Any] = [{"type": "function", "function": {"name": "get_weather"}},
                          {"type": "function", "function": {"name": "get_time"}}, "required"]
    for tool_choice in choices:
        for seed in range(3):
            resp = client.chat.completions.create(model=MODEL_NAME, messages=ask, tools=[WEATHER, TIME],  # type: ignore
                                                  tool_choice=tool_choice, max_tokens=120, temperature=1.0, seed=seed,
                                                  extra_body=NO_THINKING)
            choice = resp.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            calls = choice.message.tool_calls or []
            assert len(calls) == 1
            name = calls[0].function.name  # type: ignore[union-attr]
            if isinstance(tool_choice, dict):
                assert name == tool_choice["function"]["name"]
            jsonschema.validate(json.loads(calls[0].function.arguments), schemas[name])  # type: ignore[union-attr]
    # streamed: the arguments come in pieces that join to a valid call
    stream = client.chat.completions.create(model=MODEL_NAME, messages=ask, tools=[WEATHER],  # type: ignore
                                            tool_choice="required", max_tokens=120, temperature=1.0, seed=9,
                                            stream=True, extra_body=NO_THINKING)
    args = "".join(tc.function.arguments or "" for c in stream if c.choices
                   for tc in c.choices[0].delta.tool_calls or [] if tc.function)
    jsonschema.validate(json.loads(args), schemas["get_weather"])


def test_response_format_with_callable_tools_is_refused(qwen3_server: ThreadServer) -> None:
    client = qwen3_server.client()
    with pytest.raises(openai.BadRequestError, match="tool_choice 'none'"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],  # type: ignore
                                       response_format={"type": "json_object"}, max_tokens=4)
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],  # type: ignore
                                          tool_choice="none", max_tokens=150, temperature=1.0, seed=2,
                                          response_format=_format(SCHEMAS[0]), extra_body=NO_THINKING)
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), SCHEMAS[0])
