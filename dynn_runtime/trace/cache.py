"""Recorded traces on disk, keyed by what produced them: record once, read back on every later run.

The benchmark harness and the pilot's training data both draw zoo traces from a :class:`TraceCache`;
a file is named by workload, preset, seed, steps, a short hash of the config overrides and the
trace schema version, so a change of any of them records a new file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .._log import logger
from ..errors import TraceError
from .format import SCHEMA_VERSION, Trace, read_trace
from .recorder import record

__all__ = ["TraceCache"]


class TraceCache:
    """Recorded traces on disk, keyed by workload, preset, seed, steps and overrides.

    ``recorded`` and ``reused`` count what :meth:`get` did (tests and the report read them).
    ``fake=True`` records with :func:`dynn_runtime.trace.fake.record_fake` (GPU-scale shapes without
    their values), into files of their own (``...-fake-v<schema>.jsonl.gz``).
    """

    def __init__(self, root: str | Path, fake: bool = False) -> None:
        self.root = Path(root)
        self.fake = fake
        self.recorded = 0
        self.reused = 0

    def path(self, family: str, preset: str, seed: int, steps: int, overrides: dict | None = None) -> Path:
        key = "base"
        if overrides:
            blob = json.dumps(overrides, sort_keys=True, default=str).encode()
            key = hashlib.sha1(blob).hexdigest()[:10]
        if ".py:" in family:  # a user's file.py:function: a file-name-safe name, and the spec's hash
            from ..workload import workload_name

            name = f"{workload_name(family)}-{hashlib.sha1(family.encode()).hexdigest()[:8]}"
        else:
            name = family
        kind = "-fake" if self.fake else ""
        return self.root / f"{name}-{preset}-seed{seed}-steps{steps}-{key}{kind}-v{SCHEMA_VERSION}.jsonl.gz"

    def get(self, family: str, preset: str, seed: int = 0, steps: int = 2, overrides: dict | None = None) -> Trace:
        """The trace, read from the cache or recorded into it (atomically: a killed run leaves no half file)."""
        path = self.path(family, preset, seed, steps, overrides)
        if path.exists():
            try:
                trace = read_trace(path)
                if len(trace.iterations) != steps:
                    raise TraceError(f"trace: {path} has {len(trace.iterations)} iteration(s), expected {steps}.")
            except TraceError as exc:
                logger.warning("trace: cached trace %s does not read back (%s); recording it again.", path, exc)
            else:
                self.reused += 1
                return trace
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name[: -len('.jsonl.gz')]}.tmp{os.getpid()}.jsonl.gz")
        try:
            if self.fake:
                from .fake import record_fake

                record_fake(family, tmp, steps=steps, preset=preset, seed=seed, overrides=dict(overrides or {}))
            else:
                record(family, tmp, steps=steps, preset=preset, seed=seed, overrides=dict(overrides or {}))
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        self.recorded += 1
        return read_trace(path)
