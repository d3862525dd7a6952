"""Imported by every Python process started with this folder on PYTHONPATH (tests/cpu_emulation: the AVX2
emulation): once `torch` is imported, oneDNN is turned off in it, as on an AVX2 CPU (no oneDNN bf16 there).
A finder on sys.meta_path wraps torch's loader (Python has no post-import hook); it costs nothing until torch loads."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _OneDnnOffWhenTorchLoads(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the MetaPathFinder protocol
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # so that the search below finds torch's own spec
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_turn_off(module):  # noqa: ANN001, ANN202
            exec_module(module)
            module.backends.mkldnn.enabled = False

        spec.loader.exec_module = exec_then_turn_off  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _OneDnnOffWhenTorchLoads())
