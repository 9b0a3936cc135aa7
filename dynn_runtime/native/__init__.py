"""Native fetch hooks: detect a patched PyTorch and choose the hook path.

A torch built with ``build_tools/build_wheel.py`` carries the DyNN-Offload patch
series (``patches/``) and answers the feature probe ``torch._C._dynn_features()``.
The live runtime then uses the native hooks (reclaim on out-of-memory inside the
CUDA caching allocator, prefetch driven by the autograd engine); with a stock
torch it falls back to the stock hooks (``saved_tensors_hooks`` plus proactive
eviction). ``dynn doctor`` prints which path is active and why.

Example (with a fake probe, as tests do)::

    >>> feats = NativeFeatures(available=True, series="dynn-hooks-1", features=frozenset(REQUIRED_FEATURES),
    ...                        reclaim_protocol=1, engine_protocol=1, reason="patched")
    >>> select_path(feats, "cuda", cuda_available=True).path
    <HookPath.NATIVE: 'native'>
    >>> select_path(feats, "cpu").path
    <HookPath.STOCK: 'stock'>
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .._log import logger
from ..errors import NativeError
from .protocol import EngineHooks, Handle, ReclaimRegistry, ReclaimRequest, SavedTensorIndex

__all__ = [
    "NativeFeatures",
    "HookPath",
    "Preference",
    "PathChoice",
    "REQUIRED_FEATURES",
    "SUPPORTED_PROTOCOL",
    "probe",
    "select_path",
    "active_path",
    "pinned_release",
    "NativeHooks",
    "ReclaimRegistry",
    "ReclaimRequest",
    "EngineHooks",
    "SavedTensorIndex",
    "Handle",
]

#: Features the native path needs (names as reported by the probe).
REQUIRED_FEATURES = frozenset({"reclaim_hook", "alloc_observers", "fetch_hook", "lookahead_hook", "sequence_nr"})
#: Protocol versions this runtime speaks (patches/new_files/.../DynnReclaim.h, dynn_engine_core.h).
SUPPORTED_PROTOCOL = 1

_PIN_FILE = Path(__file__).resolve().parents[2] / "patches" / "PYTORCH_PIN"


@dataclass(frozen=True, kw_only=True, slots=True)
class NativeFeatures:
    """What the feature probe found."""

    available: bool
    """True when torch carries the patch series."""
    series: str | None = None
    """Patch-series id reported by the build (e.g. ``dynn-hooks-1``)."""
    features: frozenset[str] = frozenset()
    reclaim_protocol: int | None = None
    engine_protocol: int | None = None
    torch_version: str | None = None
    reason: str = ""
    """Why the probe concluded what it did."""


class HookPath(enum.Enum):
    NATIVE = "native"
    """Hooks inside the patched allocator and engine."""
    STOCK = "stock"
    """Stock torch: saved_tensors_hooks and proactive eviction only."""


class Preference(enum.Enum):
    AUTO = "auto"
    """Native when possible, else stock."""
    STOCK = "stock"
    """Stock even on a patched torch (for comparisons)."""
    REQUIRE_NATIVE = "require-native"
    """Native or a NativeError: never silently fall back."""


@dataclass(frozen=True, slots=True)
class PathChoice:
    path: HookPath
    reason: str


def probe(torch_module: ModuleType | None = None) -> NativeFeatures:
    """Ask torch for the patch series' feature probe (``torch._C._dynn_features``)."""
    if torch_module is None:
        try:
            import torch as torch_module
        except ImportError as exc:
            return NativeFeatures(available=False, reason=f"torch is not importable ({exc})")
    version = getattr(torch_module, "__version__", None)
    fn = getattr(getattr(torch_module, "_C", None), "_dynn_features", None)
    if fn is None:
        return NativeFeatures(
            available=False, torch_version=version,
            reason=f"torch {version} is a stock build: torch._C has no _dynn_features "
                   "(build the patched wheel with build_tools/build_wheel.py)",
        )
    try:
        raw = dict(fn())
    except Exception as exc:  # noqa: BLE001 - a broken probe means "not usable", not a crash
        return NativeFeatures(available=False, torch_version=version,
                              reason=f"torch._C._dynn_features() raised {exc!r}")
    return NativeFeatures(
        available=True,
        series=raw.get("series"),
        features=frozenset(raw.get("features", ())),
        reclaim_protocol=raw.get("reclaim_protocol"),
        engine_protocol=raw.get("engine_protocol"),
        torch_version=version,
        reason=f"torch {version} carries patch series {raw.get('series')}",
    )


