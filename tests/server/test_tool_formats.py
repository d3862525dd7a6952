"""The GLM-4.5 and DeepSeek-V3/R1 tool-call parsers, fed whole and split at every character (the same fields either
way, no piece of a tag ever shown as content), and the call grammars of every template format: random walks
through a grammar (tiny tokenizer, llguidance) give text that the format's own parser reads as a call whose
arguments validate against the tool's schema."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from moeserve.bench.checkpoints import write_tiny_tokenizer
from moeserve.engine.grammar import (
    GrammarCompiler,
    GrammarSpec,
    SpecialTags,
    lark_literal,
    with_special_tokens,
)
from moeserve.server.reasoning import ThinkTagSplitter
from moeserve.server.tool_parsers import (
    DeepSeekV3ToolParser,
    Glm45ToolParser,
    KimiK2ToolParser,
    Qwen3JsonToolParser,
    Qwen3XmlToolParser,
    ToolParser,
    tool_parser_for,
)
from moeserve.server.tool_parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP
from tests.server.test_tool_parsers import WEATHER, assert_no_tag_piece, run_tools, split_every_way

TEMPLATES = Path(__file__).parent / "templates"
GLM_TAGS = ("<tool_call>", "</tool_call>")
DEEPSEEK_TAGS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END)


GLM_OUTPUT = ('Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris <b> "q"\nx'
              '</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n'
              '<arg_value>{"t": "C"}</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>')


@pytest.mark.parametrize("chunks", split_every_way(GLM_OUTPUT))
def test_glm45_calls_any_split(chunks: list[str]) -> None:
    content, calls, streamed = run_tools(Glm45ToolParser([WEATHER]), chunks)
    assert content == "Let me check."
    assert calls[0][0] == "get_weather"
    assert json.loads(calls[0][1]) == {"city": 'Paris <b> "q"\nx', "days": 3, "units": {"t": "C"}}
    assert calls[1] == ["get_time", "{}"]
    assert_no_tag_piece(streamed, content, GLM_TAGS)


DEEPSEEK_OUTPUT = (f'Sure.{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_weather\n```json\n{{"city": "Paris {{x}} '
                   f'```", "days": [1, 2]}}\n```{CALL_END}\n{CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n{{}}\n'
                   f'```{CALL_END}{CALLS_END}')


@pytest.mark.parametrize("chunks", split_every_way(DEEPSEEK_OUTPUT))
def test_deepseek_v3_calls_any_split(chunks: list[str]) -> None:
    content, calls, streamed = run_tools(DeepSeekV3ToolParser([WEATHER]), chunks)
    assert content == "Sure."
    assert calls == {0: ["get_weather", '{"city": "Paris {x} ```", "days": [1, 2]}'], 1: ["get_time", "{}"]}
    assert_no_tag_piece(streamed, content, DEEPSEEK_TAGS)


def test_deepseek_v3_1_form_and_arguments_as_they_come() -> None:
    text = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{TOOL_SEP}{{"city": "Oslo"}}{CALL_END}{CALLS_END}'
    for chunks in split_every_way(text):
        content, calls, _ = run_tools(DeepSeekV3ToolParser([WEATHER]), chunks)
        assert content == "" and calls == {0: ["get_weather", '{"city": "Oslo"}']}
    parser = DeepSeekV3ToolParser([WEATHER])
    first = parser.feed(f'{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_weather\n```json\n{{"city": "Pa')
    assert [c.name for c in first.calls if c.name] == ["get_weather"]
    assert "".join(c.arguments for c in first.calls) == '{"city": "Pa'  # sent before the call ends
    assert [c.arguments for c in parser.feed('ris"}\n```').calls] == ['ris"}']


def test_cut_calls_and_non_calls() -> None:
    """A call cut by the end of the output keeps what arrived; a block without a name is content, tags and all."""
    content, calls, _ = run_tools(Glm45ToolParser([WEATHER]), ["<tool_call>get_weather\n<arg_key>city</arg_key>"
                                                               "<arg_value>Rome</arg_value>\n<arg_key>da"])
    assert content == "" and calls == {0: ["get_weather", '{"city": "Rome"}']}
    content, calls, _ = run_tools(DeepSeekV3ToolParser([WEATHER]), [f"a {CALL_BEGIN}no separator{CALL_END} b"])
    assert calls == {} and content == f"a {CALL_BEGIN}no separator{CALL_END} b"
    content, calls, _ = run_tools(DeepSeekV3ToolParser([WEATHER]), ["Plain text, no calls.  "])
    assert content == "Plain text, no calls.  " and calls == {}


def test_each_template_picks_its_format() -> None:
    picked = {name: tool_parser_for((TEMPLATES / name).read_text()) for name in
              ("qwen3.jinja", "qwen3_5.jinja", "glm4_5.jinja", "deepseek_r1.jinja", "deepseek_r1_tools.jinja")}
    assert picked == {"qwen3.jinja": Qwen3JsonToolParser, "qwen3_5.jinja": Qwen3XmlToolParser,
                      "glm4_5.jinja": Glm45ToolParser, "deepseek_r1.jinja": DeepSeekV3ToolParser,
                      "deepseek_r1_tools.jinja": DeepSeekV3ToolParser}


# ------------------------------------------------------------------------------------------- call grammars
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FORMATS = [Qwen3JsonToolParser, Qwen3XmlToolParser, Glm45ToolParser, DeepSeekV3ToolParser, KimiK2ToolParser]


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[GrammarCompiler, Any]:
    from tokenizers import Tokenizer

    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    return GrammarCompiler((folder / "tokenizer.json").read_text(), tok.get_vocab_size(), [eos]), tok


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("named", [None, "get_weather", "get_time"])
def test_call_grammar_gives_calls_that_follow_the_schema(compiler: tuple[GrammarCompiler, Any],
                                                         fmt: type[ToolParser], named: str | None) -> None:
    grammar = fmt.call_grammar(TOOLS, named)
    assert grammar is not None
    for seed in range(4):
        text = fmt.forced_prefix(named) + walk_after(*compiler, GrammarSpec("lark", grammar, "t"), "", seed)
        content, calls, _ = run_tools(fmt(TOOLS), [text])
        assert content == "" and len(calls) == 1, text
        name, arguments = calls[0]
        assert named is None or name == named
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ------------------------------------------------------------------------------- reasoning before the answer
def walk_after(compiler: GrammarCompiler, tok: Any, spec: GrammarSpec, forced: str, seed: int) -> str:
    """`forced` fed token by token (each must be allowed), then a random walk to the grammar's end: the text."""
    processor = compiler.compile(spec).new_processor({compiler.eos_token_ids[0]})
    ids = tok.encode(forced, add_special_tokens=False).ids
    for token in ids:
        assert processor.allowed()[token], f"{tok.decode([token])!r} refused in {forced!r}"  # type: ignore[attr-defined]
        processor.accept(token)
    rng = random.Random(seed)
    for _ in range(400):
        allowed = np.flatnonzero(processor.allowed())  # type: ignore[attr-defined]
        if processor.is_finished() or compiler.eos_token_ids[0] in allowed:
            return str(tok.decode(ids, skip_special_tokens=False))
        token = int(rng.choice(allowed))
        processor.accept(token)
        ids.append(token)
    raise AssertionError("the grammar did not end")


