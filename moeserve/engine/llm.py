"""LLM: the offline Python API, in vLLM's shape.

    llm = LLM("path/to/model", dtype="float32")
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8))
    outs[0].outputs[0].text
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moeserve.config import EngineSettings, build_settings
from moeserve.engine.llm_engine import LLMEngine
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import RequestError

PromptType = str | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """Load `model` (folder or cached HF id; None = the bundled demo model). Keywords are EngineSettings
        fields; an unknown keyword raises ConfigError with a "did you mean"."""
        settings: EngineSettings = build_settings(EngineSettings, {"model": model, **kwargs})
        self.engine = LLMEngine(settings)

    def get_tokenizer(self):  # noqa: ANN201 - moeserve.tokenizer.Tokenizer | None
        return self.engine.tokenizer

    @property
    def stats(self):  # noqa: ANN201 - moeserve.experts.store.StoreStats
        """Expert-store statistics (hits, misses, bytes read per layer)."""
        return self.engine.model.store.stats

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (batched together); one RequestOutput per prompt, in order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise RequestError("sampling_params must be one object or one per prompt", param="sampling_params")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                text = prompt.get("prompt") if isinstance(prompt, dict) else None
                ids.append(self.engine.add_request(_prompt_input(prompt), p, prompt_text=text))
            return self._run(ids)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate."""
        tok = self.engine.tokenizer
        if tok is None:
            raise RequestError("chat needs a tokenizer (skip_tokenizer_init=True was set)", param="messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                           **(chat_template_kwargs or {}))
            # The template already holds the special tokens: do not add BOS again.
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.error is not None:  # one request failed while the step went on (generate aborts the rest)
                    raise out.error
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return str(prompt["prompt"])
    raise RequestError("a prompt is a string or {'prompt_token_ids': [...]}", param="prompt")
