"""The published chat templates of the issue-18 models, rendered by moeserve's chat format (server/chat_format.py)
exactly as transformers' apply_chat_template renders them with a tokenizer carrying the template.

Templates (tests/server/templates/published/, see its README.md for each file's source and sha256): the files
llama.cpp keeps of each model's published tokenizer_config.json chat template, taken from the llama-cpp-python 0.3.36
sdist on PyPI (vendor/llama.cpp/models/templates/); Qwen3-Next's from xinference's model registry; Kimi-K2-Thinking's
from an earlier llama.cpp commit (its later copies are modified); Kimi-K2-Instruct's from two unpatched third-party
copies (see the README). The conversation has every role: system, user, an assistant turn with two
tool calls (and one with text), the tool results, a user follow-up; tools are offered. The reference passes call
arguments as a mapping (transformers' convention, what each model card shows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moeserve.server.chat_format import chat_format_for
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.tokenizer import Tokenizer
from tests.server.test_chat_tools import TIME, WEATHER, _model_folder

PUBLISHED = Path(__file__).parent / "templates" / "published"
# model family -> (template file, config.json model_type the server reads, tools offered in the request).
# The two in tests/server/templates are engineer E's copies of GLM-4.5's and DeepSeek-R1's published templates.
# DeepSeek-V3.1's and R1's templates never read `tools` (its model card puts them in the system prompt: moeserve refuses
# `tools` for it, tested in test_chat_formats); it still renders a history holding tool calls and results.
TEMPLATES = {
    "GLM-4.5/4.6": ("GLM-4.6.jinja", "glm4_moe", True),
    "DeepSeek-V3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3", False),
    "GLM-4.5 (tests/server/templates)": ("../glm4_5.jinja", "glm4_moe", True),
    "DeepSeek-R1 (tests/server/templates)": ("../deepseek_r1.jinja", "deepseek_v3", False),
    "Qwen3": ("Qwen-Qwen3-0.6B.jinja", "qwen3_moe", True),
    "Qwen3.5": ("Qwen3.5-4B.jinja", "qwen3_5_moe", True),
    "Nemotron-3-Nano": ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "nemotron_h", True),
    "Qwen3-Next-Instruct": ("Qwen3-Next-Instruct.jinja", "qwen3_next", True),
    "Qwen3-Next-Thinking": ("Qwen3-Next-Thinking.jinja", "qwen3_next", True),
    "Kimi-K2-Thinking": ("moonshotai-Kimi-K2-Thinking.jinja", "kimi_k2", True),
    "Kimi-K2-Instruct-0905": ("moonshotai-Kimi-K2-Instruct-0905.jinja", "kimi_k2", True),
    "Kimi-K2-Instruct": ("moonshotai-Kimi-K2-Instruct.jinja", "kimi_k2", True),
    "Gemma-4": ("google-gemma-4-31B-it.jinja", "gemma4_text", True),
}
CALLS = [("call_1", "get_weather", {"city": "Paris", "days": 2}), ("call_2", "get_time", {})]
# Kimi's template writes each call's id back to the model (and a result's tool_call_id): the ids it was trained on
KIMI_IDS = {"call_1": "functions.get_weather:0", "call_2": "functions.get_time:1"}


def conversation(arguments_as: type, call_content: str | None = None, ids: dict[str, str] | None = None
                 ) -> list[dict[str, Any]]:
    """OpenAI messages; call arguments as JSON text (`str`, the API's form) or a mapping (`dict`, transformers');
    the tool-call turn's content null (the API's form) or ``""``; `ids` renames the call ids."""
    ids = ids or {}
    calls = [{"id": ids.get(i, i), "type": "function", "function": {
        "name": n, "arguments": json.dumps(a) if arguments_as is str else a}} for i, n, a in CALLS]
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": call_content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": ids.get("call_1", "call_1"), "content": '{"sky": "sunny", "high": 21}'},
        {"role": "tool", "tool_call_id": ids.get("call_2", "call_2"), "content": "14:05"},
        {"role": "assistant", "content": "Sunny, 21 C; it is 14:05."},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize("family", TEMPLATES)
def test_rendering_equals_apply_chat_template(family: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    file_name, model_type, offered = TEMPLATES[family]
    tools = [WEATHER, TIME] if offered else None
    folder = _model_folder(tmp_path, (PUBLISHED / file_name).read_text())
    chat = chat_format_for(model_type, Tokenizer(folder), folder)
    # transformers drops a null content, which Qwen3's and R1's templates cannot render: "" in both requests there
    call_content = "" if family in ("Qwen3", "DeepSeek-R1 (tests/server/templates)") else None
    ids = KIMI_IDS if family.startswith("Kimi") else None
    prompt = chat.render(ChatCompletionRequest(messages=conversation(str, call_content, ids), tools=tools))
    reference = AutoTokenizer.from_pretrained(str(folder))
    # the form each template's model card passes: R1's template concatenates the arguments' JSON text, Kimi's
    # model card sends the OpenAI client's messages back (arguments as text)
    text_arguments = family.startswith(("DeepSeek-R1", "Kimi"))
    messages = conversation(str if text_arguments else dict, call_content, ids)
    want = reference.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert all(text in want for text in ("terse", "get_weather", "Paris", "sunny", "14:05", "tomorrow"))
    if offered:
        assert "Weather of a city" in want  # the tool's description: the template showed the tools
    assert prompt.text == want
    assert prompt.token_ids == reference.encode(want, add_special_tokens=False)



def test_kimi_history_holds_the_model_s_ids_and_text(tmp_path: Path) -> None:
    """Kimi's template writes each call's id, each result's tool_call_id and a string's arguments back verbatim:
    the prompt repeats the `functions.NAME:IDX` ids the server gave (KimiK2ToolParser) and the arguments as the
    model wrote them, whatever their spacing; transformers, given the same messages, agrees."""
    from transformers import AutoTokenizer

    folder = _model_folder(tmp_path, (PUBLISHED / "moonshotai-Kimi-K2-Thinking.jinja").read_text())
    chat = chat_format_for("kimi_k2", Tokenizer(folder), folder)
    messages = conversation(str, None, KIMI_IDS)
    compact = '{"city":"Paris","days":2}'
    messages[2]["tool_calls"][0]["function"]["arguments"] = compact
    prompt = chat.render(ChatCompletionRequest(messages=messages))
    text = prompt.text or ""
    assert f"functions.get_weather:0<|tool_call_argument_begin|>{compact}<|tool_call_end|>" in text
    assert "## Return of functions.get_weather:0\n" in text and "## Return of functions.get_time:1\n" in text
    want = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert text == want


def test_kimi_hub_revision_tools_line(tmp_path: Path) -> None:
    """The hub's current Kimi-K2-Thinking template (revision 6126819) differs from the copy here in one line: the tool
    list is written with tojson(separators=(',', ':')) (no spaces). That line, put in the copy, renders as
    transformers renders it."""
    from transformers import AutoTokenizer

    copy = (PUBLISHED / "moonshotai-Kimi-K2-Thinking.jinja").read_text()
    assert copy.count("tools | tojson()") == 1
    folder = _model_folder(tmp_path, copy.replace("tools | tojson()", "tools | tojson(separators=(',', ':'))"))
    chat = chat_format_for("kimi_k2", Tokenizer(folder), folder)
    messages = conversation(str, None, KIMI_IDS)
    prompt = chat.render(ChatCompletionRequest(messages=messages, tools=[WEATHER, TIME]))
    want = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False)
    assert '[{"type":"function","function":{"name":"get_weather"' in want
    assert prompt.text == want


@pytest.mark.parametrize("family", [f for f in TEMPLATES if f.startswith("Kimi")])
def test_kimi_templates_pick_the_kimi_tool_parser(family: str) -> None:
    """Each published Kimi-K2 template (Thinking, Instruct, Instruct-0905) is recognised as Kimi's call format."""
    from moeserve.server.tool_parsers import KimiK2ToolParser, tool_parser_for

    assert tool_parser_for((PUBLISHED / TEMPLATES[family][0]).read_text()) is KimiK2ToolParser



