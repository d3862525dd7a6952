"""The loop of `moeserve chat`: read a line, run a command locally or stream the model's reply.

It drives any engine with `add_request(ids, params) -> id`, `step() -> outputs`, `abort_request(id)` and
`has_unfinished_requests()` (LLMEngine, or a fake in tests), and a tokenizer with `apply_chat_template` and
`encode`. Lines that start with "/" are commands and never reach the model; an unknown one is answered here with
the closest command. Ctrl-C during a reply stops that reply after the current engine step (the request is aborted
and its KV blocks freed; the words shown so far stay in the conversation) and returns to the prompt; Ctrl-C at the
prompt, Ctrl-D, or /exit ends the chat.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from moeserve.config import did_you_mean
from moeserve.errors import RequestError

USER_PROMPT = "user> "
ASSISTANT_PROMPT = "assistant> "
STOPPED = "[stopped]"  # printed after a reply cut by Ctrl-C

HELP = """commands (never sent to the model):
  /help                 this list
  /reset                forget the conversation (the system message stays)
  /set NAME VALUE       change a setting for the next replies: temperature, top_p, top_k, min_p,
                        repetition_penalty, max_tokens ("none": to the end of the context), seed, system (text)
  /show                 the settings in use
  /exit                 leave (also /quit, Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C during a reply stops it and returns here. Start a message with a space to send text beginning with "/"."""

# /set NAME -> how its text becomes a value (None: "none" clears it)
_SETTERS: dict[str, Callable[[str], Any]] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
    "max_tokens": lambda text: None if text.lower() == "none" else int(text),
    "seed": lambda text: None if text.lower() == "none" else int(text),
}
COMMANDS = ("/help", "/reset", "/set", "/show", "/exit", "/quit")


class ChatLoop:
    """One conversation. `make_params(**values)` builds the engine's SamplingParams (it validates them)."""

    def __init__(self, engine: Any, tokenizer: Any, make_params: Callable[..., Any], sampling: dict[str, Any],
                 system: str | None = None, read: Callable[[str], str] = input, out: TextIO | None = None,
                 interactive: bool = True) -> None:
        self.engine, self.tokenizer, self.make_params = engine, tokenizer, make_params
        self.sampling = dict(sampling)
        self.system = system
        self.history: list[dict[str, str]] = []
        self.read = read
        self.out = out if out is not None else sys.stdout
        self.interactive = interactive
        self._interrupted = False

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Until /exit, Ctrl-D or Ctrl-C at the prompt. Returns the exit status (0)."""
        while True:
            try:
                line = self.read(USER_PROMPT if self.interactive else "")
            except (EOFError, KeyboardInterrupt):
                if self.interactive:
                    self.out.write("\n")
                return 0
            if line.startswith("/"):
                if not self.command(line.strip()):
                    return 0
            elif line.strip():
                self.turn(line)

    def command(self, line: str) -> bool:
        """Run a /command; False when it ends the chat."""
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.say(HELP)
        elif name == "/reset":
            self.history.clear()
            self.say("conversation cleared")
        elif name == "/show":
            self.say(self.describe())
        elif name == "/set":
            self.set(rest.strip())
        else:
            self.say(f"unknown command {name}{did_you_mean(name, list(COMMANDS))}; /help lists the commands")
        return True

    def set(self, text: str) -> None:
        name, _, value = text.partition(" ")
        value = value.strip()
        if name == "system":
            self.system = value or None
            self.say(f"system message {'set' if value else 'removed'}")
            return
        if name not in _SETTERS:
            self.say(f"cannot set '{name}'{did_you_mean(name, [*_SETTERS, 'system'])}; /help lists the settings")
            return
        try:
            parsed = _SETTERS[name](value)
            self.make_params(**{**self.sampling, name: parsed})  # validated as a request would be
        except ValueError:
            self.say(f"/set {name}: '{value}' is not a number")
            return
        except RequestError as err:
            self.say(f"/set {name}: {err}")
            return
        self.sampling[name] = parsed
        self.say(f"{name} = {parsed}")

    def describe(self) -> str:
        values = ", ".join(f"{k} {v}" for k, v in self.sampling.items()) or "greedy"
        return f"sampling: {values}; system message: {self.system!r}; {len(self.history)} messages so far"

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # ------------------------------------------------------------------------------------------ one reply
    def turn(self, line: str) -> None:
        """Send the user's line with the conversation so far; stream the reply; keep both in the history."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.history
        messages.append({"role": "user", "content": line})
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        try:
            request_id = self.engine.add_request(self.tokenizer.encode(prompt, add_special_tokens=False),
                                                 self.make_params(**self.sampling))
        except RequestError as err:  # too long for the context, a bad setting: the chat goes on
            self.say(f"error: {err} (/reset starts a new conversation)")
            return
        if self.interactive:
            self.out.write(ASSISTANT_PROMPT)
        text, ended = self._stream(request_id)
        if ended == "failed":  # said already; the turn is forgotten, so it can be sent again
            return
        self.out.write(f"\n{STOPPED}\n" if ended == "stopped" else "\n")
        self.out.flush()
        self.history += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]

    def _stream(self, request_id: str) -> tuple[str, str]:
        """(the reply's text, how it ended: "done", "stopped" by Ctrl-C, or "failed"). SIGINT only sets a flag while
        the engine steps, so a step is never cut in the middle; a second Ctrl-C before the step ends quits."""
        text = ""
        self._interrupted = False
        installed, previous = self._catch_sigint()
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    if out.error is not None:  # e.g. an expert that cannot be read: this reply ends, the chat goes on
                        self.say(f"\nerror: {out.error}")
                        return text, "failed"
                    new = out.outputs[0].text
                    self.out.write(new[len(text):])  # the delta, as soon as it is safe to show
                    self.out.flush()
                    text = new
                if self._interrupted:
                    self.engine.abort_request(request_id)
                    return text, "stopped"
        finally:
            if installed:
                signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        return text, "done"

    def _catch_sigint(self) -> tuple[bool, Any]:
        """Install the reply's SIGINT handler (main thread only): (installed, the previous handler)."""
        if threading.current_thread() is not threading.main_thread():
            return False, None

        def on_sigint(signum: int, frame: Any) -> None:
            if self._interrupted:
                raise KeyboardInterrupt
            self._interrupted = True

        return True, signal.signal(signal.SIGINT, on_sigint)
