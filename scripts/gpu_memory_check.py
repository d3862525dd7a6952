"""Peak GPU and host memory while loading and serving a model larger than the GPU budget (scripts/gpu_acceptance.sh).

The bench's synthetic checkpoint of `--shape` (small: ~1.8 GB bf16) is loaded on CUDA with `memory_gb` below its
size (`--memory-fraction` of it, or `--memory-gb`), so "larger than the GPU" holds on any GPU: the experts live in three tiers (GPU slots, a pinned host tier of
`--host-cache-gb`, the disk). It then serves `--requests` greedy requests of `--tokens` tokens in one batch and asserts:

- the store is offloaded, misses were read from the disk and hits served by the host tier;
- peak GPU memory (torch.cuda.max_memory_reserved: everything torch's allocator took from the device, activations
  included) <= memory_gb;
- peak host RSS minus the RSS before loading <= the host tier + the read and staging buffers the store reports +
  `--host-slack-gb` (the CUDA runtime's own host memory, Python objects, transient load buffers).

Prints one line per figure and a last line "memory check: PASS" or "memory check: FAIL (...)"; exit status 0 / 1.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

GiB = 2**30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="small", help="bench shape (moeserve bench --help)")
    p.add_argument("--memory-gb", type=float, default=None, help="the GPU budget (memory_gb); below the model's size")
    p.add_argument("--memory-fraction", type=float, default=0.8,
                   help="memory_gb as a fraction of the model's bytes on disk (when --memory-gb is not given)")
    p.add_argument("--host-cache-gb", type=float, default=0.75, help="the pinned host tier (host_cache_gb); big enough to hit under the synthetic uniform routing (0.25 = 85 of 512 experts served nothing on an H200)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--host-slack-gb", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from moeserve import LLM, SamplingParams
    from moeserve.bench.shapes import get_shape
    from moeserve.bench.synth import ensure_checkpoint
    from moeserve.errors import MoeserveError
    from moeserve.memory.chunks import staging_pinned_bytes

    if not torch.cuda.is_available():
        print("memory check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    shape = get_shape(args.shape)
    folder = ensure_checkpoint(shape)
    model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if args.memory_gb is None:
        args.memory_gb = round(args.memory_fraction * model_bytes / GiB, 3)
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    rss_before = rss_bytes()
    t0 = time.perf_counter()
    try:
        llm = LLM(str(folder), skip_tokenizer_init=True, device="cuda", memory_gb=args.memory_gb,
                  host_cache_gb=args.host_cache_gb)
    except MoeserveError as err:  # e.g. a budget too small for the resident weights: one line, not a traceback
        print(f"memory check: FAIL (the engine refused to start: {err})")
        return 1
    load_s = time.perf_counter() - t0
    store = llm.engine.model.store
    prompts = [{"prompt_token_ids": [(7 * r + 3 * i) % shape.vocab_size for i in range(16)]}
               for r in range(args.requests)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    torch.cuda.synchronize()
    serve_s = time.perf_counter() - t0
    gpu_peak = torch.cuda.max_memory_reserved()
    host_growth = peak_rss_bytes() - rss_before
    # the copier's pinned staging buffers as the host budget counts them (memory/chunks.staging_pinned_bytes)
    host_allowed = (store.host_nbytes + store.staging_nbytes + staging_pinned_bytes(store.unit_nbytes)
                    + int(args.host_slack_gb * GiB))
    stats = store.stats
    print(f"model {folder.name}: {model_bytes / GiB:.2f} GiB on disk; memory_gb={args.memory_gb:g}, "
          f"host_cache_gb={args.host_cache_gb:g}; {torch.cuda.get_device_name()}")
    print(f"store: {store.describe()}")
    print(f"load {load_s:.1f} s, serve {args.requests} x {args.tokens} tokens {serve_s:.1f} s; misses "
          f"{stats.misses}, from disk {stats.bytes_from_disk / GiB:.2f} GiB, from host {stats.bytes_from_host / GiB:.2f} GiB")
    print(f"peak GPU memory (reserved) {gpu_peak / GiB:.3f} GiB of {args.memory_gb:g} GiB allowed")
    print(f"peak host RSS growth {host_growth / GiB:.3f} GiB of {host_allowed / GiB:.3f} GiB allowed "
          f"(host tier {store.host_nbytes / GiB:.3f} GiB)")
    failures = []
    if model_bytes <= args.memory_gb * GiB:
        failures.append("the model fits the GPU budget: lower --memory-gb")
    if store.resident or stats.misses == 0:
        failures.append("the experts are not offloaded")
    if store.host_nbytes == 0 or stats.bytes_from_host == 0:
        failures.append("the host tier served nothing")
    if gpu_peak > args.memory_gb * GiB:
        failures.append(f"GPU peak {gpu_peak / GiB:.3f} GiB > memory_gb {args.memory_gb:g}")
    if host_growth > host_allowed:
        failures.append(f"host RSS grew {host_growth / GiB:.3f} GiB > {host_allowed / GiB:.3f} GiB")
    llm.engine.close()
    print("memory check: " + ("PASS" if not failures else f"FAIL ({'; '.join(failures)})"))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
