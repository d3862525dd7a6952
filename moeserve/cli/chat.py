"""`moeserve chat MODEL`: an interactive conversation, tokens printed as they are generated."""

from __future__ import annotations

import argparse
import sys

from moeserve.cli.common import (
    add_engine_arguments,
    add_model_argument,
    add_sampling_arguments,
    engine_settings,
    sampling_params,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat interactively with a model (type /exit to quit)")
    add_model_argument(p)
    p.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(p, max_tokens=256)
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeserve.engine.llm import LLM
    from moeserve.errors import RequestError

    llm = LLM(**engine_settings(args).model_dump())
    engine, tok = llm.engine, llm.engine.tokenizer
    if tok is None:
        raise RequestError("chat needs a tokenizer (skip_tokenizer_init was set)")
    params = sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("user> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(history, add_generation_prompt=True)
        engine.add_request(tok.encode(prompt, add_special_tokens=False), params)
        text = ""
        sys.stdout.write("assistant> " if interactive else "")
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = out.outputs[0].text
                sys.stdout.write(new[len(text):])  # stream the delta as soon as it is safe to show
                sys.stdout.flush()
                text = new
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": text})
    return 0
