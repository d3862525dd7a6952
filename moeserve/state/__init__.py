"""Per-sequence state kept between engine steps (the KV cache today; recurrent and latent states later).

It sits below `models/` (layers read and write it) and `engine/` (the scheduler hands out its slots): both
import it, it imports neither.
"""
