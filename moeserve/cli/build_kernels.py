"""`moeserve build-kernels`: build (or find cached) the C++ CPU kernels now, so the first `serve` does not.

`make setup` runs it. The build is announced before it starts, with each compiled source as it finishes
(moeserve/kernels). Exit 0 when the kernels are ready; 1 with the reason when they cannot be built (the engine then
runs torch's ops under kernels=auto, and refuses kernels=cpp).
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-kernels", help="build the C++ CPU kernels now (cached; make setup runs this)",
                       description="Build moeserve's C++ CPU kernels with g++ (CXX names another compiler) into "
                       "the cache (~/.cache/moeserve/kernels, or $XDG_CACHE_HOME/moeserve/kernels), or find them "
                       "there. The engine does the same on first use; doing it now keeps it out of serve's start-up.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeserve import kernels

    status = kernels.load()
    if not status.available:
        print(f"error: C++ kernels not built: {status.reason} (the engine will run torch's ops; kernels=cpp will "
              "refuse to start)", file=sys.stderr)
        return 1
    print(f"C++ kernels ready: {status.reason}")
    return 0
