"""`moeserve trace convert IN OUT`: routing traces from one format to another (docs/trace-format.md)."""

from __future__ import annotations

import argparse

from moeserve.bench.traces import INPUT_FORMATS, OUTPUT_FORMATS, convert


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="convert routing traces between formats",
        description="Routing traces (which experts each token used in each MoE layer): the engine's binary "
        "trace (record_trace), the JSON-lines interchange format and FLAME-MoE CSV folders. See docs/trace-format.md.",
    )
    actions = p.add_subparsers(dest="trace_command", metavar="ACTION", parser_class=type(p))
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
    p.set_defaults(func=lambda args: p.print_help() or 2)


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
