"""gpt-oss chat format: rendering equals openai-harmony's own, output parsing, and serving with networking off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moeserve.server.chat_format import ChatDelta, ChatPrompt, HarmonyChat, chat_format_for
from moeserve.server.protocol import ChatCompletionRequest
from moeserve.server.streaming import Delta
from moeserve.server.tool_parsers import ToolCallDelta
from tests.cpu_emulation import child_pythonpath
from tests.kernels.ops import suite_isa
from tests.server.conftest import REPO

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "reasoning": "I should call the tool.", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 20}"},
    {"role": "assistant", "content": "Il fait 20 degrés."},
    {"role": "user", "content": "Merci !"},
]


@pytest.fixture(scope="module")
def harmony() -> HarmonyChat:
    return HarmonyChat(None)


def expected_conversation() -> Any:
    """The same conversation built by hand with openai-harmony, following its documentation."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    fn = WEATHER_TOOL["function"]
    return Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new()
                                      .with_instructions("You are terse.\n\nAnswer in French.")
                                      .with_function_tools([ToolDescription.new(fn["name"], fn["description"],
                                                                                fn["parameters"])])),
        Message.from_role_and_content(Role.USER, "What is the weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "I should call the tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "{\"city\": \"Paris\"}").with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "{\"temperature\": 20}")
        .with_recipient("assistant").with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, "Il fait 20 degrés.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "Merci !"),
    ])


def test_rendering_equals_openai_harmony(harmony: HarmonyChat) -> None:
    from openai_harmony import Role

    request = ChatCompletionRequest(messages=CONVERSATION, tools=[WEATHER_TOOL], reasoning_effort="low")
    ours = harmony.render(request).token_ids
    theirs = harmony.encoding.render_conversation_for_completion(expected_conversation(), Role.ASSISTANT)
    assert ours == list(theirs)
    text = harmony.encoding.decode_utf8(ours)
    # Client system + developer messages are the developer message's instructions, as harmony prescribes.
    assert "<|start|>developer<|message|># Instructions\n\nYou are terse.\n\nAnswer in French." in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in text
    assert text.endswith("<|start|>user<|message|>Merci !<|end|><|start|>assistant")


def _parse(harmony: HarmonyChat, completion: str) -> tuple[str, str, Any]:
    tokens = harmony.encoding.encode(completion, allowed_special="all")
    parser = harmony.new_parser(ChatPrompt([]))
    reasoning = content = ""
    for i in range(0, len(tokens), 3):  # fed in pieces, as a stream arrives
        piece = tokens[i:i + 3]
        d = parser.feed(Delta("", piece, None, None, None))
        reasoning, content = reasoning + d.reasoning, content + d.content
    return reasoning, content, parser


def test_output_channels_are_split(harmony: HarmonyChat) -> None:
    from openai_harmony import Role

    completion = ("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>Bonjour !<|return|>")
    reasoning, content, parser = _parse(harmony, completion)
    reference = harmony.encoding.parse_messages_from_completion_tokens(
        harmony.encoding.encode(completion, allowed_special="all"), Role.ASSISTANT)
    assert [(m.channel, m.content[0].text) for m in reference] == [("analysis", reasoning), ("final", content)]
    assert parser.has_content() and not parser.cut_in_reasoning()


def test_cut_inside_analysis_is_reported(harmony: HarmonyChat) -> None:
    reasoning, content, parser = _parse(harmony, "<|channel|>analysis<|message|>Let me think about this")
    assert reasoning == "Let me think about this" and content == ""
    assert parser.cut_in_reasoning() and not parser.has_content()


def test_tool_call_is_parsed(harmony: HarmonyChat) -> None:
    completion = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                  "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
    tokens = harmony.encoding.encode(completion, allowed_special="all")
    for step in (1, 3, len(tokens)):  # the same call whatever pieces the tokens come in
        parser = harmony.new_parser(ChatPrompt([]))
        out = ChatDelta()
        for i in range(0, len(tokens), step):
            out.extend(parser.feed(Delta("", tokens[i:i + step], None, None, None)))
        out.extend(parser.flush())
        assert out.reasoning == "Need weather." and out.content == ""
        assert out.tool_calls[0] == ToolCallDelta(0, "get_weather")  # the name comes first, on its own
        assert "".join(c.arguments for c in out.tool_calls) == "{\"city\": \"Paris\"}"
        assert {c.index for c in out.tool_calls} == {0}


def test_gpt_oss_model_type_selects_harmony() -> None:
    assert isinstance(chat_format_for("gpt_oss", None, None), HarmonyChat)
    assert not isinstance(chat_format_for("qwen3_moe", None, None), HarmonyChat)