def split_reasoning(text: str, opened: bool) -> tuple[str, str]:
    splitter = ThinkTagSplitter(opened)
    parts = [splitter.feed(text), splitter.flush()]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


@pytest.mark.parametrize("reasoning", ["open", "optional"])
def test_reasoning_then_a_constrained_answer(compiler: tuple[GrammarCompiler, Any], reasoning: str) -> None:
    schema = SCHEMAS["get_weather"]
    thought = "The fox, <b> and </thin k>.\n" + ("</think>\n\n" if reasoning == "open" else "")
    forced = thought if reasoning == "open" else "<think>" + thought + "</think>\n\n"
    spec = GrammarSpec("json_schema", schema, "t", reasoning)  # type: ignore[arg-type]
    for seed in range(3):
        said, answer = split_reasoning(walk_after(*compiler, spec, forced, seed), reasoning == "open")
        assert said == "The fox, <b> and </thin k>."
        jsonschema.validate(json.loads(answer), schema)
    # no reasoning at all is allowed too when it is optional (the answer may start at once)
    if reasoning == "optional":
        jsonschema.validate(json.loads(walk_after(*compiler, spec, "{", 0)), schema)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_reasoning_then_a_forced_call(compiler: tuple[GrammarCompiler, Any], fmt: type[ToolParser]) -> None:
    """A forced call after free reasoning: the call's opening comes from the grammar, not from the prompt."""
    spec = GrammarSpec("lark", fmt.call_grammar(TOOLS, None), "tools", "open", prefix=fmt.forced_prefix(None))
    for seed in range(3):
        said, answer = split_reasoning(walk_after(*compiler, spec, "Need a tool.\n</think>\n\n", seed), True)
        content, calls, _ = run_tools(fmt(TOOLS), [answer])
        assert said == "Need a tool." and content == "" and len(calls) == 1, answer
        jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])


# ------------------------------------------------------------------- reasoning and calls together, any split
GLM_FULL = "\n<think>Two tools, <b>.</think>\nChecking.\n" + GLM_OUTPUT.removeprefix("Let me check.\n")
DEEPSEEK_FULL = "The weather.\n</think>\n\n" + DEEPSEEK_OUTPUT


