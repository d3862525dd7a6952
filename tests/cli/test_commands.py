"""generate / chat / inspect through the CLI entry point."""

from __future__ import annotations

import io
import json
import re

from moeserve.bench.checkpoints import TINY_CONFIGS
from moeserve.cli import main
from moeserve.cli.inspect import inspect_checkpoint


def test_generate_json_matches_python_api(tiny_text_model, capsys) -> None:
    from moeserve import LLM, SamplingParams

    assert main(["generate", str(tiny_text_model), "--prompt", "Once upon", "--max-tokens", "6", "--ignore-eos",
                 "--json", "--dtype", "float32"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("{")][0]
    got = json.loads(line)
    ref = LLM(str(tiny_text_model), dtype="float32").generate(
        "Once upon", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert got["token_ids"] == ref.token_ids and got["text"] == ref.text


def test_generate_stats_reports_the_kv_cache(tiny_text_model, capsys) -> None:
    """--stats: blocks (all free again at the end), preemptions, the prefix-cache hit rate (one 40-token prompt on a
    fresh engine: looked up, nothing found; hits are tested through /metrics), and prefill tokens per step under a
    small max_num_batched_tokens."""
    ids = ",".join(str((7 * i + 3) % 90 + 5) for i in range(40))
    assert main(["generate", str(tiny_text_model), "--prompt-token-ids", ids, "--max-tokens", "2", "--ignore-eos",
                 "--stats", "--max-num-batched-tokens", "16"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("kv cache:")][0]
    m = re.match(r"kv cache: (\d+) of (\d+) blocks used, (\d+) preemptions, prefix cache hit rate ([0-9.]+) "
                 r"\((\d+) of (\d+) prompt tokens\), ([0-9.]+) prefill tokens per step over (\d+) steps$", line)
    assert m, line
    used, blocks, preempted, _, hits, queried, per_step, steps = m.groups()
    assert int(used) == 0 < int(blocks) and int(preempted) == 0
    assert (int(hits), int(queried)) == (0, 40)
    assert int(steps) == 3 + 1 and float(per_step) == 40 / 4  # 40 tokens in chunks of 16, 16, 8; one decode step


def test_chat_streams_answers_for_each_turn(tiny_text_model, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nHow are you?\n/exit\n"))
    assert main(["chat", str(tiny_text_model), "--max-tokens", "5", "--ignore-eos", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if line.strip()]) == 2  # one answer line per user turn


def test_inspect_counts_by_hand(tiny_checkpoint, capsys) -> None:
    cfg = TINY_CONFIGS["qwen3_moe"]
    r = inspect_checkpoint(str(tiny_checkpoint("qwen3_moe")))
    h, i, e, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["num_experts_per_tok"]
    moe_layers = cfg["num_hidden_layers"] - len(cfg["mlp_only_layers"])
    assert r["moe_layers"] == moe_layers
    assert r["bytes_per_expert"] == 3 * h * i * 4  # gate, up, down in float32
    assert r["bytes_expert"] == moe_layers * e * 3 * h * i * 4
    embed = cfg["vocab_size"] * h * 4
    assert r["bytes_read_per_token"] == r["bytes_non_expert"] - embed + moe_layers * k * 3 * h * i * 4
    assert {"group": "model.layers.*.mlp.experts.*.up_proj.weight", "format": "F32", "tensors": moe_layers * e,
            "bytes": moe_layers * e * h * i * 4} in r["formats"]
    assert main(["inspect", str(tiny_checkpoint("qwen3_moe"))]) == 0
    assert "Qwen3MoeForCausalLM" in capsys.readouterr().out


def test_version_prints_moeserve_and_torch(capsys) -> None:
    import pytest
    import torch

    import moeserve

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"moeserve {moeserve.__version__} (torch {torch.__version__})"


def test_abbreviated_flags_are_refused(tiny_text_model, capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_text_model), "--prompt", "Hi", "--max-tok", "3"])  # --max-tokens abbreviated
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --max-tok" in capsys.readouterr().err


TIMING = re.compile(r"timing: time to first token ([0-9.]+) s; prefill (\d+) tokens in ([0-9.]+) s = ([0-9.]+) "
                    r"tokens/s; decode (\d+) tokens in ([0-9.]+) s = ([0-9.]+) tokens/s$")


def test_generate_stats_prints_time_to_first_token_and_tokens_per_second(tiny_text_model, capsys) -> None:
    """--stats' timing line, from the engine's timestamps: one 40-token prompt, 5 tokens; positive numbers, the
    prefill span of one request is its time to first token, each rate is its tokens over its seconds."""
    ids = ",".join(str((7 * i + 3) % 90 + 5) for i in range(40))
    assert main(["generate", str(tiny_text_model), "--prompt-token-ids", ids, "--max-tokens", "5", "--ignore-eos",
                 "--stats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("kv cache:")  # beside the cache tables
    m = TIMING.match(lines[-1])
    assert m, lines[-1]
    ttft, prefill_tokens, prefill_s, prefill_rate, decode_tokens, decode_s, decode_rate = map(float, m.groups())
    assert (prefill_tokens, decode_tokens) == (40, 4)
    assert 0 < ttft == prefill_s and decode_s > 0
    for tokens, seconds, rate in ((prefill_tokens, prefill_s, prefill_rate), (decode_tokens, decode_s, decode_rate)):
        assert rate > 0 and abs(tokens / seconds - rate) <= 0.05 + rate * 0.0001 / seconds  # printed roundings


def test_timing_text_spans_a_batch() -> None:
    """Two requests (arrival, first token, last token): prefill from the first arrival to the last first token,
    decode from the first first token to the last token, n=2 sequences counted apiece."""
    from moeserve.cli.generate import timing_text
    from moeserve.engine.outputs import CompletionOutput, RequestOutput

    def request(prompt_len: int, tokens: list[int], times: tuple[float, float, float]) -> RequestOutput:
        samples = [CompletionOutput(i, "", [0] * n, None, None, "length") for i, n in enumerate(tokens)]
        metrics = dict(zip(("arrival_time", "first_token_time", "last_token_time"), times))
        return RequestOutput(str(prompt_len), None, [1] * prompt_len, samples, True, metrics)

    text = timing_text([request(30, [5], (10.0, 10.5, 11.5)), request(10, [3, 2], (10.0, 10.75, 11.0))])
    assert text == ("timing: time to first token 0.6250 s (mean of 2 requests, max 0.7500 s); prefill 40 tokens in "
                    "0.7500 s = 53.3 tokens/s; decode 7 tokens in 1.0000 s = 7.0 tokens/s")
    one = timing_text([request(8, [1], (1.0, 1.25, 1.25))])
    assert one == "timing: time to first token 0.2500 s; prefill 8 tokens in 0.2500 s = 32.0 tokens/s; decode: " \
        "no token after the first"


def test_a_bad_command_or_choice_names_the_closest(capsys) -> None:
    import pytest

    for argv, expected in ((["serv"], "argument COMMAND: invalid choice: 'serv' (did you mean 'serve'?)"),
                           (["generate", "--kernels", "cppp"], "invalid choice: 'cppp' (did you mean 'cpp'?)"),
                           (["generate", "--kernels", "zzz"], "invalid choice: 'zzz' (choose from")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert expected in capsys.readouterr().err
