"""``dynn idioms``: print, look up, export and check the idiom vectors."""

from __future__ import annotations

import argparse
import csv
import io
import sys

__all__ = ["add_commands", "export_csv"]


def export_csv(vectors: dict | None = None) -> str:
    """CSV text ``operator,i0,...,i5``, one row per base name, sorted by name."""
    from . import all_vectors

    vecs = all_vectors() if vectors is None else vectors
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["operator", *(f"i{i}" for i in range(6))])
    for name in sorted(vecs):
        w.writerow([name, *vecs[name].as_tuple()])
    return buf.getvalue()


def _row(name: str, v) -> str:
    return f"{name:<48} {' '.join(str(x) for x in v.as_tuple())}  {v.source}"


def _cmd_idioms(args: argparse.Namespace) -> int:
    from . import IDIOM_NAMES, agreement, all_vectors, idiom_vector

    if args.op:
        v = idiom_vector(args.op)
        print(_row(args.op, v))
        for name, value in zip(IDIOM_NAMES, v.as_tuple(), strict=True):
            print(f"  {name:<12} {value}")
        print(f"  rule         {v.source}")
        return 0
    if args.agreement:
        print(agreement().format())
        return 0
    if args.export:
        text = export_csv()
        if args.output in (None, "-"):
            sys.stdout.write(text)
        else:
            with open(args.output, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
            print(f"wrote {text.count(chr(10)) - 1} operators to {args.output}")
        return 0
    vecs = all_vectors()
    print(f"{'operator':<48} {' '.join(f'i{i}' for i in range(6))}  rule")
    print(f"{'':<48} ({', '.join(f'i{i}={n}' for i, n in enumerate(IDIOM_NAMES))})")
    for name in sorted(vecs):
        print(_row(name, vecs[name]))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add the ``idioms`` subcommand to the ``dynn`` command line."""
    p = sub.add_parser(
        "idioms",
        help="memory-access idiom vectors of PyTorch operators",
        description=(
            "Print the six memory-access idiom values (transpose, accumulate, indirect, reduction, "
            "elementwise, window) of every ATen operator with the rule that produced them; look one "
            "up, export them as CSV, or compare them with the DyNN-Offload paper's Table V."
        ),
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--op",
        metavar="NAME",
        help="one operator: 'convolution', 'aten::add_', 'add_.Tensor', 'relu.default'",
    )
    mode.add_argument("--export", choices=["csv"], help="write operator,i0,...,i5 for every operator")
    mode.add_argument(
        "--agreement",
        action="store_true",
        help="compare with the paper's Table V (exact, per position, mismatches)",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="with --export: file to write (default stdout)")
    p.set_defaults(func=_cmd_idioms)
