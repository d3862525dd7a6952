"""Unified memory detected from three pieces of evidence, each alone enough, with an override; fakes of each case
(a device-properties object with name, is_integrated and total_memory, as torch's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeserve.config import EngineSettings, build_settings
from moeserve.memory.topology import Machine, decide_unified, detect_topology, known_integrated

GiB = 2**30
CUDA = torch.device("cuda")


def gpu(name: str, integrated: int = 0, total_gib: float = 16.0) -> SimpleNamespace:
    return SimpleNamespace(name=name, is_integrated=integrated, total_memory=int(total_gib * GiB))


def machine(props: SimpleNamespace, host_total_gib: float = 64.0, host_free_gib: float = 50.0,
            gpu_free_gib: float | None = 15.0) -> Machine:
    free = None if gpu_free_gib is None else int(gpu_free_gib * GiB)
    return Machine(int(host_total_gib * GiB), int(host_free_gib * GiB), props, free)


def test_is_integrated_alone_is_enough():
    t = detect_topology(CUDA, "auto", machine(gpu("Some Future SoC", integrated=1, total_gib=8)))
    assert t.unified and t.fast_free_bytes == t.host_free_bytes == 50 * GiB
    assert "unified memory, one budget, no host tier (auto: is_integrated=1; not a known" in t.reason


@pytest.mark.parametrize("name,family", [
    ("NVIDIA GB10", "GB10 / DGX Spark"), ("NVIDIA DGX Spark", "GB10 / DGX Spark"), ("Orin", "Jetson"),
    ("NVIDIA Jetson AGX Orin", "Jetson"), ("NVIDIA Thor", "Jetson"), ("Xavier", "Jetson"),
    ("AMD Radeon Graphics", "AMD APU"), ("AMD Radeon 780M", "AMD APU"), ("AMD Radeon 8060S Graphics", "AMD APU"),
    ("AMD Instinct MI300A", "AMD APU"),
])
def test_a_known_integrated_device_reporting_is_integrated_0_is_unified(name, family):
    """The case the issue feared: a GB10 (or any known integrated device) whose is_integrated bit reads 0."""
    t = detect_topology(CUDA, "auto", machine(gpu(name, integrated=0, total_gib=8)))
    assert t.unified, t.reason
    assert f"is_integrated=0; a known integrated device ({family})" in t.reason
    assert t.fast_free_bytes == 50 * GiB  # MemAvailable: cudaMemGetInfo misses the page cache there


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 5080", "NVIDIA H100 80GB HBM3", "AMD Radeon RX 7900 XTX",
                                  "AMD Radeon PRO W7900", "AMD Instinct MI300X", "NVIDIA GH200 480GB"])
def test_discrete_names_are_not_known_integrated(name):
    assert known_integrated(name) is None


def test_device_memory_close_to_memtotal_is_unified():
    """An unknown name, is_integrated=0, but the device reports 121.7 GiB on a host whose MemTotal is 121.7 GiB
    (what a GB10 reports): unified; its fast tier is bounded by the smaller free figure."""
    t = detect_topology(CUDA, "auto", machine(gpu("NVIDIA Next", 0, 121.7), host_total_gib=121.7, host_free_gib=100,
                                              gpu_free_gib=90))
    assert t.unified and "device memory 121.7 GiB = 100% of MemTotal 121.7 GiB (close)" in t.reason
    assert t.fast_free_bytes == 90 * GiB


def test_a_discrete_card_is_discrete_with_all_its_evidence():
    t = detect_topology(CUDA, "auto", machine(gpu("NVIDIA GeForce RTX 5080", 0, 15.5)))
    assert not t.unified and t.fast_free_bytes == 15 * GiB and t.host_free_bytes == 50 * GiB
    assert t.reason == ("NVIDIA GeForce RTX 5080: discrete, fast tier = GPU memory, then host RAM, then disk (auto: "
                        "is_integrated=0; not a known integrated device; device memory 15.5 GiB = 24% of MemTotal "
                        "64.0 GiB)")


def test_the_window_around_memtotal():
    for ratio, close in ((0.89, False), (0.9, True), (1.05, True), (1.06, False)):
        unified, _ = decide_unified("auto", gpu("X", 0, 100 * ratio), 100 * GiB)
        assert unified == close, ratio


def test_the_override_wins_and_says_what_detection_said():
    gb10 = machine(gpu("NVIDIA GB10", 0, 121.7), host_total_gib=121.7)
    off = detect_topology(CUDA, "off", gb10)
    assert not off.unified and "unified_memory=off, set; detection said unified: is_integrated=0" in off.reason
    h100 = machine(gpu("NVIDIA H100", 0, 79.2), host_total_gib=512, host_free_gib=400, gpu_free_gib=78)
    on = detect_topology(CUDA, "on", h100)
    assert on.unified and "unified_memory=on, set; detection said discrete" in on.reason
    assert on.fast_free_bytes == 78 * GiB  # a discrete card forced unified: never beyond its own free memory
    assert "as detected" in detect_topology(CUDA, "on", gb10).reason


def test_cpu_ignores_the_setting_and_says_so():
    m = Machine(64 * GiB, 40 * GiB)
    assert detect_topology(torch.device("cpu"), "auto", m).reason == "CPU: the fast tier is RAM, the slow tier disk"
    t = detect_topology(torch.device("cpu"), "on", m)
    assert not t.unified and t.fast_free_bytes == 40 * GiB and "unified_memory=on has no effect on CPU" in t.reason


def test_the_setting_comes_from_keywords_env_and_flags():
    assert build_settings(EngineSettings, {}, {}).unified_memory == "auto"
    assert build_settings(EngineSettings, {}, {"MOESERVE_UNIFIED_MEMORY": "off"}).unified_memory == "off"
    assert build_settings(EngineSettings, {"unified_memory": "on"}, {"MOESERVE_UNIFIED_MEMORY": "off"}
                          ).unified_memory == "on"
    with pytest.raises(Exception, match="unified_memory"):
        build_settings(EngineSettings, {"unified_memory": "maybe"}, {})
    from moeserve.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "x", "--unified-memory", "maybe"])
