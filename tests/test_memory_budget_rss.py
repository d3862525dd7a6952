"""memory_gb is a promise about the whole process: a child process serves a synthetic checkpoint 2.5x larger than
memory_gb (experts offloaded) with 8 concurrent requests of mixed lengths (one near the full context) and a KV pool
too small for all of them at once (so sequences are preempted and recomputed), and its peak RSS stays under
memory_gb. Every request finishes; the ones run again alone give the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MEMORY_GB = 0.9
CHILD = textwrap.dedent("""
    import json, sys
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams
    from moeserve.memory.rss import peak_rss_bytes
    llm = LLM(sys.argv[1], skip_tokenizer_init=True, memory_gb=float(sys.argv[2]), max_model_len=1024,
              max_num_batched_tokens=256, kv_cache_gb=0.012, enable_prefix_caching=False)
    lengths = [1000, 600, 300, 150, 80, 40, 20, 10]
    prompts = [[(i * 31 + j * 7) % 4000 + 2 for j in range(n)] for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    stats = llm.engine.sequence_memory_stats()
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts[-2:]]
    print(json.dumps(dict(peak=peak_rss_bytes(), together=together, alone=alone, preemptions=stats["preemptions"],
                          split=llm.engine.choices["memory budget"])))
""")


def test_peak_rss_stays_under_memory_gb_with_preemptions(synthetic_checkpoint: Path) -> None:
    folder = synthetic_checkpoint  # written once per session (conftest.py), shared with tests/test_offload_rss.py
    size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    assert size > 2.5 * MEMORY_GB * 2**30
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(MEMORY_GB)], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\npeak RSS {m['peak'] / 2**30:.3f} GiB of memory_gb={MEMORY_GB} (checkpoint {size / 2**30:.2f} GiB); "
          f"{m['preemptions']} preemptions; split: {m['split']}")
    assert m["peak"] <= MEMORY_GB * 2**30
    assert all(len(t) == 6 for t in m["together"]), "every request finishes"
    assert m["preemptions"] > 0, "the KV pool was meant to be too small for all eight at once"
    assert m["alone"] == m["together"][-2:], "the newest (preempted first) give their solo tokens"
