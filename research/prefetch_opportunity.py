"""How much of an offloaded decode's misses any router-based guess could have prefetched, and at what waste.

    .venv/bin/python research/prefetch_opportunity.py ~/.cache/moeserve/bench/large-bf16 [--expert-cache-gb 1.5]
        [--tokens 64] [--distances 1,2,4,8]

Decodes the bench's batch-1 prompt with moeserve (per-op steps, so every MoE block sees its input) and keeps each
MoE layer's input. Then it replays the routing through an expert cache of the bench's size with the store's own
policy (same calls as ExpertStore: per layer call, hits, then misses, the call's experts pinned), and asks, for
each lookahead distance d: had layer L's experts been guessed when layer L-d ran (layer L's router applied to
layer L-d's input, top-k: the guess prefetchers such as Pre-gated MoE make; d=1 is moeserve's `hint` predictor),
which of the guesses NOT cached at that moment would layer L then have used?

Printed per token, after a warm-up quarter: demand misses; misses caught (guessed uncached at L-d, used at L);
wrong uncached guesses (reads a prefetcher would add). A prefetch hides at most d layers of compute of a read,
so the gain it can bring is bounded by caught misses x min(read time, d x layer time) per token, and its wrong
reads compete with the demand misses for the disk.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.runner import make_prompts
from moeserve.experts.policies import NoVictimError, make_policy
from moeserve.models.experts.moe import MoEBlock


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--expert-cache-gb", type=float, default=1.5, help="the bench's default for 'large'")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps (a quarter of them warm the cache)")
    ap.add_argument("--distances", default="1,2,4,8", help="lookahead distances in MoE layers")
    ap.add_argument("--policy", default="lfru")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (the bench's decode-b1 uses 0 and up)")
    args = ap.parse_args()
    distances = [int(d) for d in args.distances.split(",")]

    llm = LLM(args.model, skip_tokenizer_init=True, max_model_len=256, expert_cache_gb=args.expert_cache_gb,
              decode_step="per_op")
    store = llm.engine.model.store
    blocks = [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, MoEBlock)]
    inputs: dict[int, list[torch.Tensor]] = {b.layer: [] for b in blocks}  # layer -> MoE input [N, H] per step
    original = MoEBlock.__call__

    def recording(self: MoEBlock, x: torch.Tensor) -> torch.Tensor:
        inputs[self.layer].append(x[-1:].clone())  # the last position: the token a decode step produces
        return original(self, x)

    MoEBlock.__call__ = recording  # type: ignore[method-assign]
    prompt = make_prompts(1, 32, llm.engine.model.spec.vocab_size, args.seed)[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                                                ignore_eos=True))
    MoEBlock.__call__ = original  # type: ignore[method-assign]

    with torch.no_grad():
        steps = len(inputs[blocks[0].layer])
        x = [torch.cat(inputs[b.layer]) for b in blocks]  # per MoE layer index: [steps, H]
        actual = [b.routing.route(x[i], b.routing.logits(b.router, x[i])).ids.tolist()  # [layer][step] -> top-k
                  for i, b in enumerate(blocks)]
        # [layer][step] -> the ids layer i's router picks on layer i-d's input (nothing for the first d layers)
        guesses = {d: [torch.topk(b.router(x[i - d]), b.spec.top_k, dim=-1).indices.tolist() if i >= d
                       else [[] for _ in range(steps)] for i, b in enumerate(blocks)] for d in distances}
    report(actual, guesses, store.capacity, args.policy, steps // 4, store.unit_nbytes)
    llm.engine.close()


def report(actual: Sequence[Sequence[Sequence[int]]], guesses: dict[int, list], capacity: int, policy: str,
           warmup: int, unit_nbytes: int) -> None:
    """Replay `actual` ([layer][step] -> expert ids) through a `capacity`-unit cache; score each distance's guesses
    ([layer][step] -> ids) against the cache as it was when the guess would have been made."""
    pol = make_policy(policy)
    cached: set[tuple[int, int]] = set()
    layers, steps = len(actual), len(actual[0])
    pending: dict[int, dict[tuple[int, int], set[int]]] = {d: {} for d in guesses}  # (step, layer) -> uncached guess
    misses, needed = 0, 0
    caught, wrong, recalled = dict.fromkeys(guesses, 0), dict.fromkeys(guesses, 0), dict.fromkeys(guesses, 0)
    for t in range(steps):
        for layer in range(layers):
            for d, g in guesses.items():  # what a prefetcher at this layer would read for layer + d
                if layer + d < layers:
                    pending[d][(t, layer + d)] = {e for e in g[layer + d][t] if (layer + d, e) not in cached}
            need = sorted(set(actual[layer][t]))
            counted = t >= warmup
            needed += len(need) if counted and layer >= max(guesses) else 0
            for d, g in guesses.items():
                if counted and layer >= max(guesses):  # layers every distance can guess
                    recalled[d] += len(set(g[layer][t]) & set(need))
                guess = pending[d].pop((t, layer), set())
                if counted:  # (a unit of this layer cannot have been loaded since: only this layer loads it)
                    caught[d] += len(guess & set(need))
                    wrong[d] += len(guess - set(need))
            pol.begin_layer(layer)
            keys = [(layer, e) for e in need]
            for key in keys:
                if key in cached:
                    pol.on_hit(key)
                    continue
                misses += counted
                if len(cached) >= capacity:
                    try:
                        victim = pol.choose_victim(set(keys))
                    except NoVictimError:
                        continue  # the layer needs more than the cache holds: read and drop (rare; not here)
                    cached.discard(victim)
                    pol.on_evict(victim)
                cached.add(key)
                pol.on_insert(key)
    n = steps - warmup
    mib = unit_nbytes / 2**20
    print(f"{steps} decode steps, {layers} MoE layers, cache {capacity} units of {mib:.1f} MiB, policy {policy}; "
          f"per token over the last {n}:")
    print(f"  demand misses {misses / n:.2f} ({misses / n * mib:.1f} MiB)")
    print(f"  recall of all the experts the guess could see (cached or not, layers >= {max(guesses)}): " +
          ", ".join(f"d={d} {recalled[d] / max(needed, 1):.0%}" for d in guesses))
    for d in guesses:
        share = caught[d] / misses if misses else 0.0
        print(f"  guess {d} layer(s) ahead: misses caught {caught[d] / n:.2f} ({share:.0%}), "
              f"wrong uncached guesses {wrong[d] / n:.2f} ({wrong[d] / n * mib:.1f} MiB of extra reads)")


if __name__ == "__main__":
    main()
