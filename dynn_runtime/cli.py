"""The ``dynn`` command line.

Each subsystem owns its subcommands: a module listed in ``_SUBSYSTEM_CLIS`` defines
``add_commands(subparsers)``, which adds parsers whose ``func(args) -> int`` runs the command.
Library code never prints; the CLI does, and turns :class:`DynnError` into a one-line message
and exit status 2 (no traceback from deep inside torch).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from .errors import DynnError
from .workload import add_workload_args, parse_overrides

# Subsystems that contribute subcommands (module path, each with add_commands(subparsers)).
_SUBSYSTEM_CLIS = (
    "dynn_runtime.demo",
    "dynn_runtime.idioms.cli",
    "dynn_runtime.trace.cli",
    "dynn_runtime.runtime.doctor",
    "dynn_runtime.bench.cli",
    "dynn_runtime.pilot.cli",
)


class CommandParser(argparse.ArgumentParser):
    """The parser class of every ``dynn`` command: an ArgumentParser whose subcommand may be left out.

    ``default_subcommand`` names the subcommand run when the first word is not one of its
    subcommands (nor an option), so ``dynn trace W -o F`` is ``dynn trace record W -o F`` while
    ``dynn trace --help`` still lists the subcommands.
    """

    def __init__(self, *args, default_subcommand: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.default_subcommand = default_subcommand

    def parse_known_args(self, args=None, namespace=None):
        if self.default_subcommand is not None:
            args = list(sys.argv[1:] if args is None else args)
            names = {n for a in self._actions if isinstance(a.choices, dict) for n in a.choices}
            if args and args[0] not in names and not args[0].startswith("-"):
                args.insert(0, self.default_subcommand)
        return super().parse_known_args(args, namespace)


def _cmd_models(args: argparse.Namespace) -> int:
    from . import models

    rows = [(f.name, ", ".join(f.presets), f.size_knob, f.description) for f in models.FAMILIES.values()]
    w = [max(len(r[i]) for r in rows + [("family", "presets", "size knob", "")]) for i in range(3)]
    print(f"{'family':<{w[0]}}  {'presets':<{w[1]}}  {'size knob':<{w[2]}}  description")
    for r in rows:
        print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}")
    if args.verbose:
        print()
        for f in models.FAMILIES.values():
            print(f"{f.name}: stands for {f.stands_for}; dynamic: {f.dynamic}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .memory import format_bytes
    from .workload import load_workload, train

    if args.budget is not None:  # under the memory manager
        from .runtime.cli import run_train

        return run_train(args, parse_overrides(args.set))
    wl = load_workload(args.workload, preset=args.preset, seed=args.seed, **parse_overrides(args.set))
    bar = tqdm(total=args.steps, desc=f"train {args.workload}", unit="step", disable=args.quiet, leave=False)

    def on_step(step: int, loss: float, peak: int) -> None:
        bar.update(1)
        bar.write(f"step {step:4d}  loss {loss:.6f}  peak {format_bytes(peak)}")

    res = train(wl, args.steps, device=args.device, seed=args.seed, on_step=on_step)
    bar.close()
    print(f"done: {args.steps} steps on {res.device}; final loss {res.losses[-1]:.6f}; "
          f"max peak {format_bytes(max(res.peak_bytes))} (bytes allocated above the step's start)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="dynn",
        description="dynn-runtime: train large dynamic neural networks on limited GPU memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("models", help="list the zoo of dynamic networks",
                       description="List the zoo families with their presets and size knob.")
    p.add_argument("-v", "--verbose", action="store_true", help="also say what is dynamic in each")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser(
        "train", help="train a workload and print per-step loss and peak memory",
        description=(
            "Train a workload: a zoo name (see `dynn models`) or path/to/file.py:function, where "
            "function(preset) returns an object with .model, .make_batch(step) and .loss(model, batch). "
            "With --budget, train under the memory manager (dynn_runtime.MemoryManager) and report what it "
            "moved, its peak against the budget, and whether the result is bit-identical to plain PyTorch."
        ),
    )
    add_workload_args(p)
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device (default cpu)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    from .runtime.cli import add_budget_args

    add_budget_args(p)
    p.set_defaults(func=_cmd_train)

    for modname in _SUBSYSTEM_CLIS:
        if importlib.util.find_spec(modname.rpartition(".")[0]) is None:
            continue  # subsystem not built yet
        if importlib.util.find_spec(modname) is None:
            continue
        importlib.import_module(modname).add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DynnError as exc:
        print(f"dynn: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dynn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dynn idioms | head`: the reader went away; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
