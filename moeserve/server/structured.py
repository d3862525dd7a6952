"""Structured output: the constraint a request asks for, in OpenAI's and vLLM's forms, compiled off the event loop.

Forms (at most one per request):
- `response_format`: `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema", "json_schema":
  {"name", "description", "schema", "strict"}}` (the schema is always enforced, strict or not);
- vLLM's `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}` and the older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; SGLang's `regex`, `ebnf` (a GBNF grammar) and
  `json_schema` (completions), which vLLM's router forwards. A grammar is Lark (llguidance's dialect) or
  GBNF (llama.cpp's, converted to Lark).

The grammar engine is llguidance (engine/grammar.py says why); the sampler masks each token (logits_processor.py).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from moeserve.engine.grammar import GrammarSpec
from moeserve.engine.logits_processor import Constraint
from moeserve.errors import RequestError
from moeserve.server.errors import from_exception
from moeserve.server.protocol import SamplingFields, printable, unknown_field_message

JSON_SCHEMA_KEYS = ["name", "description", "schema", "strict"]
STRUCTURED_OUTPUTS_KEYS = ["json", "regex", "choice", "grammar", "json_object"]
# request field -> its kind: vLLM's guided_* and SGLang's names (vLLM's router forwards the latter)
GUIDED_FIELDS = [("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                 ("grammar", "guided_grammar"), ("regex", "regex"), ("grammar", "ebnf"), ("json", "json_schema")]
# vLLM's other structured_outputs options: known, refused (their effect is not implemented here)
STRUCTURED_OUTPUTS_REFUSED = {
    "structural_tag": "structural tags are not supported; use json, regex, choice or grammar",
    "whitespace_pattern": "is not supported: JSON is generated on one line with ', ' and ': ' separators",
    "disable_any_whitespace": "is not supported: JSON is generated on one line with ', ' and ': ' separators",
    "disable_additional_properties": "is not supported; set additionalProperties: false in the schema",
    "disable_fallback": "is not supported (there is one grammar engine, llguidance)",
}


def _unknown(where: str, name: str, known: list[str]) -> RequestError:
    message = unknown_field_message(str(name), known).replace("supplied: '", f"supplied: '{where}.", 1)
    return RequestError(message, param=f"{where}.{printable(str(name))}")


def _schema(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema sent as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise RequestError(f"{param}: the schema is not valid JSON ({err})", param=param) from None
    if not isinstance(value, dict):
        raise RequestError(f"{param}: a JSON schema must be an object", param=param)
    return value


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    param = "response_format"
    for name in value:
        if name not in ("type", "json_schema"):
            raise _unknown(param, name, ["type", "json_schema"])
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", {"type": "object"}, param)
    if kind != "json_schema":
        raise RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                           f"{printable(str(kind))!r}", param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("response_format.json_schema must be an object {'name': ..., 'schema': {...}}",
                           param="response_format.json_schema")
    for name in spec:
        if name not in JSON_SCHEMA_KEYS:
            raise _unknown("response_format.json_schema", name, JSON_SCHEMA_KEYS)
    if "schema" not in spec:
        raise RequestError("response_format.json_schema.schema is required", param="response_format.json_schema")
    return GrammarSpec("json_schema", _schema(spec["schema"], "response_format.json_schema.schema"), param)


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise RequestError(f"{param} must be a list of non-empty strings", param=param)
    return value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a non-empty string", param=param)
    return value


def _guided(kind: str, value: Any, param: str) -> GrammarSpec:
    """One of vLLM's forms (structured_outputs.KIND or guided_KIND)."""
    if kind == "json":
        return GrammarSpec("json_schema", _schema(value, param), param)
    if kind == "json_object":
        return GrammarSpec("json_schema", {"type": "object"}, param)
    if kind == "regex":
        return GrammarSpec("regex", _text(value, param), param)
    if kind == "choice":
        return GrammarSpec("choice", _choices(value, param), param)
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return GrammarSpec("lark", any_to_lark(_text(value, param)), param)
    except Exception as err:  # the GBNF converter raises plain exceptions on bad input
        raise RequestError(f"{param}: not a Lark or GBNF grammar ({' '.join(str(err).split())[:200]})",
                           param=param) from None


def grammar_spec(req: SamplingFields) -> GrammarSpec | None:
    """The constraint a request asks for, or None. Raises RequestError (400) for a malformed one, or several."""
    found: list[GrammarSpec] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(spec)
    if req.structured_outputs is not None:
        for name, value in req.structured_outputs.items():
            if name in STRUCTURED_OUTPUTS_REFUSED:
                raise RequestError(f"structured_outputs.{name} {STRUCTURED_OUTPUTS_REFUSED[name]}",
                                   param=f"structured_outputs.{name}")
            if name not in STRUCTURED_OUTPUTS_KEYS:
                raise _unknown("structured_outputs", name, STRUCTURED_OUTPUTS_KEYS + list(STRUCTURED_OUTPUTS_REFUSED))
            if value is None or (name == "json_object" and value is False):
                continue
            found.append(_guided(name, value, f"structured_outputs.{name}"))
    for kind, name in GUIDED_FIELDS:
        value = getattr(req, name, None)
        if value is not None:
            found.append(_guided(kind, value, name))
    if len(found) > 1:
        raise RequestError(f"set one output constraint, not several ({', '.join(s.param for s in found)})",
                           param=found[1].param)
    return found[0] if found else None


async def compile_constraint(llm: Any, spec: GrammarSpec | None, compiler: Any = None) -> Constraint | None:
    """Compile `spec` for the engine's tokenizer (or with `compiler`, the chat format's) on a worker thread (a large
    schema takes milliseconds to seconds; llguidance releases the GIL). Raises APIError (400) for an invalid one."""
    if spec is None:
        return None
    compiler = compiler if compiler is not None else getattr(llm, "grammar_compiler", None)
    try:
        if compiler is None:
            raise RequestError("structured output needs the model's tokenizer (the server runs without one)",
                               param=spec.param)
        constraint: Constraint = await asyncio.to_thread(compiler.compile, spec)
    except RequestError as err:
        raise from_exception(err) from None
    return constraint