@pytest.mark.parametrize("fmt, text, opened", [(Glm45ToolParser, GLM_FULL, False),
                                               (DeepSeekV3ToolParser, DEEPSEEK_FULL, True)], ids=["glm45", "deepseek"])
def test_reasoning_and_calls_any_split(fmt: type[ToolParser], text: str, opened: bool) -> None:
    """The chat output parser (<think> splitter, then the format's tool parser) gives the same fields whatever the
    pieces, and no piece of a tag reaches the reasoning or the content."""
    from moeserve.server.chat_format import _TemplateParser
    from moeserve.server.streaming import Delta

    def run(chunks: list[str]) -> tuple[str, str, list[tuple[int, str | None, str]], list[str]]:
        parser = _TemplateParser(ThinkTagSplitter(opened), fmt([WEATHER]), "")
        outs = [parser.feed(Delta(c, [], None, None, None)) for c in chunks] + [parser.flush()]
        pieces = [o.reasoning for o in outs] + [o.content for o in outs]
        calls = [(c.index, c.name, c.arguments) for o in outs for c in o.tool_calls]
        return "".join(o.reasoning for o in outs), "".join(o.content for o in outs), calls, pieces

    reasoning, content, calls, _ = run([text])
    assert reasoning in ("Two tools, <b>.", "The weather.") and content in ("Checking.", "Sure.")
    names = [name for _, name, _ in calls if name]
    assert names == ["get_weather", "get_time"]
    joined = {i: "".join(a for j, _, a in calls if j == i) for i in (0, 1)}
    for chunks in split_every_way(text)[1:]:
        r, c, got, pieces = run(chunks)
        assert (r, c) == (reasoning, content)
        assert [n for _, n, _ in got if n] == names
        assert {i: "".join(a for j, _, a in got if j == i) for i in (0, 1)} == joined
        assert_no_tag_piece(pieces, reasoning + content, ("<think>", "</think>", *fmt.tags))


# -------------------------------------------------------------------- tags that are special tokens
@pytest.fixture(scope="module")
def special_compiler(tmp_path_factory: pytest.TempPathFactory) -> tuple[GrammarCompiler, Any, SpecialTags]:
    """The tiny tokenizer with <think>, GLM's and DeepSeek's tags as special tokens (skip_special_tokens drops
    them), as some tokenizers register them."""
    from tokenizers import AddedToken, Tokenizer

    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("special"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tags = ["<think>", "</think>", *Glm45ToolParser.tags, *DeepSeekV3ToolParser.tags]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    specials = tuple((t, tok.token_to_id(t)) for t in tags)
    eos = tok.token_to_id("<|im_end|>")
    return GrammarCompiler(tok.to_str(), tok.get_vocab_size(), [eos]), tok, specials


@pytest.mark.parametrize("fmt", [Glm45ToolParser, DeepSeekV3ToolParser], ids=lambda f: f.name)
def test_call_grammars_match_special_token_tags_by_id(special_compiler: tuple[GrammarCompiler, Any, SpecialTags],
                                                      fmt: type[ToolParser]) -> None:
    compiler, tok, specials = special_compiler
    for named in (None, "get_weather"):
        grammar = with_special_tokens(fmt.call_grammar(TOOLS, named) or "", specials)
        for seed in range(3):  # seed 0: no reasoning allowed; else the walk starts with some
            spec = GrammarSpec("lark", grammar, "tools", "optional" if seed else None, prefix=fmt.forced_prefix(named),
                               special_tags=specials)
            forced = "<think>Tools.</think>\n" if seed else ""
            text = walk_after(compiler, tok, spec, forced, seed)
            said, answer = split_reasoning(text, False)
            content, calls, _ = run_tools(fmt(TOOLS), [answer])
            assert said == ("Tools." if seed else "") and content == "" and len(calls) == 1, text
            assert named is None or calls[0][0] == named
            jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])
            ids = tok.encode(text, add_special_tokens=False).ids
            assert set(ids) & {token_id for _, token_id in specials}, "the tags came as their special tokens"


def test_lark_literals_split_at_special_tags() -> None:
    specials = (("<tool_call>", 7), ("</arg_value>", 9))
    assert lark_literal("<tool_call>f\n", specials) == '<[7]> "f\\n"'
    assert lark_literal("", specials) == '""'
    lark = 'a[lazy]: /(?s:.{0,4})<\\/arg_value>\\n/\nb: "x</arg_value>" %json {"enum": ["</arg_value>"]}'
    assert with_special_tokens(lark, specials) == (
        'a: /(?s:.{0,4})/ <[9]> "\\n"\nb: "x" <[9]> %json {"enum": ["</arg_value>"]}')
