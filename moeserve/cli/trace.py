"""`moeserve trace ACTION`: routing traces (docs/trace-format.md): convert between formats, shuffle a trace's steps
(a permutation test of locality), record a model's decode traces."""

from __future__ import annotations

import argparse
from pathlib import Path

from moeserve.bench.traces import INPUT_FORMATS, OUTPUT_FORMATS, convert

# Prompts of `trace record`: openings in the style of the demo model's corpus (Jane Austen's novels)
PROMPTS = [
    "Once upon a time", "It is a truth universally acknowledged, that", "Mr. Darcy walked into the room and",
    "The letter from Bath arrived", "Emma could not help thinking", "Her sister said nothing, but",
    "The ball at Netherfield", "Captain Wentworth", "When the carriage stopped at the door,",
    "Lady Catherine was", "In the morning the weather", "Anne Elliot had been",
    "Colonel Brandon", "Marianne played the pianoforte", "A single man of large fortune", "The garden at Pemberley",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="convert, shuffle and record routing traces",
        description="Routing traces (which experts each token used in each MoE layer): the engine's binary "
        "trace (record_trace), the JSON-lines interchange format and FLAME-MoE CSV folders. See docs/trace-format.md.",
    )
    actions = p.add_subparsers(dest="trace_command", metavar="ACTION", parser_class=type(p))
    _register_convert(actions)
    _register_shuffle(actions)
    _register_record(actions)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _register_convert(actions: argparse._SubParsersAction) -> None:
    c = actions.add_parser(
        "convert",
        help="convert a trace to another format (JSON lines by default)",
        description="Read IN (any trace format, detected from its content unless --from is given), validate it, "
        "and write it to OUT as --to.",
    )
    c.add_argument("source", metavar="IN", help="trace file or FLAME-MoE Layer_N/ folder")
    c.add_argument("dest", metavar="OUT", help="file to write (a new folder for --to flame)")
    c.add_argument("--from", dest="source_format", choices=INPUT_FORMATS, default="auto",
                   help="format of IN (default: detected from its content)")
    c.add_argument("--to", dest="format", choices=OUTPUT_FORMATS, default="jsonl", help="format of OUT")
    c.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    trace, written = convert(args.source, args.dest, args.format, args.source_format)
    for note in trace.notes:
        print(note)
    h = trace.header
    print(
        f"{args.source} ({trace.fmt}) -> {args.dest} ({args.format}): {written} steps, {len(h.moe_layers)} MoE layers "
        f"x {h.num_experts} experts, top-{h.top_k}"
    )
    return 0


def _register_shuffle(actions: argparse._SubParsersAction) -> None:
    s = actions.add_parser(
        "shuffle",
        help="write copies of a trace with its steps permuted (a permutation test of temporal locality)",
        description="Write OUT/original.jsonl and OUT/seed<N>.jsonl: the trace's steps (forward passes) permuted "
        "at random within the fitting part and within the evaluated part separately (`moeserve simulate`'s split, "
        "--warmup-fraction), each step kept whole (every layer's choices of its tokens travel together). The "
        "evaluated multiset of steps is unchanged, so frequency-based bounds are identical; only temporal order is "
        "destroyed. Run `moeserve simulate` on the original and on each copy and compare.",
    )
    s.add_argument("source", metavar="TRACE", help="any trace moeserve reads (FLAME folder, .jsonl, moetrace)")
    s.add_argument("--out", type=Path, required=True, help="folder for original.jsonl and seed<N>.jsonl")
    s.add_argument("--seeds", default="1,2,3", help="comma-separated shuffle seeds (default 1,2,3)")
    s.add_argument("--warmup-fraction", type=float, default=0.5, help="the simulator's split (default 0.5)")
    s.set_defaults(func=run_shuffle)


def run_shuffle(args: argparse.Namespace) -> int:
    from moeserve.bench.traces import load_trace, shuffled, write_trace
    from moeserve.errors import ConfigError

    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as err:
        raise ConfigError(f"--seeds {args.seeds!r}: expected comma-separated integers") from err
    if not seeds or not 0 <= args.warmup_fraction < 1:
        raise ConfigError("give at least one --seeds value and a --warmup-fraction in [0, 1)")
    trace = load_trace(args.source)
    steps = list(trace.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    write_trace(args.out / "original.jsonl", trace.header, steps, "jsonl")
    for seed in seeds:
        path = args.out / f"seed{seed}.jsonl"
        n = write_trace(path, trace.header, shuffled(steps, args.warmup_fraction, seed), "jsonl")
        print(f"{path}: {n} steps, fitting and evaluated parts each permuted (seed {seed})")
    return 0


def _register_record(actions: argparse._SubParsersAction) -> None:
    r = actions.add_parser(
        "record",
        help="record decode routing traces of a model, at batch 1 and batched",
        description="Decode --prompts prompts with MODEL (default: the bundled demo model) and record its routing as "
        "JSON lines: OUT/batch1.jsonl with the prompts one after another, OUT/batchN.jsonl with N decoded together. "
        "Sampled at temperature 0.8 (seed 7), so each prompt's continuation differs.",
    )
    r.add_argument("--out", type=Path, required=True, help="folder for batch1.jsonl and batchN.jsonl")
    r.add_argument("--model", default=None, help="model folder with a tokenizer (default: the bundled demo model)")
    r.add_argument("--tokens", type=int, default=192, help="tokens generated per prompt (default 192)")
    r.add_argument("--prompts", type=int, default=12, help="prompts decoded (default 12)")
    r.add_argument("--batch", type=int, default=8, help="prompts decoded together in the batched trace (default 8)")
    r.set_defaults(func=run_record)


def run_record(args: argparse.Namespace) -> int:
    from moeserve import LLM, SamplingParams
    from moeserve.errors import ConfigError

    if min(args.tokens, args.prompts, args.batch) < 1:
        raise ConfigError("--tokens, --prompts and --batch must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = (PROMPTS * (1 + args.prompts // len(PROMPTS)))[: args.prompts]
    params = SamplingParams(temperature=0.8, max_tokens=args.tokens, ignore_eos=True, seed=7)
    for batch in (1, args.batch):
        path = args.out / f"batch{batch}.jsonl"
        llm = LLM(args.model, dtype="bfloat16", threads=1, max_num_seqs=batch, record_trace=str(path),
                  record_trace_format="jsonl")
        for start in range(0, len(prompts), batch):
            llm.generate(prompts[start : start + batch], params)
        llm.engine.close()
        print(f"{path}: {sum(1 for _ in path.open())} lines")
    return 0
