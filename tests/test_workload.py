"""``load_workload``: ``--seed`` reaches a user's ``file.py:function`` workload."""

from __future__ import annotations

from pathlib import Path

import torch

from dynn_runtime.workload import SEED_STRIDE, SeededBatches, load_workload

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "my_workload.py") + ":build"


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_seed_changes_a_user_workloads_batches():
    # examples/my_workload.py:build(preset) takes no seed and seeds its batches by step alone
    s0, s0_again, s1, s2 = (load_workload(EXAMPLE, "tiny", seed=s) for s in (0, 0, 1, 2))
    for step in range(3):
        assert _same(s0.make_batch(step), s0_again.make_batch(step))  # one seed: the same batches
    assert not any(_same(s0.make_batch(k), s1.make_batch(k)) for k in range(3))  # two seeds: different
    assert not any(_same(s1.make_batch(k), s2.make_batch(k)) for k in range(3))
    assert _same(load_workload(EXAMPLE, "tiny", seed=1).make_batch(2), s1.make_batch(2))
    # seed 0 is the workload as written; another seed delegates all but make_batch to it
    assert not isinstance(s0, SeededBatches) and isinstance(s1, SeededBatches)
    assert _same(s1.make_batch(0), s0.make_batch(SEED_STRIDE))
    assert isinstance(s1.model, torch.nn.Module) and callable(s1.loss) and callable(s1.optimizer)


def test_a_function_that_takes_seed_gets_it(tmp_path):
    f = tmp_path / "wl.py"
    f.write_text(
        "import torch\n"
        "class W:\n"
        "    def __init__(self, seed):\n"
        "        self.seed = seed\n"
        "        self.model = torch.nn.Linear(2, 1)\n"
        "    def make_batch(self, step):\n"
        "        return torch.randn(3, 2, generator=torch.Generator().manual_seed(1000 * self.seed + step))\n"
        "    def loss(self, model, batch):\n"
        "        return model(batch).sum()\n"
        "def build(preset, seed=0):\n"
        "    return W(seed)\n"
    )
    a, b = load_workload(f"{f}:build", "tiny", seed=3), load_workload(f"{f}:build", "tiny", seed=4)
    assert not isinstance(a, SeededBatches) and (a.seed, b.seed) == (3, 4)
    assert not torch.equal(a.make_batch(0), b.make_batch(0))
    assert torch.equal(a.make_batch(1), load_workload(f"{f}:build", "tiny", seed=3).make_batch(1))
    # the global generator is seeded before the function runs: weights it draws follow the seed
    assert not torch.equal(a.model.weight, b.model.weight)
