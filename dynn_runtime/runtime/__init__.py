"""The live runtime: :class:`MemoryManager` keeps training within a device-memory budget."""

from .hostpool import HostBuffer, HostPool
from .manager import MemoryManager, StepStats

__all__ = ["MemoryManager", "StepStats", "HostPool", "HostBuffer"]
