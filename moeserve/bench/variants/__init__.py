"""`moeserve bench VARIANT`: the benchmarks beside the main one (`moeserve bench` alone: moeserve against its peers
on a bench shape). One module per variant, each with ``register(sub)`` adding its parser with ``func=run``, as the
subcommands of `moeserve.cli` do; a variant's module imports torch and the engine only inside ``run``, so
`moeserve bench --help` stays fast. Every variant prints its figures; none asserts a speed.
"""

from __future__ import annotations

import argparse

from moeserve.errors import ConfigError

# Module names, in the order `moeserve bench --help` lists them; the command line spells "_" as "-".
VARIANTS = (
    "offload",
    "serve",
    "route_trace",
    "sequence_memory",
    "prefix_recurrent",
    "batch_invariance",
    "structured",
    "checksum",
    "commits",
)


def add_parser(sub: argparse._SubParsersAction, name: str, doc: str | None) -> argparse.ArgumentParser:
    """The variant's parser: its help is the first line of the module docstring `doc`, its description all of it."""
    text = (doc or "").strip()
    return sub.add_parser(name, help=text.splitlines()[0] if text else None, description=text,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_repeats_flag(parser: argparse.ArgumentParser, default: int) -> None:
    """--repeats, as every variant that alternates configurations spells it (as `moeserve bench` does)."""
    parser.add_argument("--repeats", type=int, default=default,
                        help=f"timed runs of each configuration, alternated (default {default})")


def require_positive(**flags: float) -> None:
    """A ConfigError naming the first flag (keyword: its name, `_` for `-`) whose value is not positive."""
    for name, value in flags.items():
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive (got {value:g})")
