"""`moeserve chat`: sampling from generation_config.json, local /commands, Ctrl-C stopping a reply.

The loop runs on a scripted engine (each step adds one word; a reply ends at its max_tokens, or never) with real
SamplingParams; Ctrl-C is a real SIGINT sent to this process while the reply streams. One test runs the real
command on the bundled demo model in a pseudo-terminal."""

from __future__ import annotations

import io
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import pytest

from moeserve.cli.chat_loop import STOPPED, USER_PROMPT, ChatLoop
from moeserve.engine.sampling_defaults import CHAT_FALLBACK, choose_sampling, recommended_sampling
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import ConfigError

QWEN3_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}


# ---------------------------------------------------------------------------------------- sampling defaults
def test_the_models_recommendation_is_used_and_flags_win() -> None:
    chosen = choose_sampling(QWEN3_GENERATION_CONFIG, {"temperature": None, "top_k": 5})
    assert chosen.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 5}
    assert chosen.sources == {"temperature": "generation_config.json", "top_p": "generation_config.json",
                              "top_k": "flag"}
    assert chosen.describe() == "temperature 0.6, top_p 0.95 (generation_config.json), top_k 5 (flag)"
    SamplingParams(**chosen.values)  # SamplingParams' own names


def test_a_model_without_a_recommendation_gets_the_chat_fallback_said_as_such() -> None:
    # the demo model's file: do_sample false and max_new_tokens, as transformers writes it (do_sample is not read)
    chosen = choose_sampling({"do_sample": False, "max_new_tokens": 128, "eos_token_id": [0, 2]}, {})
    assert chosen.values == {**CHAT_FALLBACK, "max_tokens": 128}
    assert chosen.sources["max_tokens"] == "generation_config.json"
    assert "recommends no sampling" in chosen.sources["temperature"]
    assert choose_sampling({}, {"temperature": 0.0}).values == {**CHAT_FALLBACK, "temperature": 0.0}


def test_a_badly_typed_recommendation_is_one_line_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="generation_config.json: 'top_k' must be an integer, got 2.5"):
        recommended_sampling({"top_k": 2.5})
    with pytest.raises(ConfigError, match="'temperature' must be a number, got hot"):
        recommended_sampling({"temperature": "hot"})
    assert recommended_sampling({"top_k": 20.0, "repetition_penalty": 1}) == {"top_k": 20, "repetition_penalty": 1.0}


# ------------------------------------------------------------------------------------------ a scripted engine
@dataclass
class Sample:
    text: str


@dataclass
class Output:
    request_id: str
    outputs: list[Sample]
    finished: bool
    error: Exception | None = None


@dataclass
class ScriptedEngine:
    """One word per step per request; a request ends at max_tokens (None: never). `on_step(n)` runs inside step n."""

    on_step: Any = None
    requests: dict[str, list[Any]] = field(default_factory=dict)  # id -> [params, words]
    prompts: list[list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    steps: int = 0

    def add_request(self, ids: list[int], params: SamplingParams) -> str:
        request_id = str(len(self.prompts))
        self.prompts.append(ids)
        self.params.append(params)
        self.requests[request_id] = [params, 0]
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        del self.requests[request_id]

    def step(self) -> list[Output]:
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self.steps)
        outputs = []
        for request_id, entry in list(self.requests.items()):
            entry[1] += 1
            done = entry[0].max_tokens is not None and entry[1] >= entry[0].max_tokens
            outputs.append(Output(request_id, [Sample(" ".join(["word"] * entry[1]))], done))
            if done:
                del self.requests[request_id]
        return outputs


