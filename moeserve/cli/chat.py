"""`moeserve chat MODEL`: an interactive conversation, tokens printed as they are generated.

Sampling starts from the model's generation_config.json (engine/sampling_defaults.py), flags over it, and is printed
at start; /help, /reset, /set, /show, /exit are answered here (cli/chat_loop.py); Ctrl-C stops a reply.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from moeserve.cli.common import (
    add_engine_arguments,
    add_model_argument,
    add_sampling_arguments,
    engine_settings,
)
from moeserve.engine.sampling_defaults import GENERATION_CONFIG_FILE, ChosenSampling, choose_sampling

# flags whose value, when given, wins over the model's recommendation (unset: None)
_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat interactively with a model (/help lists the commands)",
                       description="Chat with MODEL. Sampling: the model's generation_config.json, flags over it "
                       "(--temperature 0 for greedy). /help lists the commands; Ctrl-C stops a reply.")
    add_model_argument(p)
    p.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(p)
    # unset sampling flags leave the model's recommendation in place
    p.set_defaults(func=run, **{name: None for name in _SAMPLING_FLAGS})
    add_engine_arguments(p)


@contextmanager
def quiet_choices() -> Iterator[None]:
    """A conversation starts in a few lines: while the engine starts, the per-choice start-up lines (the logger
    engine/startup_log.py names CHOICES_LOG) show only at --log-level debug; the summary and sampling lines remain.
    The logger's level is restored after (an in-process caller's later engines log their choices)."""
    choices = logging.getLogger("moeserve.choices")
    before = choices.level
    if choices.getEffectiveLevel() > logging.DEBUG:
        choices.setLevel(logging.WARNING)
    try:
        yield
    finally:
        choices.setLevel(before)


def run(args: argparse.Namespace) -> int:
    from moeserve.errors import ConfigError, RequestError

    if args.logprobs is not None:
        raise ConfigError("chat does not print log-probabilities: use generate --logprobs N")
    settings = engine_settings(args)  # checked before torch is imported
    from moeserve.cli.chat_loop import ChatLoop
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams

    with quiet_choices():
        llm = LLM(**settings.model_dump())
    engine, tok = llm.engine, llm.engine.tokenizer
    if tok is None:
        raise RequestError("chat needs a tokenizer (skip_tokenizer_init was set)")
    chosen, sampling = session_sampling(args, engine.checkpoint.generation_config, GENERATION_CONFIG_FILE)

    def make_params(**values: object) -> SamplingParams:
        return SamplingParams(**values)  # type: ignore[arg-type]

    make_params(**sampling)  # a bad flag or recommendation: one line now, not at the first message
    interactive = sys.stdin.isatty()
    print(f"sampling: {chosen.describe()}" + ("; /help lists the commands, Ctrl-C stops a reply" if interactive
                                             else ""), file=sys.stderr)
    if interactive:
        import readline  # noqa: F401 - line editing and history for input()
    return ChatLoop(engine, tok, make_params, sampling, args.system, interactive=interactive).run()


def session_sampling(args: argparse.Namespace, generation_config: dict[str, Any], file: str
                     ) -> tuple[ChosenSampling, dict[str, Any]]:
    """(the sampling chosen from the model's file and the flags, the SamplingParams keywords the chat starts
    with: those, no max_tokens unless chosen, and --seed / --stop / --ignore-eos when given)."""
    chosen = choose_sampling(generation_config, {n: getattr(args, n) for n in _SAMPLING_FLAGS}, file)
    fixed = {"seed": args.seed, "stop": args.stop, "ignore_eos": args.ignore_eos}
    given = {k: v for k, v in fixed.items() if v is not None and v is not False}  # --seed 0 is a seed
    return chosen, {"max_tokens": None, **chosen.values, **given}
