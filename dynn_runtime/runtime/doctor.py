"""``dynn doctor``: which hook path (native or stock) is active, and why."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from ..native import NativeFeatures, Preference, active_path, pinned_release, probe

__all__ = ["add_commands", "doctor_report"]


def doctor_report(
    device: str = "cuda",
    *,
    prefer: Preference = Preference.AUTO,
    probe_fn: Callable[[], NativeFeatures] = probe,
    cuda_available: bool | None = None,
) -> dict:
    """Everything `dynn doctor` prints, as data (tests call this with a fake probe)."""
    import torch

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    feats, choice = active_path(device, prefer=prefer, probe_fn=probe_fn, cuda_available=cuda_available)
    pin = pinned_release()
    from .events import native_module, native_reason, resolve

    events, events_why = resolve("auto")
    from .providers import select_provider

    provider = select_provider(device, events, events_why, probe_fn=lambda: feats, cuda_available=cuda_available)
    return {
        "hook_provider": provider.name,
        "hook_provider_why": provider.reason,
        "hook_delivers": {v.value: how for v, how in provider.delivers.items()},
        "event_source": events,
        "event_source_why": events_why,
        "native_events_built": native_module() is not None,
        "native_events": native_reason(),
        "cuda_deaths": _cuda_deaths(native_module()),
        "copy_engine": _copy_engine(native_module()),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda_available,
        "device_name": torch.cuda.get_device_name(0) if cuda_available else None,
        "patched": feats.available,
        "series": feats.series,
        "features": sorted(feats.features),
        "probe": feats.reason,
        "device": device,
        "path": choice.path.value,
        "why": choice.reason,
        "pinned_release": pin,
        "matches_pin": bool(pin) and torch.__version__.split("+")[0] == pin.get("version"),
    }


def _cuda_deaths(module) -> str:
    """How the native observer learns that a CUDA storage died (csrc/events.cpp, invariant 9)."""
    if module is None:
        return "-- (the native event source is not built)"
    if getattr(module, "HEAR_CUDA", False):
        return ("heard from the caching allocator's trace tracker (csrc/heard.h), where a probe at start "
                "is heard; else swept for")
    return ("swept for: this build cannot hear the caching allocator (torch without CUDA, or CUDA's headers "
            "not found when it was built; CMakeLists.txt)")


def _copy_engine(module) -> str:
    """Which engine issues a CUDA manager's copies (runtime/copies.py)."""
    from .manager import MemoryManager

    if not MemoryManager.copies_in_c:
        return "Python (CudaCopies; MemoryManager.copies_in_c is off)"
    if module is None or not hasattr(module, "CopyEngine"):
        return "Python (CudaCopies: the native extension is not built)"
    if not MemoryManager.raw_copies:
        copies = "each copy a Tensor.copy_ (MemoryManager.raw_copies is off)"
    elif getattr(module, "RAW_CUDA_COPIES", False):
        copies = "each copy one cudaMemcpyAsync (csrc/copies_cuda.h, MemoryManager.raw_copies)"
    else:
        copies = ("each copy a Tensor.copy_ (no raw copy here: torch without CUDA, CUDA's headers not found at "
                  "the build, or torch's CUDA runtime not found; CMakeLists.txt)")
    return f"C++ (csrc/copies.cpp, MemoryManager.copies_in_c); {copies}"


def _cmd_doctor(args: argparse.Namespace) -> int:
    prefer = Preference.REQUIRE_NATIVE if args.require_native else Preference.AUTO
    report = doctor_report(args.device, prefer=prefer)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    pin = report["pinned_release"]
    rows = [
        ("torch", f"{report['torch']} (git {report['torch_git']}, CUDA {report['torch_cuda']})"),
        ("CUDA available", "yes" if report["cuda_available"] else "no"),
        ("device", report["device_name"] or "-"),
        ("patched torch", f"yes, series {report['series']}" if report["patched"] else "no"),
        ("probe", report["probe"]),
        ("event source", f"{report['event_source']} ({report['event_source_why']})"),
        ("native events", report["native_events"]),
        ("CUDA deaths", report["cuda_deaths"]),
        ("copy engine", report["copy_engine"]),
        ("hook path", f"{report['path']} (for {report['device']})"),
        ("why", report["why"]),
        ("hook provider", f"{report['hook_provider']} ({report['hook_provider_why']})"),
        *((f"  {verb}", how) for verb, how in report["hook_delivers"].items()),
        ("pinned release", f"{pin['version']} ({pin['tag']} @ {pin['commit'][:12]})" if pin else "unknown "
                           "(not a source checkout)"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    if not report["patched"]:
        print("\nTo use the native hooks, build the patched wheel: python build_tools/build_wheel.py "
              "(docs/artifact-evaluation.md).")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="say whether the native (patched PyTorch) hooks are active, and why",
        description="Probe torch for the DyNN-Offload patch series and report which hook path the "
                    "runtime uses (native or stock) and why.",
    )
    p.add_argument("--device", default="cuda", help="device the runtime would run on (default cuda)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--require-native", action="store_true",
                   help="fail (exit 2) unless the native path can be used")
    p.set_defaults(func=_cmd_doctor)
