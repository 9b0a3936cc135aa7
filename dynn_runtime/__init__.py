"""dynn-runtime: training large dynamic neural networks on limited GPU memory.

Parts: the zoo of dynamic networks (:mod:`dynn_runtime.models`), the idiom tool
(:mod:`dynn_runtime.idioms`), the trace recorder (:mod:`dynn_runtime.trace`), memory accounting
(:mod:`dynn_runtime.memory`), the native (patched PyTorch) hooks (:mod:`dynn_runtime.native`), and
the hints a workload may give about its own near future (:mod:`dynn_runtime.hints`).
"""

from . import hints
from ._version import __version__
from .errors import (
    BudgetError,
    ConfigError,
    DynnError,
    HostMemoryError,
    NativeError,
    PilotError,
    PolicyError,
    TraceError,
    WorkloadError,
)
from .runtime import MemoryManager
from .workload import load_workload, train

__all__ = [
    "__version__",
    "DynnError",
    "WorkloadError",
    "ConfigError",
    "TraceError",
    "BudgetError",
    "PolicyError",
    "PilotError",
    "NativeError",
    "HostMemoryError",
    "MemoryManager",
    "hints",
    "load_workload",
    "train",
]
