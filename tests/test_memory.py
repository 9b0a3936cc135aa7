"""Live-bytes accounting against hand computations, and size parsing."""

from __future__ import annotations

import doctest

import pytest
import torch

import dynn_runtime.memory as memory
from dynn_runtime.errors import ConfigError
from dynn_runtime.memory import LiveBytes, format_bytes, parse_size, state_bytes


def test_views_and_inplace_count_once():
    with LiveBytes() as m:
        a = torch.zeros(256)        # 1 KiB
        v = a.view(16, 16)          # view: no new storage
        v.add_(1)                   # in place: no new storage
        b = a[::2].clone()          # a copy of half: 512 B
        del v
    assert m.peak_bytes == 1024 + 512
    assert b.numel() == 128


def test_peak_tracks_frees():
    with LiveBytes() as m:
        for _ in range(5):
            x = torch.ones(1000, dtype=torch.float64)  # 8000 B, previous one freed on rebind
            y = x + 1
            del x, y
    assert m.peak_bytes == 16000


def test_backward_frees_saved_tensors():
    w = torch.randn(64, 64, requires_grad=True)
    with LiveBytes() as m:
        x = torch.randn(32, 64)
        h = (x @ w).relu()
        loss = h.sum()
        loss.backward()
    # x (8 KiB), mm out (8 KiB), relu out (8 KiB), grad of w (16 KiB) ... all counted at their peak
    assert m.peak_bytes >= 8192 * 3
    assert w.grad is not None


def test_state_bytes_dedups_storages():
    p = torch.zeros(10)
    assert state_bytes([p, p.view(2, 5), torch.zeros(3)]) == 40 + 12


def test_parse_size():
    assert parse_size("6GiB") == 6 * 2**30
    assert parse_size("512 MB") == 512 * 10**6
    assert parse_size(17) == 17
    for bad in ("six", "1 parsec", "-1", -5):
        with pytest.raises(ConfigError, match="size"):
            parse_size(bad)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


def test_doctests():
    import dynn_runtime.models as models_pkg

    for mod in (memory, models_pkg):
        res = doctest.testmod(mod)
        assert res.failed == 0 and res.attempted > 0, mod.__name__
