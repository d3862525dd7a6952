"""The published chat templates of the issue-18 models, rendered by moeserve's chat format (server/chat_format.py)
exactly as transformers' apply_chat_template renders them with a tokenizer carrying the template.

Templates (tests/server/templates/published/, see its README.md): the files llama.cpp keeps of each model's
published tokenizer_config.json chat template, taken from the llama-cpp-python 0.3.36 sdist on PyPI
(vendor/llama.cpp/models/templates/). The conversation has every role: system, user, an assistant turn with two
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
}
CALLS = [("call_1", "get_weather", {"city": "Paris", "days": 2}), ("call_2", "get_time", {})]


def conversation(arguments_as: type, call_content: str | None = None) -> list[dict[str, Any]]:
    """OpenAI messages; call arguments as JSON text (`str`, the API's form) or a mapping (`dict`, transformers');
    the tool-call turn's content null (the API's form) or ``""``."""
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a) if arguments_as is str
                                                          else a}} for i, n, a in CALLS]
    return [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": call_content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "high": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
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
    prompt = chat.render(ChatCompletionRequest(messages=conversation(str, call_content), tools=tools))
    reference = AutoTokenizer.from_pretrained(str(folder))
    # the form each template's model card passes: R1's template concatenates the arguments' JSON text
    messages = conversation(str if family.startswith("DeepSeek-R1") else dict, call_content)
    want = reference.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert all(text in want for text in ("terse", "get_weather", "Paris", "sunny", "14:05", "tomorrow"))
    if offered:
        assert "Weather of a city" in want  # the tool's description: the template showed the tools
    assert prompt.text == want
    assert prompt.token_ids == reference.encode(want, add_special_tokens=False)
