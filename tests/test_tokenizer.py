"""Tokenizer and chat template rendering identical to transformers' AutoTokenizer / apply_chat_template."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from moeserve.tokenizer import Tokenizer

# A template exercising what real ones use: namespace, loop controls, tojson of tools, raise_exception,
# system-message handling, reasoning fields and the special-token variables.
RICH_TEMPLATE = """{%- set ns = namespace(first=true) -%}
{{- bos_token or '' -}}
{%- if tools %}<tools>{{ tools | tojson }}</tools>
{% endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' and not loop.first -%}{{ raise_exception('system must come first') }}{%- endif -%}
{%- if message['role'] == 'tool' %}{% continue %}{% endif -%}
<|im_start|>{{ message['role'] }}
{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>
{% endif %}{{ message['content'] }}<|im_end|>
{% if loop.last and add_generation_prompt %}<|im_start|>assistant
{% endif -%}
{%- endfor -%}
{{- eos_token if not add_generation_prompt else '' -}}"""

MESSAGES = [
    {"role": "system", "content": "You are terse. Ünïcode <b>ok</b>"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "2+2 is 4"},
    {"role": "tool", "content": "ignored"},
    {"role": "user", "content": "And 3+3?"},
]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"a": "<int>"}}}]


@pytest.fixture
def folder(tiny_text_model, tmp_path):
    dst = tmp_path / "tok"
    shutil.copytree(tiny_text_model, dst)
    return dst


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rich_template_matches_transformers(folder, gen: bool, tools) -> None:
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    ref = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=gen)
    ours = Tokenizer(folder).apply_chat_template(MESSAGES, add_generation_prompt=gen, tools=tools)
    assert ours == ref


def test_template_from_tokenizer_config_matches_transformers(folder) -> None:
    ref = AutoTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES[:2], tokenize=False,
                                                                    add_generation_prompt=True)
    assert Tokenizer(folder).apply_chat_template(MESSAGES[:2]) == ref


def test_encode_decode_match_transformers(folder) -> None:
    ref = AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer(folder)
    for text in ["Once upon a time", "  spaced\nlines\t!", "Ünïcode 漢字 🙂"]:
        assert ours.encode(text) == ref.encode(text)
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_template_error_is_a_request_error(folder) -> None:
    from moeserve.errors import RequestError

    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(RequestError, match="system must come first"):
        Tokenizer(folder).apply_chat_template(bad)


def test_missing_tokenizer_is_actionable(tiny_checkpoint) -> None:
    from moeserve.errors import CheckpointError

    with pytest.raises(CheckpointError, match="skip_tokenizer_init"):
        Tokenizer(tiny_checkpoint("qwen3_moe"))


def test_tokenizer_config_special_token_objects(folder) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|im_end|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(folder).eos_token_id == Tokenizer(folder).token_to_id("<|im_end|>")
