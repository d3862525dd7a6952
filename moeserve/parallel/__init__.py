"""Expert parallelism across processes: which rank owns which experts (`ownership.py`, pure), the link between the
head and its expert workers over torch.distributed's gloo backend (`link.py`), and what the ranks compare before
they serve (`identity.py`). The MoE layer's side is models/experts/remote.py; the worker's loop engine/ep.py
(docs/expert-parallel.md)."""
