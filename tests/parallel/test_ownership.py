"""Who owns which experts (parallel/ownership.py), what the ranks compare (parallel/identity.py) and the addresses
the head accepts (parallel/link.py): pure functions, no processes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moeserve.errors import ConfigError
from moeserve.parallel.identity import first_mismatch, tensor_index_digest
from moeserve.parallel.link import _short, check_listen_address, parse_address
from moeserve.parallel.ownership import (
    assign_experts,
    describe_ownership,
    format_ids,
    owned,
    proportional_counts,
)


def test_contiguous_ranges_follow_the_budgets() -> None:
    owners = assign_experts(8, [20, 60, 60])
    assert owners == [0, 1, 1, 1, 1, 2, 2, 2]  # shares 1.14, 3.43, 3.43: floors 1, 3, 3, the last one to rank 1
    assert owners == sorted(owners)  # ranges in expert order
    counts = [owners.count(r) for r in range(3)]
    assert sum(counts) == 8 and all(abs(c - 8 * b / 140) < 1 for c, b in zip(counts, [20, 60, 60], strict=True))
    big = assign_experts(128, [20, 60, 60])
    assert [big.count(r) for r in range(3)] == proportional_counts(128, [20, 60, 60])
    assert abs(big.count(0) - 128 * 20 / 140) < 1.5 and abs(big.count(1) - 128 * 60 / 140) < 1.5


def test_round_robin_and_refusals() -> None:
    assert assign_experts(8, [1, 5], "round_robin") == [0, 1] * 4
    assert owned(assign_experts(6, [1, 1, 1], "round_robin"), 2) == [2, 5]
    with pytest.raises(ValueError, match="unknown expert ownership 'stripes'"):
        assign_experts(8, [1, 1], "stripes")
    with pytest.raises(ValueError, match="would own none"):
        assign_experts(2, [1, 1, 1])
    with pytest.raises(ValueError, match="positive memory budget"):
        assign_experts(8, [1, 0])


def test_every_rank_owns_at_least_one_expert_whatever_the_budgets() -> None:
    for budgets in ([1, 1000], [0.001, 1, 1], [5, 5, 5, 5]):
        counts = proportional_counts(len(budgets) + 3, budgets)
        assert min(counts) >= 1 and sum(counts) == len(budgets) + 3


def test_start_up_lines() -> None:
    lines = describe_ownership(assign_experts(8, [1, 3]), [1, 3], "contiguous")
    assert lines == ["rank 0 (head, memory_gb=1): 2 of 8 experts per layer (0-1, contiguous)",
                     "rank 1 (worker, memory_gb=3): 6 of 8 experts per layer (2-7, contiguous)"]
    assert format_ids([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_the_first_differing_field_is_named() -> None:
    head = {"version": "a", "checkpoint": "c1", "config": "x", "numerics": "cpp-inv16"}
    assert first_mismatch(head, dict(head), 1) is None
    line = first_mismatch(head, {**head, "checkpoint": "c2", "numerics": "torch-var"}, 2)
    assert line is not None and "rank 2 refused: checkpoint differs" in line and "'c1'" in line and "'c2'" in line
    assert "\n" not in line
    index = [("a", "BF16", (2, 3), 12), ("b", "F32", (4,), 16)]
    assert tensor_index_digest(index) == tensor_index_digest(index[::-1])
    assert tensor_index_digest(index) != tensor_index_digest([("a", "BF16", (3, 2), 12), index[1]])


def test_addresses() -> None:
    assert parse_address("10.0.0.1:29600", "--ep-listen") == ("10.0.0.1", 29600)
    assert parse_address("[::1]:5", "--head") == ("::1", 5)
    with pytest.raises(ConfigError, match="--ep-listen '10.0.0.1': expected HOST:PORT"):
        parse_address("10.0.0.1", "--ep-listen")
    with pytest.raises(ConfigError, match="gloo has no authentication"):
        check_listen_address("0.0.0.0", any_interface=False)
    check_listen_address("0.0.0.0", any_interface=True)
    check_listen_address("127.0.0.1", any_interface=False)


def test_gloo_errors_are_cut_to_their_first_sentence() -> None:
    raw = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:41234. "
           "This is typically caused by a remote worker crashing. Check the logs of the remote worker")
    assert _short(raw) == "Connection closed by peer [10.0.0.2]:41234"
    assert _short("Application timeout caused pair closure") == "Application timeout caused pair closure"


def test_plan_prints_each_ranks_share_from_config_json_alone(capsys: pytest.CaptureFixture[str]) -> None:
    from moeserve.cli import main

    config = str(Path(__file__).resolve().parents[1] / "data" / "reference_configs" / "Qwen3-235B-A22B.json")
    assert main(["plan", config, "--ep-budgets", "20,60,60"]) == 0
    out = capsys.readouterr().out
    ranks = re.findall(r"^rank (\d) \((head|worker), memory_gb=(\d+)\): (\d+) of (\d+) experts per layer .*: "
                       r"([\d.]+) GiB of experts", out, re.M)
    assert [r[:3] for r in ranks] == [("0", "head", "20"), ("1", "worker", "60"), ("2", "worker", "60")]
    counts = [int(r[3]) for r in ranks]
    assert sum(counts) == int(ranks[0][4]) and counts[1] == counts[2] > counts[0]
    assert "exchange per token per MoE layer" in out
    assert main(["plan", config, "--ep-budgets", "20"]) == 1
    assert "--ep-budgets '20': expected two or more" in capsys.readouterr().err
