"""Pieces shared by the CLI subcommands: the model argument, engine flags, sampling flags."""

from __future__ import annotations

import argparse
from typing import Any

from moeserve.config import EngineSettings, add_cli_arguments, settings_from_args

# Engine flags every model-running subcommand takes. `model` is positional; `seed` is the sampling seed here.
ENGINE_FLAG_SKIP = ("model", "seed")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder or Hugging Face id in the local cache (default: the bundled demo model)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_cli_arguments(parser, EngineSettings, skip=ENGINE_FLAG_SKIP)


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--logprobs", type=int, default=None, help="print the top-k log-probabilities of each token")


def sampling_params(args: argparse.Namespace) -> Any:
    from moeserve.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


def engine_settings(args: argparse.Namespace, config_file_ok: bool = False) -> EngineSettings:
    """The engine settings of the flags, env and defaults, checked before anything loads (moeserve/preflight.py).
    `config_file_ok`: the model may be a config file (`plan`, which sizes a model from config.json alone)."""
    from moeserve.preflight import check_engine_settings

    settings: EngineSettings = settings_from_args(EngineSettings, args, model=args.model)
    check_engine_settings(settings, config_file_ok)
    return settings
