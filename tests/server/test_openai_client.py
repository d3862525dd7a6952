"""The official `openai` client against a live server on 127.0.0.1 (tiny Qwen3-MoE with a ChatML tokenizer)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.server.conftest import MODEL_NAME, ThreadServer

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "You are a fox."}, {"role": "user", "content": "Hello, how are you?"}]


def _hf_tokenizer(folder: Path):  # noqa: ANN202 - transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _hf_chat_ids(folder: Path, messages: list[dict]) -> list[int]:
    out = _hf_tokenizer(folder).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])  # transformers 5 returns a BatchEncoding


def test_models_lists_the_served_name(live_server: ThreadServer) -> None:
    models = live_server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_stream_equals_non_stream_and_usage(live_server: ThreadServer, tiny_text_model: Path) -> None:
    client = live_server.client()
    prompt = "Once upon a time there was"
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    prompt_tokens = len(_hf_tokenizer(tiny_text_model)(prompt)["input_ids"])
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 12)
    assert full.usage.total_tokens == prompt_tokens + 12
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream_and_prompt_matches_transformers(live_server: ThreadServer,
                                                                       tiny_text_model: Path) -> None:
    client = live_server.client()
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert full.usage.prompt_tokens == len(_hf_chat_ids(tiny_text_model, MESSAGES))
    assert full.usage.completion_tokens == 10
    assert chunks[-1].usage == full.usage


def test_tokenize_chat_matches_transformers_template(live_server: ThreadServer, tiny_text_model: Path) -> None:
    got = httpx.post(live_server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert got["tokens"] == _hf_chat_ids(tiny_text_model, MESSAGES)
    text = httpx.post(live_server.url + "/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nYou are a fox.<|im_end|>")


def test_stop_string_cuts_the_text(live_server: ThreadServer) -> None:
    client = live_server.client()
    prompt = "The fox liked to run"
    text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
    # A stop string from the middle of the greedy text, made of plain characters.
    at = next(i for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
    stop = text[at:at + 2]
    cut = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, stop=[stop], **GREEDY)
    assert cut.choices[0].text == text[:at]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, stop=stop, stream=True,
                                         **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == text[:at]


def test_n_samples_and_seeded_sampling_is_reproducible(live_server: ThreadServer) -> None:
    client = live_server.client()
    kwargs = dict(model=MODEL_NAME, prompt="Hello", max_tokens=8, n=3, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2, seed=7,
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 10


def _reference_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' next-token logits after `ids`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def test_logprobs_match_transformers(live_server: ThreadServer, tiny_text_model: Path) -> None:
    client = live_server.client()
    prompt = "The quick brown fox"
    ref = _reference_logprobs(tiny_text_model, _hf_tokenizer(tiny_text_model)(prompt)["input_ids"])
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] == pytest.approx(float(ref.max()), abs=1e-4)
    # Legacy format: one entry per distinct token text, so tokens decoding alike collapse into the likeliest.
    assert 1 <= len(lp.top_logprobs[0]) <= 3
    assert max(lp.top_logprobs[0].values()) == pytest.approx(float(ref.max()), abs=1e-4)

    chat_ref = _reference_logprobs(tiny_text_model, _hf_chat_ids(tiny_text_model, MESSAGES))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(chat_ref.topk(2).values.tolist(),
                                                                          abs=1e-4)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy = the top one


def test_unknown_fields_are_400_with_did_you_mean(live_server: ThreadServer) -> None:
    client = live_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", extra_body={"max_tokns": 8})
    err = _error(info.value)
    assert err["message"] == "Unrecognized request argument supplied: 'max_tokns' (did you mean 'max_tokens'?)"
    assert (err["type"], err["param"]) == ("invalid_request_error", "max_tokns")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, extra_body={"temprature": 0})
    assert "did you mean 'temperature'?" in _error(info.value)["message"]
    bad_message = [{"role": "user", "content": "Hi", "nmae": "x"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=bad_message)  # type: ignore[misc,list-item]
    err = _error(info.value)
    assert err["message"].startswith("messages.0: Unrecognized request argument supplied: 'nmae'")
    assert err["param"] == "messages.0.nmae" and "\n" not in err["message"]


def test_every_openai_request_field_is_known(live_server: ThreadServer) -> None:
    """Each field of the official client's request types is recognised: honoured, accepted without effect, or
    refused with a reason, never 'Unrecognized'."""
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import completion_create_params as chat_params

    for path, params in (("/v1/chat/completions", chat_params.CompletionCreateParamsBase),
                         ("/v1/completions", completion_params.CompletionCreateParamsBase)):
        base = {"model": MODEL_NAME, "max_tokens": 1, **({"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"})}
        for name in params.__annotations__:
            # null is a bad value for some fields (a 400 saying so), but never an unknown field
            resp = httpx.post(live_server.url + path, json={**base, name: base.get(name)})
            assert resp.status_code in (200, 400), (path, name, resp.text)
            assert "Unrecognized" not in resp.text, (path, name)
        assert "Unrecognized" in httpx.post(live_server.url + path, json={**base, "no_such_field": 1}).text


def test_fields_moeserve_cannot_honour_are_refused(live_server: ThreadServer) -> None:
    client = live_server.client()
    refused = [({"logit_bias": {"5": 10}}, "logit_bias"), ({"guided_whitespace_pattern": " *"},
               "guided_whitespace_pattern"), ({"stream_options": {"continuous_usage_stats": True}}, "stream_options")]
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, extra_body=extra)
        assert _error(info.value)["param"] == param
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1, suffix="end")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1, best_of=3)
    # Accepted without effect: the same greedy output as without them.
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **GREEDY)
    tagged = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, user="u1",
                                            metadata={"k": "v"}, store=False, prompt_cache_key="abc",
                                            response_format={"type": "text"}, **GREEDY)
    assert tagged.choices[0].message.content == plain.choices[0].message.content


# ------------------------------------------------------------------------------------------------------ errors
def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_unknown_model_is_404(live_server: ThreadServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        live_server.client().completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    err = _error(info.value)
    assert err["code"] == "model_not_found" and "no-such-model" in err["message"]


def test_prompt_longer_than_context_is_400(live_server: ThreadServer) -> None:
    client = live_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[5] * 600, max_tokens=2)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 512 tokens.")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=500)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded" and "in the completion" in err["message"]


def test_malformed_requests_are_400_with_bounded_bodies(live_server: ThreadServer) -> None:
    url = live_server.url
    with pytest.raises(openai.BadRequestError) as info:
        live_server.client().completions.create(model=MODEL_NAME, prompt="Hi", temperature=-1)
    assert _error(info.value)["param"] == "temperature"
    bad_json = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    huge = {"model": MODEL_NAME, "messages": [{"role": "nobody", "content": "x" * 10_000}] * 300}  # under 4 MB
    resp = httpx.post(url + "/v1/chat/completions", json=huge)
    assert resp.status_code == 400
    assert len(resp.content) < 2_000  # the 3 MB input is not echoed back
    assert httpx.get(url + "/v1/nothing-here").json()["error"]["type"] == "not_found_error"


def test_streamed_n_samples_equal_non_streamed(live_server: ThreadServer) -> None:
    client = live_server.client()
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=6, n=3, temperature=0.8, seed=99,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                assert choice.index not in finish  # each choice finishes exactly once
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert full.usage.completion_tokens == 18  # max_completion_tokens is honoured


def test_several_prompts_in_one_completion_request(live_server: ThreadServer) -> None:
    client = live_server.client()
    prompts = ["Hello", "The fox"]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, **GREEDY).choices[0].text
             for p in prompts]
    both = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, n=2, **GREEDY)
    by_index = {c.index: c.text for c in both.choices}
    assert by_index == {0: alone[0], 1: alone[0], 2: alone[1], 3: alone[1]}  # index = prompt * n + sample
    assert both.usage.completion_tokens == 20
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, stream=True, **GREEDY):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: alone[0], 1: alone[1]}


def test_extreme_sampling_values_cannot_kill_the_engine(live_server: ThreadServer) -> None:
    """Found by the fuzzer: a subnormal temperature or penalty overflowed the logits and crashed the engine."""
    client = live_server.client()
    greedy = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, **GREEDY)
    tiny = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=1e-300,
                                     extra_body={"ignore_eos": True})
    assert tiny.choices[0].text == greedy.choices[0].text  # below 1e-5 the temperature means greedy
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4,
                                  extra_body={"repetition_penalty": 1e-300})
    assert httpx.get(live_server.url + "/health").status_code == 200


def test_content_parts(live_server: ThreadServer) -> None:
    client = live_server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "fox"}]}]
    joined = [{"role": "user", "content": "Hello, fox"}]
    a = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=3, **GREEDY)
    b = client.chat.completions.create(model=MODEL_NAME, messages=joined, max_tokens=3, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model=MODEL_NAME, messages=image, max_tokens=3)
