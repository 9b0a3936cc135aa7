"""`dynn train`'s bit-identity verdict: a mismatch is blamed on the manager only when the unmanaged
run reproduces itself."""

from __future__ import annotations

import textwrap

from dynn_runtime.runtime.train import compare_unmanaged, train_managed

_NOISY = textwrap.dedent('''
    import os
    import torch
    from torch import nn

    class Noisy:
        def __init__(self, preset, noisy):
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
            self.noisy = noisy

        def make_batch(self, step):
            g = torch.Generator().manual_seed(step)
            return torch.randn(16, 8, generator=g)

        def loss(self, model, x):
            out = model(x).pow(2).mean()
            if self.noisy:  # what a non-deterministic kernel does: different low bits every run
                out = out + int.from_bytes(os.urandom(2), "little") * 1e-9
            return out

    def noisy(preset):
        return Noisy(preset, True)

    def quiet(preset):
        return Noisy(preset, False)
''')


def test_a_run_that_does_not_reproduce_itself_is_not_blamed_on_the_manager(tmp_path):
    path = tmp_path / "wl.py"
    path.write_text(_NOISY)
    res = train_managed(f"{path}:noisy", 1 << 30, "lru", steps=2, preset="tiny")
    cmp = compare_unmanaged(res)
    assert not cmp.losses_identical
    assert not cmp.reproducible
    res = train_managed(f"{path}:quiet", 1 << 30, "lru", steps=2, preset="tiny")
    cmp = compare_unmanaged(res)
    assert cmp.losses_identical and cmp.params_identical and cmp.reproducible
