"""The hybrid placement on a CUDA machine (scripts/gpu_acceptance.sh, its hybrid section; docs/design/gpu.md).

1. bits: one expert computed by the GPU side (CanonicalExperts, torch ops on CUDA) and by the CPU's C++ op, equal
   bit for bit: bf16 and int8 units ([out, in], as a CUDA store holds them), 1 and 8 tokens, the `--shape`'s
   dimensions (4-bit and gpt-oss units: checked on the CPU by tests/engine/test_hybrid.py; here only bf16, int8).
2. runs: the bench's synthetic checkpoint of `--shape` on CUDA with `memory_gb` a fraction of its size (a GPU that
   holds a small share of the experts, as a 16 GB card holds ~16% of gpt-oss-120b's) and a host tier of them all,
   placement=hybrid: decode b1, decode b8, prefill 512. Beside each run the ceilings are probed (HBM, PCIe H2D, host
   DRAM read: memory/probes.py) and each path's achieved bytes/s (experts computed there x unit bytes / seconds)
   is printed as a fraction of its ceiling; peak GPU memory <= memory_gb.
3. exact: the same requests under placement=cpu (misses on the CPU) give the same logits as under hybrid, every step.

`--device cpu` runs step 1 only, on the CPU (the GPU side's torch code on CPU tensors): a smoke test of the script.
Prints one line per figure and a last line "hybrid check: PASS" or "hybrid check: FAIL (...)"; exit status 0 / 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

GiB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="small", help="bench shape (moeserve bench --help)")
    p.add_argument("--memory-fraction", type=float, default=0.35, help="memory_gb as a fraction of the model's bytes")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--decode-tokens", type=int, default=8)
    return p.parse_args(argv)


def bit_checks(shape: Any, device: Any) -> list[str]:
    """Failures of the CPU- vs GPU-computed expert comparison (printing each case)."""
    import torch

    from moeserve import kernels
    from moeserve.models.experts.canonical import CanonicalExperts
    from moeserve.models.experts.kernels import CppSwiGLU, RoutedTokens, TorchExperts
    from moeserve.models.experts.unit_math import FusedUnits, SwiGLUMath
    from moeserve.models.numerics import Numerics

    status = kernels.load("native")
    if not status.available:
        return [f"the C++ ops are not available ({status.reason})"]
    h, i = shape.hidden_size, shape.moe_intermediate_size
    gen = torch.Generator().manual_seed(0)
    failures = []
    for int8 in (False, True):
        if int8:
            unit = (torch.randint(-127, 128, (2 * i, h), generator=gen, dtype=torch.int8), torch.rand(2 * i) * 0.01,
                    torch.randint(-127, 128, (h, i), generator=gen, dtype=torch.int8), torch.rand(h) * 0.01)
            units = FusedUnits(False, 0, 1, 2, 3)
        else:
            unit = ((torch.randn(2 * i, h, generator=gen) * 0.05).bfloat16(),
                    (torch.randn(h, i, generator=gen) * 0.05).bfloat16())
            units = FusedUnits(False)
        for tokens in (1, 8):
            x = torch.randn(tokens, h, generator=gen).bfloat16()
            routed = RoutedTokens.from_counts(x, torch.zeros(tokens, 1, dtype=torch.long), torch.arange(tokens),
                                              torch.rand(tokens, generator=gen).bfloat16(), [tokens])
            cpu = CppSwiGLU(units, TorchExperts(SwiGLUMath(), Numerics(cpp=True, batch_invariant=True)))
            want = torch.zeros_like(x)
            cpu.run(want, routed, [[(0, unit)]])
            on_dev = RoutedTokens(x.to(device), routed.ids, routed.token_of.to(device), routed.weight_of.to(device),
                                  routed.spans)
            got = torch.zeros_like(on_dev.x)
            CanonicalExperts(SwiGLUMath(), units).run(got, on_dev, [[(0, tuple(t.to(device) for t in unit))]])
            same = torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
            label = f"{'int8' if int8 else 'bf16'} unit [{2 * i}x{h}, {h}x{i}], {tokens} token(s)"
            print(f"bits {label}: CPU (C++ op) vs {device.type} (canonical kernel) {'equal' if same else 'DIFFER'}")
            if not same:
                failures.append(f"{label} differs")
    print("bits mxfp4 / nvfp4 / gpt-oss units: not checked on this device by this script (tests/engine/test_hybrid.py "
          "checks them on the CPU)")
    return failures


def ceilings(device: Any) -> dict[str, float]:
    from moeserve.memory.device import CudaOps
    from moeserve.memory.probes import device_read_bandwidth, host_to_device_bandwidth, memory_bandwidth

    return {"hbm": device_read_bandwidth(device), "pcie_h2d": host_to_device_bandwidth(CudaOps(device), device)
            .bytes_per_s, "host_dram": memory_bandwidth(256 * 2**20, 3)}


def timed_case(llm: Any, prompts: list, params: Any, device: Any) -> tuple[float, Any, Any, list]:
    """(seconds, placement stats before, after, logits of each step)."""
    import torch

    model = llm.engine.model
    forward, logits = model.forward, []

    def capture(batch: Any, kv: Any) -> Any:
        out = forward(batch, kv)
        logits.append(out.clone())
        return out

    before = model.moe_blocks[0].experts.snapshot()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    model.forward = capture
    try:
        llm.generate(prompts, params)
    finally:
        model.forward = forward
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0, before, model.moe_blocks[0].experts.snapshot(), logits


CASES = {  # name -> (requests, prompt tokens, new tokens); decode cases' prompts are short
    "decode b1": (1, 16, None),
    "decode b8": (8, 16, None),
    "prefill 512": (1, 512, 1),
}


def runs(shape: Any, folder: Any, memory_gb: float, decode_tokens: int, device: Any) -> list[str]:
    import torch

    from moeserve import LLM, SamplingParams

    failures, logits_of = [], {}
    for placement in ("hybrid", "cpu"):
        torch.cuda.reset_peak_memory_stats()
        llm = LLM(str(folder), skip_tokenizer_init=True, device="cuda", memory_gb=memory_gb, placement=placement)
        print(f"placement={placement}: {dict(llm.engine.model.choices)['placement']}")
        unit = llm.engine.model.store.unit_nbytes
        for case, (requests, prompt_len, new) in CASES.items():
            prompts = [{"prompt_token_ids": [(7 * r + 3 * t) % shape.vocab_size for t in range(prompt_len)]}
                       for r in range(requests)]
            params = SamplingParams(temperature=0, max_tokens=new or decode_tokens, ignore_eos=True)
            ceiling = ceilings(device) if placement == "hybrid" else {}
            seconds, a, b, logits = timed_case(llm, prompts, params, device)
            logits_of[(placement, case)] = [t.cpu() for t in logits]
            tokens = requests * (prompt_len if new == 1 else params.max_tokens)
            paths = {"hbm": (b.gpu_hits - a.gpu_hits + b.copied - a.copied) * unit,
                     "pcie_h2d": (b.copied - a.copied) * unit, "host_dram": (b.cpu - a.cpu) * unit}
            fractions = ", ".join(f"{k} {v / seconds / ceiling[k]:.2f} of {ceiling[k] / 1e9:.1f} GB/s"
                                  for k, v in paths.items()) if ceiling else ""
            print(f"{placement:6} {case:12} {tokens / seconds:9.1f} tok/s  experts gpu_hit {b.gpu_hits - a.gpu_hits}"
                  f" copied {b.copied - a.copied} cpu {b.cpu - a.cpu}  {fractions}")
        peak = torch.cuda.max_memory_reserved()
        print(f"placement={placement}: peak GPU memory (reserved) {peak / GiB:.3f} GiB of memory_gb {memory_gb:g}")
        if peak > memory_gb * GiB:
            failures.append(f"placement={placement}: GPU peak {peak / GiB:.3f} GiB > memory_gb {memory_gb:g}")
        llm.engine.close()
    for case in CASES:
        same = all(torch.equal(x, y) for x, y in zip(logits_of[("hybrid", case)], logits_of[("cpu", case)],
                                                     strict=True))
        print(f"exact {case}: placement=hybrid and placement=cpu logits {'equal' if same else 'DIFFER'}")
        if not same:
            failures.append(f"{case}: hybrid and cpu placements differ")
    return failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from moeserve.bench.shapes import get_shape
    from moeserve.bench.synth import ensure_checkpoint

    if args.device == "cuda" and not torch.cuda.is_available():
        print("hybrid check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    shape = get_shape(args.shape)
    failures = bit_checks(shape, device)
    if args.device == "cuda":
        folder = ensure_checkpoint(shape)
        model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        memory_gb = round(args.memory_fraction * model_bytes / GiB, 3)
        print(f"model {folder.name}: {model_bytes / GiB:.2f} GiB on disk; memory_gb={memory_gb:g}; "
              f"{torch.cuda.get_device_name()}")
        failures += runs(shape, folder, memory_gb, args.decode_tokens, device)
    print("hybrid check: " + ("PASS" if not failures else f"FAIL ({'; '.join(failures)})"))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
