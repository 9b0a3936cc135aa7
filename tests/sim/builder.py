"""Hand-built traces for simulator tests (no recorder involved)."""

from __future__ import annotations

from dynn_runtime.sim.profiles import DeviceProfile
from dynn_runtime.trace.format import SCHEMA_VERSION, Iteration, Op, Storage, Trace

# Round numbers: every operator takes 1 s, a copy of b bytes takes b / 100 s, no latency.
UNIT = DeviceProfile(
    name="unit", description="test profile", capacity_bytes=10**6, h2d_bytes_per_s=100.0, d2h_bytes_per_s=100.0,
    copy_latency_s=0.0, mem_bytes_per_s=1e30, peak_flops={"float32": 1e30}, op_overhead_s=1.0,
    uvm_fault_s=0.5, uvm_bytes_per_s=100.0,
)


class TB:
    """Trace builder: storages by name, ops in order, frees after an op."""

    def __init__(self) -> None:
        self.storages: dict[str, Storage] = {}
        self.iters: list[Iteration] = []
        self._next = 1

    def storage(self, name: str, nbytes: int, kind: str = "temp", saved: bool = False, persistent_from: int | None = None):
        s = Storage(sid=self._next, nbytes=nbytes, dtype="float32", kind=kind, saved=saved, name=name)
        self._next += 1
        self.storages[name] = s
        if persistent_from is not None:
            s.alloc_at = (persistent_from, 0)
            s.preexisting = True
        return s

    def iteration(self, ops: list[tuple], fresh: bool = True) -> Iteration:
        """ops: (name, phase, module, inputs, allocs, frees_after); allocs are (name, bytes, kind, saved)."""
        idx = len(self.iters)
        it = Iteration(index=idx)
        sfx = f"@{idx}" if fresh and idx else ""
        for j, (name, phase, module, inputs, allocs, frees) in enumerate(ops):
            if phase not in it.phase_starts:
                it.phase_starts[phase] = j
            new = []
            for a in allocs:
                an, ab, ak, asv = a
                s = self.storage(an + sfx, ab, ak, asv)
                s.alloc_at = (idx, j)
                new.append(s.sid)
            ins = tuple(self._sid(n, sfx) for n in inputs)
            it.ops.append(Op(name=name, idiom=(0,) * 6, phase=phase, module=module, inputs=ins, outputs=tuple(new),
                             writes=(), allocs=tuple(new), duration_s=1.0, flops=0, nbytes=0))
            for f in frees:
                s = self.storages[f + sfx] if (f + sfx) in self.storages else self.storages[f]
                s.free_at = (idx, j + 1)
                it.frees.setdefault(j + 1, []).append(s.sid)
        self.iters.append(it)
        return it

    def _sid(self, n: str, sfx: str) -> int:
        return (self.storages.get(n + sfx) or self.storages[n]).sid

    def trace(self) -> Trace:
        h = {"t": "H", "magic": "dynn-trace", "schema": SCHEMA_VERSION, "device": "cpu", "workload": "hand"}
        return Trace(header=h, storages={s.sid: s for s in self.storages.values()}, iterations=self.iters)