def test_gemma4_calls_as_the_template_renders_them_parse_back(tmp_path: Path) -> None:
    """The calls of the conversation as Gemma-4's published template renders them (`<|tool_call>call:NAME{key:
    <|"|>text<|"|>,...}<tool_call|>`: not JSON), fed to the parser its template picks in small pieces, give the
    calls' names and arguments back; text that is not a call stays content."""
    from transformers import AutoTokenizer

    from moeserve.server.tool_parsers import Gemma4ToolParser, tool_parser_for

    template = (PUBLISHED / TEMPLATES["Gemma-4"][0]).read_text()
    assert tool_parser_for(template) is Gemma4ToolParser
    folder = _model_folder(tmp_path, template)
    nested = {"city": "Paris, <b>\"old\" town</b>", "days": 2, "hourly": True, "at": [8.5, "noon"],
              "units": {"temp": "C"}}
    messages = conversation(dict)[:3]
    messages[2]["tool_calls"][1]["function"]["arguments"] = nested
    rendered = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tokenize=False)
    calls = rendered[rendered.index("<|tool_call>"):rendered.rindex("<tool_call|>") + len("<tool_call|>")]
    parser = Gemma4ToolParser([WEATHER, TIME])
    parses = [parser.feed(calls[i:i + 3]) for i in range(0, len(calls), 3)] + [parser.flush()]
    deltas = [c for p in parses for c in p.calls]
    names = [d.name for d in deltas if d.name is not None]
    arguments = [json.loads("".join(d.arguments for d in deltas if d.index == i)) for i in range(2)]
    assert "".join(p.content for p in parses) == ""
    assert names == ["get_weather", "get_time"] and arguments == [{"city": "Paris", "days": 2}, nested]
    text = Gemma4ToolParser([]).feed("Sure: <|tool_call>not a call<tool_call|> done")
    assert text.content == "Sure: <|tool_call>not a call<tool_call|> done" and not text.calls
