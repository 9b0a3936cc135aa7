"""Faults and decision points put their reads of the log off where the observer keeps the order
(lru): the storages a step moves, in order, and the numbers are those of the reference, which reads
the log at every fault and decision point (``NativeSource.defer_parse = False``), with far fewer
reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.runtime.events import native_module
from dynn_runtime.runtime.manager import MemoryManager
from dynn_runtime.runtime.native_source import NativeSource

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native extension is not built")


def _run(family, budget, defer, monkeypatch):
    """Losses, final state, stats, every move (sid, old status, new) and the number of log reads."""
    moves: list[tuple[int, str, str]] = []
    reads = [0]
    set_status, parse = MemoryManager.set_status, NativeSource._native_parse

    def logged(self, s, new):
        if "absent" not in (s.status.value, new.value):  # births and deaths are read when the log is
            moves.append((s.sid, s.status.value, new.value))
        set_status(self, s, new)

    def counted(self, in_step, light=False):
        reads[0] += 1
        parse(self, in_step, light)

    with monkeypatch.context() as m:
        m.setattr(MemoryManager, "set_status", logged)
        m.setattr(NativeSource, "_native_parse", counted)
        m.setattr(NativeSource, "defer_parse", defer)
        losses, state, stats = train_family(family, "lru", budget, events="native")
    return losses, state, stats, moves, reads[0]


@pytest.mark.parametrize("family,fraction", [("moe", 0.25), ("tree_lstm", 0.5), ("evoformer", 0.25)])
def test_reads_put_off_move_what_the_reference_moves(family, fraction, monkeypatch):
    want_losses, want, _ = train_family(family)
    _, _, big = train_family(family, "lru", 1 << 40, events="native")
    budget = int(big["peak_device_bytes"] * fraction)
    ref = _run(family, budget, False, monkeypatch)
    got = _run(family, budget, True, monkeypatch)
    assert ref[2]["evictions"] > 0
    assert got[0] == ref[0] == want_losses
    assert all(torch.equal(a, b) for a, b in zip(got[1], want, strict=True))
    assert got[3] == ref[3], "the reads put off changed which storages moved, or when"
    assert got[2]["evictions"] == ref[2]["evictions"] and got[2]["peak_device_bytes"] == ref[2]["peak_device_bytes"]
    assert got[4] < ref[4], f"{got[4]} reads of the log against {ref[4]}: no read was put off"
