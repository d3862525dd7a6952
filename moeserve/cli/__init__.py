"""`moeserve` command line: one module per subcommand, each with ``register(subparsers)``.

A subcommand module defines ``register(sub: argparse._SubParsersAction) -> None`` which adds its parser and
sets ``func=run`` (``run(args) -> int``). Errors that are `MoeserveError` print one line and exit 1;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
import traceback
from typing import Any

from moeserve.errors import MoeserveError

# Subcommand modules, in the order `moeserve --help` lists them. A module that fails to import (an optional
# dependency missing) must not take the whole CLI down, so each is imported on its own.
SUBCOMMANDS = [
    "serve",
    "generate",
    "chat",
    "inspect",
    "plan",
    "bench",
    "simulate",
    "trace",
    "build_kernels",
    "ep_worker",
]


def _version() -> str:
    """moeserve's version and torch's (its local tag says the build: +cpu, +cu128, ...)."""
    from importlib.metadata import PackageNotFoundError, version

    from moeserve import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"moeserve {__version__} (torch {torch_version})"


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_ENV = "MOESERVE_LOG_LEVEL"


def _add_log_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --debug, on the top-level command and on every subcommand (`moeserve serve --log-level
    warning` as vLLM spells it). A subcommand's copies default to SUPPRESS so they never overwrite a value given
    before the subcommand's name."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower, default=default,
                        help=f"log level (env {LOG_LEVEL_ENV}; default info)")
    parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="show tracebacks of errors, and debug logs")


def log_level(args: argparse.Namespace) -> int:
    """The logging level: --debug, else --log-level, else MOESERVE_LOG_LEVEL, else INFO. A bad MOESERVE_LOG_LEVEL
    is a ConfigError with a "did you mean"."""
    from moeserve.config import did_you_mean
    from moeserve.errors import ConfigError

    if getattr(args, "debug", False):
        return logging.DEBUG
    name = getattr(args, "log_level", None) or os.environ.get(LOG_LEVEL_ENV, "info").lower()
    if name not in LOG_LEVELS:
        raise ConfigError(f"{LOG_LEVEL_ENV}={name} is not a log level{did_you_mean(name, list(LOG_LEVELS))}")
    return int(getattr(logging, name.upper()))


class _StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that never accepts an abbreviated flag, and names the closest choice of a bad one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # `moeserve serv`, `--kernels cppp`: "invalid choice: 'serv' (did you mean 'serve'?)"
        if action.choices is not None and value not in action.choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1, cutoff=0.6)
            if close:
                raise argparse.ArgumentError(action, f"invalid choice: {value!r} (did you mean {close[0]!r}?)")
        super()._check_value(action, value)  # type: ignore[misc]


def _chosen_modules(argv: list[str] | None) -> list[str]:
    """The subcommand modules to import: only the named command's when argv names one (so `serve` with a bad setting
    fails before torch is imported by another subcommand's module), else all (for --help, or to list the choices)."""
    named = {name.replace("_", "-"): name for name in SUBCOMMANDS}
    first = next((a for a in argv or () if a in named), None)
    return [named[first]] if first is not None else SUBCOMMANDS


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line parser; with `argv`, only the subcommand it names is imported and registered."""
    parser = _StrictParser(
        prog="moeserve",
        description="Serve Mixture-of-Experts models larger than memory (OpenAI-compatible).",
    )
    _add_log_flags(parser, top=True)
    parser.add_argument("--version", action="version", version=_version(),
                        help="print moeserve's version and torch's, then exit")
    # No abbreviated flags: `--expert-cache 0.005` must not silently mean --expert-cache-gb (nor stop meaning it
    # the day another flag shares the prefix).
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=_StrictParser)
    for name in _chosen_modules(argv):
        try:
            module = importlib.import_module(f"moeserve.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"moeserve.cli.{name}":
                continue  # subcommand not built yet
            raise
        module.register(sub)
    for command in _nested_parsers(parser):
        _add_log_flags(command, top=False)
    return parser


def _nested_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every (sub)command parser under `parser`, at any depth (`moeserve bench offload`, `moeserve trace convert`)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found += [command, *_nested_parsers(command)]
    return found


def _refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit with argparse's error for arguments nobody took, naming the closest flag of the chosen subcommand."""
    while True:  # down to the (sub)command that was chosen: its flags are the ones that could have been meant
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None:
            break
        parser = subs[0].choices[chosen]
    message = f"unrecognized arguments: {' '.join(unknown)}"
    flag = next((a.split("=", 1)[0] for a in unknown if a.startswith("--")), None)
    if flag is not None:
        close = difflib.get_close_matches(flag, list(parser._option_string_actions), n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]}?)"
    parser.error(message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args, unknown)
    debug = bool(getattr(args, "debug", False))
    try:
        level = log_level(args)
    except MoeserveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except MoeserveError as err:
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
