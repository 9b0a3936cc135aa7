"""Trace-driven simulator: replay a recorded iteration against a policy, a budget and a device profile."""

from .engine import SimResult, Simulator, Status, simulate, unmanaged_peak
from .hostcost import HostCost, host_cost_for
from .profiles import PROFILES, DeviceProfile, get_profile, op_time

__all__ = ["simulate", "unmanaged_peak", "Simulator", "SimResult", "Status", "PROFILES", "DeviceProfile",
           "get_profile", "op_time", "HostCost", "host_cost_for"]
