"""A shard that is truncated (or unreadable) while the engine runs: the step that meets it during a miss fails with
one clear line, the store stays consistent, and once the file is whole again the next call gives the right output."""

from __future__ import annotations

import pytest

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import ExpertLoadError

PROMPT = {"prompt_token_ids": [3, 17, 42, 9]}
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_truncated_shard_fails_the_call_and_the_next_call_works(tiny_checkpoint, copy_checkpoint):
    folder = copy_checkpoint(tiny_checkpoint("qwen3_moe"))
    shard = folder / "model.safetensors"
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", threads=1, expert_cache_gb=4e-6)
    store = llm.engine.model.store
    try:
        expected = llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids
        whole = shard.read_bytes()
        with open(shard, "r+b") as f:
            f.truncate(len(whole) // 8)  # every expert's bytes are gone; resident weights are already loaded
        with pytest.raises(ExpertLoadError) as err:
            llm.generate(PROMPT, PARAMS)
        message = str(err.value)
        assert "\n" not in message and "model.safetensors" in message and "of layer" in message
        assert not store.cache.loading_keys and not store.cache.pinned_keys
        assert not llm.engine.has_unfinished_requests()
        shard.write_bytes(whole)  # the file is whole again (same inode: the open descriptor sees it)
        again = llm.generate(PROMPT, PARAMS)[0].outputs[0].token_ids
        assert again == expected
        assert store.stats.load_errors >= 1
    finally:
        llm.engine.close()
