"""`moeserve ep-worker MODEL --head HOST:PORT --memory-gb G [engine settings]`: an expert worker of expert
parallelism (docs/expert-parallel.md). It joins the head (`moeserve serve --ep-listen HOST:PORT --ep-workers N`),
owns the share of every MoE layer's experts the head assigns it (in proportion to its memory_gb), holds them in its
own expert store within memory_gb (offloading to disk beyond), and computes them for the head's layer calls until the
head stops. Under torchrun, --head defaults to MASTER_ADDR:MASTER_PORT."""

from __future__ import annotations

import argparse
import os

from moeserve.cli.common import add_engine_arguments, add_model_argument, engine_settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ep-worker", help="serve a share of a model's experts to a head (expert parallelism)")
    add_model_argument(p)
    p.add_argument("--head", default=None, help="the head's --ep-listen address, HOST:PORT (default under torchrun: "
                   "MASTER_ADDR:MASTER_PORT)")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def torchrun_head(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """MASTER_ADDR:MASTER_PORT when torchrun's variables are set, else None."""
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else None


def run(args: argparse.Namespace) -> int:
    from moeserve.engine.ep import run_worker
    from moeserve.errors import ConfigError

    head = args.head or torchrun_head(os.environ)
    if head is None:
        raise ConfigError("moeserve ep-worker needs --head HOST:PORT (the head's --ep-listen address)")
    return run_worker(engine_settings(args), head)
