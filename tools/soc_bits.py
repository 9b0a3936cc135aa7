"""Is ``torch.autograd.graph.save_on_cpu`` bit-identical to PyTorch alone, and if not, is it the layout?

    python tools/soc_bits.py [FAMILY ...] [--device cuda] [--preset small] [--steps 3]

Per family (default moe, early_exit, tree_lstm, evoformer): PyTorch alone twice (the second run says
whether PyTorch alone repeats itself bit for bit), then ``save_on_cpu``
(pinned on CUDA), then the same offload with every saved tensor's strides kept
(``torch.empty_strided`` on the host instead of ``save_on_cpu``'s contiguous ``torch.empty``), each
for ``--steps`` steps under deterministic algorithms. Prints whether each run's final parameters and
optimizer state (``RunResult.digest``) and losses equal PyTorch alone's. Where ``save_on_cpu`` differs
and the stride-keeping offload does not, the difference comes from the layout the saved tensors
come back in (a backward kernel then reads a contiguous copy of what was a strided view).
"""

from __future__ import annotations

import argparse

import torch

from dynn_runtime.runtime.train import deterministic, train_unmanaged

FAMILIES = ("moe", "early_exit", "tree_lstm", "evoformer")


class KeepStrides(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu`` with each saved tensor's sizes and strides kept on the host copy."""

    def __init__(self, pin: bool) -> None:
        def pack(t: torch.Tensor):
            host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, layout=t.layout, device="cpu",
                                       pin_memory=pin)
            host.copy_(t)
            return t.device, host

        def unpack(packed):
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    pin = a.device == "cuda"
    print(f"device {torch.cuda.get_device_name() if pin else 'cpu'}, preset {a.preset}, {a.steps} steps")
    with deterministic():
        for fam in a.families:
            kw = dict(steps=a.steps, preset=a.preset, device=a.device)
            alone = train_unmanaged(fam, **kw)
            again = train_unmanaged(fam, **kw)
            soc = train_unmanaged(fam, **kw, step_context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin),
                                  label="save_on_cpu")
            kept = train_unmanaged(fam, **kw, step_context=lambda: KeepStrides(pin), label="strides kept")
            print(f"{fam}: PyTorch alone again identical {again.digest == alone.digest}; save_on_cpu identical {soc.digest == alone.digest} (losses {soc.losses == alone.losses}); "
                  f"strides kept identical {kept.digest == alone.digest} (losses {kept.losses == alone.losses})")


if __name__ == "__main__":
    main()
