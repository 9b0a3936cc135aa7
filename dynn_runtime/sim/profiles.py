"""Device profiles: what the simulator knows about a GPU and its host link, as data.

Numbers are vendor peak figures derated by an efficiency factor (eager PyTorch kernels rarely
reach peak) and measured-typical host-link bandwidths. A trace recorded on the CPU is projected
onto a profile with a roofline per operator (see :func:`op_time`); a trace recorded on the
profile's own GPU uses its measured durations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["DeviceProfile", "PROFILES", "get_profile", "op_time"]

GB = 10**9


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """A GPU and its host link."""

    name: str
    """Short name (``h100``)."""
    description: str
    """What it models."""
    capacity_bytes: int
    """Device memory."""
    h2d_bytes_per_s: float
    """Host-to-device bandwidth of one copy engine, pinned memory, as measured typically."""
    d2h_bytes_per_s: float
    """Device-to-host bandwidth of the other copy engine (both directions overlap each other and compute)."""
    copy_latency_s: float = 10e-6
    """Fixed cost per copy (launch, DMA set-up)."""
    mem_bytes_per_s: float
    """Device memory bandwidth (HBM) at peak."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Peak dense FLOP/s by dtype (``float32`` without TF32, ``bfloat16``, ``float16``)."""
    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s an eager kernel reaches."""
    memory_efficiency: float = 0.75
    """Fraction of peak memory bandwidth an eager kernel reaches."""
    op_overhead_s: float = 5e-6
    """Per-operator cost floor: eager dispatch plus kernel launch."""
    uvm_fault_s: float = 30e-6
    """Cost of one unified-memory fault batch (one 2 MiB chunk), on top of the migration."""
    uvm_bytes_per_s: float = 0.0
    """Effective bandwidth of demand migration under unified memory (below pinned-copy bandwidth)."""

    def flops_per_s(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops.get("float32", 1e13)) * self.compute_efficiency


#: PyTorch alone's host time per traced operator on a Hopper machine's host (a zoo family's step at
#: ``small`` over its trace's operators, measured in docs/benchmarks.md): where the host, not the
#: GPU, sets the pace of eager training, the floor is this
HOPPER_HOST_OP_S = 10e-6

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile(
            name="h100", description="NVIDIA H100 SXM 80 GB, host link PCIe Gen5 x16",
            capacity_bytes=80 * GB, h2d_bytes_per_s=50 * GB, d2h_bytes_per_s=50 * GB, mem_bytes_per_s=3.35e12,
            peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, uvm_bytes_per_s=20 * GB,
            op_overhead_s=HOPPER_HOST_OP_S,
        ),
        DeviceProfile(
            name="h200", description="NVIDIA H200 SXM 141 GB, host link PCIe Gen5 x16",
            capacity_bytes=141 * GB, h2d_bytes_per_s=50 * GB, d2h_bytes_per_s=50 * GB, mem_bytes_per_s=4.8e12,
            peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}, uvm_bytes_per_s=20 * GB,
            op_overhead_s=HOPPER_HOST_OP_S,
        ),
        DeviceProfile(
            name="a100", description="NVIDIA A100 SXM 80 GB, host link PCIe Gen4 x16",
            capacity_bytes=80 * GB, h2d_bytes_per_s=24 * GB, d2h_bytes_per_s=24 * GB, mem_bytes_per_s=2.0e12,
            peak_flops={"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}, uvm_bytes_per_s=10 * GB,
        ),
        DeviceProfile(
            name="v100", description="NVIDIA V100 SXM2 32 GB, host link PCIe Gen3 x16",
            capacity_bytes=32 * GB, h2d_bytes_per_s=12 * GB, d2h_bytes_per_s=12 * GB, mem_bytes_per_s=0.9e12,
            peak_flops={"float32": 15.7e12, "float16": 125e12}, uvm_bytes_per_s=5 * GB,
        ),
    )
}


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    if isinstance(name, DeviceProfile):
        return name
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"sim: unknown device profile {name!r}; choices: {', '.join(PROFILES)}."
        ) from None


def op_time(flops: int, nbytes: int, dtype: str, profile: DeviceProfile) -> float:
    """Roofline time of one operator: the slower of its arithmetic and its memory traffic, plus the floor.

    ``flops`` are PyTorch's FLOP-counter figures (2 per multiply-add for matrix products and
    convolutions; 0 for operators it does not cover, which are then memory-bound); ``nbytes`` are
    the bytes of the operator's tensor arguments and results.
    """
    compute = flops / profile.flops_per_s(dtype) if flops else 0.0
    memory = nbytes / (profile.mem_bytes_per_s * profile.memory_efficiency)
    return profile.op_overhead_s + max(compute, memory)