# --------------------------------------------------------------------------------------- networking off
@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init gpt-oss written by transformers, with the o200k-harmony vocabulary size (no tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny_gpt_oss")
    config = AutoConfig.for_model("gpt_oss", hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, vocab_size=201088, max_position_embeddings=512,
                                  sliding_window=16, eos_token_id=200002, pad_token_id=199999,
                                  initializer_range=0.08)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    return folder


def offline_client_main(model: str) -> None:
    """Run inside the network-less namespace: serve `model`, ask one chat completion, print the result."""
    import time

    import httpx
    import openai

    from tests.server.conftest import free_socket

    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "-m", "moeserve", "serve", model, "--port", str(port),
                               "--skip-tokenizer-init", "--dtype", "float32", "--threads", "1"])
    try:
        url = f"http://127.0.0.1:{port}"
        # Ready when /health answers 200 (no deadline a slow start could exceed); a server that exits instead ends
        # the wait.
        while server.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert server.poll() is None, f"the server exited with {server.returncode} before it was ready"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model=Path(model).name, max_tokens=8, temperature=0,
                                             messages=[{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}])
        print("RESULT " + out.model_dump_json())
    finally:
        server.terminate()
        server.wait(30)


def _offline_command(tmp: Path) -> tuple[list[str], dict[str, str], str]:
    """A command prefix without network access: a new network namespace if we may make one, else proxies that
    point nowhere (mode says which). The cache is fresh but for the C++ kernels: this process's build is linked in
    (building them again took most of this test's time and has nothing to do with the network)."""
    from moeserve import kernels

    env = {k: v for k, v in os.environ.items() if not k.startswith("TIKTOKEN")}
    env.update(XDG_CACHE_HOME=str(tmp / "cache"), HF_HUB_OFFLINE="1", PYTHONPATH=child_pythonpath(REPO))
    kernels.load(suite_isa())  # built or found cached (a no-op after the first engine of the session)
    linked = tmp / "cache" / "moeserve" / "kernels"
    linked.parent.mkdir(parents=True)
    linked.symlink_to(kernels.cache_root(), target_is_directory=True)
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if unshare and ip and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn", "sh", "-c", f'{ip} link set lo up && exec "$0" "$@"'], env, "namespace"
    env.update(HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", ALL_PROXY="http://127.0.0.1:9",
               NO_PROXY="127.0.0.1,localhost")
    return [], env, "proxies"


@pytest.mark.slow
def test_gpt_oss_server_runs_with_networking_off(tiny_gpt_oss: Path, tmp_path: Path,
                                                 harmony: HarmonyChat) -> None:
    prefix, env, mode = _offline_command(tmp_path)
    code = f"from tests.server.test_harmony import offline_client_main; offline_client_main({str(tiny_gpt_oss)!r})"
    proc = subprocess.run([*prefix, sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and result, f"[{mode}] {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "chat format: harmony" in proc.stderr
    out = json.loads(result[0].removeprefix("RESULT "))
    # The vocabulary came from the bundled copy, unpacked into the (fresh) cache: nothing was downloaded.
    assert (tmp_path / "cache" / "moeserve" / "tiktoken" / "o200k_base.tiktoken").is_file()
    prompt = harmony.render(ChatCompletionRequest(messages=[{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Hi"}]))
    assert out["usage"]["prompt_tokens"] == len(prompt.token_ids)
    message = out["choices"][0]["message"]
    assert message["content"] is not None or message["reasoning"] is not None


def test_output_that_is_not_harmony_is_kept_as_content(harmony: HarmonyChat) -> None:
    short = "plain text: héllo 😀"
    parser = harmony.new_parser(ChatPrompt([]))
    streamed = "".join(parser.feed(Delta("", [t], None, None, None)).content for t in harmony.encoding.encode(short))
    assert streamed == ""  # could still be a header: held back ...
    assert parser.flush().content == short and parser.has_content()  # ... and returned at the end

    long = "The model forgot its format and just talks. " * 8
    parser = harmony.new_parser(ChatPrompt([]))
    streamed = "".join(parser.feed(Delta("", [t], None, None, None)).content for t in harmony.encoding.encode(long))
    assert streamed + parser.flush().content == long
    assert len(streamed) > len(long) // 2  # streamed as it comes once it cannot be a header

    # A token holding part of a character waits for the rest of it.
    parser = harmony.new_parser(ChatPrompt([]))
    parser.feed(Delta("", harmony.encoding.encode(long), None, None, None))
    emoji = harmony.encoding.encode("😀")
    partial = [t for t in range(200, 256) if harmony.encoding.decode([t]) == "\ufffd"][:1]
    assert "\ufffd" not in parser.feed(Delta("", partial, None, None, None)).content
    assert parser.feed(Delta("", emoji, None, None, None)).content.endswith("😀")