class ChatTokenizer:
    """Renders messages as `role: content` lines; encodes characters as their code points."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" * add_generation_prompt)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def rendered(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def chat(lines: list[str], engine: ScriptedEngine, **sampling: Any) -> tuple[ChatLoop, str, int]:
    """Run the loop on `lines` (then Ctrl-D); (the loop, what it printed, its exit status)."""
    feed = iter(lines)

    def read(prompt: str) -> str:
        out.write(prompt)
        line = next(feed, None)
        if line is None:
            raise EOFError
        return line

    out = io.StringIO()
    loop = ChatLoop(engine, ChatTokenizer(), SamplingParams, {"max_tokens": 3, **sampling}, read=read, out=out)
    status = loop.run()
    return loop, out.getvalue(), status


# ------------------------------------------------------------------------------------------------- commands
def test_commands_are_answered_locally_and_never_sent_to_the_model() -> None:
    engine = ScriptedEngine()
    _, out, status = chat(["/help", "/hepl", "/sett temperature 1", "/show", "/exit", "never read"], engine)
    assert status == 0 and engine.prompts == [] and engine.steps == 0
    assert "/set NAME VALUE" in out and "Ctrl-C during a reply stops it" in out  # /help
    assert "unknown command /hepl (did you mean '/help'?); /help lists the commands" in out
    assert "unknown command /sett (did you mean '/set'?)" in out
    assert "sampling: max_tokens 3; system message: None; 0 messages so far" in out


def test_set_changes_the_next_replies_and_refuses_bad_values() -> None:
    engine = ScriptedEngine()
    loop, out, _ = chat(["/set temperature 0.25", "/set top_p 2", "/set top_k many", "/set temprature 1",
                         "/set max_tokens 2", "/set system Be brief.", "Hi"], engine)
    assert "temperature = 0.25" in out
    assert "/set top_p: top_p must be in (0, 1], got 2.0" in out  # validated as a request is
    assert "/set top_k: 'many' is not a number" in out
    assert "cannot set 'temprature' (did you mean 'temperature'?)" in out
    params = engine.params[0]
    assert (params.temperature, params.top_p, params.max_tokens) == (0.25, 1.0, 2)
    assert rendered(engine.prompts[0]) == "system: Be brief.\nuser: Hi\nassistant:"
    assert loop.history == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word word"}]


def test_reset_forgets_the_conversation_and_keeps_the_system_message() -> None:
    engine = ScriptedEngine()
    _, out, _ = chat(["/set system S", "one", "two", "/reset", "three"], engine)
    assert rendered(engine.prompts[1]) == ("system: S\nuser: one\nassistant: word word word\nuser: two\n"
                                           "assistant:")
    assert rendered(engine.prompts[2]) == "system: S\nuser: three\nassistant:"
    assert "conversation cleared" in out
    assert out.count(USER_PROMPT) == 6  # one prompt per line read, and the last one answered by Ctrl-D


def test_ctrl_c_at_the_prompt_ends_the_chat() -> None:
    def read(prompt: str) -> str:
        raise KeyboardInterrupt

    engine = ScriptedEngine()
    assert ChatLoop(engine, ChatTokenizer(), SamplingParams, {}, read=read, out=io.StringIO()).run() == 0


def test_sigint_during_a_reply_stops_it_and_the_next_turn_works() -> None:
    """A real SIGINT arrives while the first reply streams (an endless one: max_tokens none): the reply stops after
    that step, its request is aborted, the prompt comes back, and the next message gets its whole reply."""
    engine = ScriptedEngine(on_step=lambda n: os.kill(os.getpid(), signal.SIGINT) if n == 3 else None)
    before = signal.getsignal(signal.SIGINT)
    loop, out, status = chat(["tell me everything", "/set max_tokens 2", "and now?"], engine, max_tokens=None)
    assert status == 0 and engine.aborted == ["0"]
    first, second = out.split(STOPPED)
    assert first.endswith("word word word\n")  # three steps shown, then the stop
    assert second.startswith(f"\n{USER_PROMPT}")  # the prompt came back
    assert "word word\n" in second and engine.params[1].max_tokens == 2
    assert not engine.requests  # the second reply ran to its end
    assert loop.history[1] == {"role": "assistant", "content": "word word word"}  # what was shown stays
    assert loop.history[3] == {"role": "assistant", "content": "word word"}
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C at the prompt quits again


def test_a_refused_turn_or_a_failed_reply_leaves_the_chat_going() -> None:
    """A prompt the engine refuses (too long for the context) and a reply that fails mid-way (an expert that cannot
    be read) are said in one line each; neither enters the history, and the next turn is answered."""
    from moeserve.errors import ExpertLoadError, RequestError

    class Refusing(ScriptedEngine):
        def add_request(self, ids: list[int], params: SamplingParams) -> str:
            if "long" in rendered(ids):
                raise RequestError("This model's maximum context length is 512 tokens", param="prompt")
            return super().add_request(ids, params)

        def step(self) -> list[Output]:
            outputs = super().step()
            if len(self.prompts) == 1:  # the first accepted reply fails
                outputs = [Output(o.request_id, o.outputs, True, ExpertLoadError("expert 3 of layer 1 unreadable"))
                           for o in outputs]
                self.requests.clear()
            return outputs

    engine = Refusing()
    loop, out, status = chat(["a long one", "fails", "works"], engine)
    assert status == 0
    assert "error: This model's maximum context length is 512 tokens (/reset starts a new conversation)" in out
    assert "error: expert 3 of layer 1 unreadable" in out
    assert rendered(engine.prompts[1]) == "user: works\nassistant:"
    assert loop.history[-1] == {"role": "assistant", "content": "word word word"}


# ------------------------------------------------------------------------------------ the real command, in a pty
class Terminal:
    """A child process on a pseudo-terminal (stdin and stdout are a tty, as for a person); `expect` reads until a
    text appears, and fails loudly when the child exits first or nothing comes for `timeout` seconds."""

    def __init__(self, argv: list[str]) -> None:
        import pty
        import subprocess

        master, slave = pty.openpty()
        self.master = master
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=subprocess.PIPE, close_fds=True)
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = 300.0) -> str:
        """Everything printed up to and including `text` since the last expect."""
        import select

        while text not in self.seen:
            ready, _, _ = select.select([self.master], [], [], timeout)
            if not ready:
                raise AssertionError(f"no {text!r} within {timeout} s of silence; the terminal shows {self.seen!r}")
            try:
                chunk = os.read(self.master, 4096).decode(errors="replace")
            except OSError:  # the child closed the terminal
                chunk = ""
            if not chunk:
                raise AssertionError(f"the chat exited before printing {text!r}: {self.seen!r}; stderr "
                                     f"{self.proc.stderr.read().decode() if self.proc.stderr else ''}")
            self.seen += chunk
        head, _, self.seen = self.seen.partition(text)
        return head + text

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())


def test_the_real_chat_stops_a_reply_on_sigint_and_goes_on() -> None:
    """`moeserve chat` on the bundled demo model in a pty: the sampling line names its source; /help stays local;
    SIGINT while the first (endless) reply streams prints [stopped] and the prompt; /set then a second turn is
    answered; /exit ends with status 0."""
    import sys

    term = Terminal([sys.executable, "-m", "moeserve", "chat", "--ignore-eos", "--max-tokens", "100000",
                     "--log-level", "warning"])
    try:
        term.expect(USER_PROMPT)
        term.send("/hlp")
        assert "did you mean '/help'?" in term.expect(USER_PROMPT)
        term.send("Tell me a long story.")
        term.expect("assistant> ")
        term.expect(" ")  # the reply is streaming
        term.proc.send_signal(signal.SIGINT)
        term.expect(STOPPED)
        term.expect(USER_PROMPT)
        term.send("/set max_tokens 3")
        assert "max_tokens = 3" in term.expect(USER_PROMPT)
        term.send("Go on.")
        term.expect("assistant> ")
        assert STOPPED not in term.expect(USER_PROMPT)  # the second reply ended by itself
        term.send("/exit")
        assert term.proc.wait(timeout=60) == 0
        err = term.proc.stderr.read().decode() if term.proc.stderr else ""
        assert "sampling: temperature 0.8, top_p 0.95, top_k 40, min_p 0.05 (moeserve's chat default" in err and "max_tokens 100000 (flag)" in err
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.master)


def test_the_session_starts_with_the_chosen_sampling_and_the_given_flags() -> None:
    import argparse

    from moeserve.cli.chat import session_sampling

    flags = dict(temperature=None, top_p=None, top_k=None, min_p=None, repetition_penalty=None, max_tokens=None)
    args = argparse.Namespace(**flags, seed=0, stop=["\n\n"], ignore_eos=False)
    chosen, sampling = session_sampling(args, QWEN3_GENERATION_CONFIG, "generation_config.json")
    assert sampling == {"max_tokens": None, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "seed": 0,
                        "stop": ["\n\n"]}  # seed 0 kept, ignore_eos False left out
    SamplingParams(**sampling)
    args = argparse.Namespace(**{**flags, "max_tokens": 7}, seed=None, stop=None, ignore_eos=True)
    assert session_sampling(args, {}, "g.json")[1] == {**CHAT_FALLBACK, "max_tokens": 7, "ignore_eos": True}