def select_path(
    features: NativeFeatures,
    device: str,
    *,
    prefer: Preference = Preference.AUTO,
    cuda_available: bool | None = None,
) -> PathChoice:
    """Choose native or stock hooks for ``device``, with the reason (rules in order)."""

    def stock(reason: str) -> PathChoice:
        if prefer is Preference.REQUIRE_NATIVE:
            raise NativeError(
                f"native: native hooks were required but cannot be used: {reason}. Install the patched "
                "wheel (docs/artifact-evaluation.md) or run with the stock path."
            )
        return PathChoice(HookPath.STOCK, reason)

    if prefer is Preference.STOCK:
        return PathChoice(HookPath.STOCK, "stock path requested")
    if not str(device).startswith("cuda"):
        return stock(f"device is {device}: the native hooks live in the CUDA caching allocator")
    if not features.available:
        return stock(features.reason or "torch is not patched")
    missing = sorted(REQUIRED_FEATURES - features.features)
    if missing:
        return stock(f"patched torch lacks features {missing} (was it built with USE_CUDA=0?)")
    for name, version in (("reclaim", features.reclaim_protocol), ("engine", features.engine_protocol)):
        if version != SUPPORTED_PROTOCOL:
            return stock(f"{name} protocol {version} of this torch, expected {SUPPORTED_PROTOCOL}: rebuild the "
                         "wheel from this checkout's patches/")
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return stock("patched torch, but CUDA is not available on this machine")
    return PathChoice(HookPath.NATIVE, f"{features.reason}; all of {sorted(REQUIRED_FEATURES)} present")


def active_path(
    device: str,
    *,
    prefer: Preference = Preference.AUTO,
    probe_fn: Callable[[], NativeFeatures] = probe,
    cuda_available: bool | None = None,
) -> tuple[NativeFeatures, PathChoice]:
    """Probe (``probe_fn`` is injectable for tests) and select; logs the decision."""
    feats = probe_fn()
    choice = select_path(feats, device, prefer=prefer, cuda_available=cuda_available)
    logger.info("native: %s hooks for %s: %s", choice.path.value, device, choice.reason)
    return feats, choice


def pinned_release(pin_file: Path = _PIN_FILE) -> dict[str, str] | None:
    """The PyTorch release the patch series targets (patches/PYTORCH_PIN), if this is a checkout."""
    try:
        text = pin_file.read_text()
    except OSError:
        return None
    return {m.group(1): m.group(2) for m in re.finditer(r'^\s*(\w+)\s*=\s*"([^"]*)"', text, re.M)}


class NativeHooks:
    """Connects the Python protocol objects to a patched torch's native hooks.

    ``install()`` registers trampolines through ``torch._C._dynn_*``; the native side
    calls them without allocator or engine locks held, taking the GIL itself.
    ``torch_c`` is injectable (tests pass a fake module).
    """

    def __init__(
        self,
        reclaim: ReclaimRegistry,
        engine: EngineHooks,
        torch_c: ModuleType | object | None = None,
    ) -> None:
        if torch_c is None:
            import torch

            torch_c = torch._C
        if not hasattr(torch_c, "_dynn_features"):
            raise NativeError("native: torch._C has no _dynn_features: this torch is not patched; "
                              "use the stock path (see `dynn doctor`).")
        self._c = torch_c
        self.reclaim = reclaim
        self.engine = engine
        self._observer_ids: list[int] = []
        self._installed = False

    def install(self) -> NativeHooks:
        c, reclaim, engine = self._c, self.reclaim, self.engine

        def on_reclaim(device: int, nbytes: int, stream: int, attempt: int) -> int:
            # The native retry loop owns retries; here one hook call = one runtime eviction round.
            return reclaim.call(ReclaimRequest(device, nbytes, stream, attempt)).effective

        def on_free(ptr: int, requested: int, block: int, device: int, stream: int) -> None:
            reclaim.note_free(device, block)

        c._dynn_set_reclaim_max_attempts(reclaim.max_attempts)
        c._dynn_set_reclaim_hook(on_reclaim)
        self._observer_ids.append(c._dynn_add_free_observer(on_free))
        def on_lookahead(items: list[tuple[int, str]]) -> None:
            # Natively delivered right before the fetch of the next node: queue them,
            # EngineHooks.before_node (the fetch trampoline) hands them to the runtime.
            for seq, name in items:
                engine.note_ready(int(seq), str(name))

        c._dynn_set_fetch_hook(engine.before_node)
        c._dynn_set_lookahead_hook(on_lookahead)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if not self._installed:
            return
        c = self._c
        c._dynn_set_reclaim_hook(None)
        c._dynn_set_fetch_hook(None)
        c._dynn_set_lookahead_hook(None)
        for oid in self._observer_ids:
            c._dynn_remove_observer(oid)
        self._observer_ids.clear()
        self._installed = False

    def __enter__(self) -> NativeHooks:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
