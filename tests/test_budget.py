"""One budget type: every caller reads the same spellings and rejects the same values the same way."""

from __future__ import annotations

import argparse

import pytest

from dynn_runtime.budget import Budget
from dynn_runtime.errors import BudgetError


@pytest.mark.parametrize("value, expected", [
    (4096, Budget(bytes=4096)),
    ("4096", Budget(bytes=4096)),
    ("6GiB", Budget(bytes=6 << 30)),
    (" 512MB ", Budget(bytes=512_000_000)),
    ("1e9", Budget(bytes=10**9)),
    (0.25, Budget(fraction=0.25)),
    ("0.25", Budget(fraction=0.25)),
    ("1", Budget(fraction=1.0)),
    ("1/8", Budget(fraction=0.125)),
    (Budget(fraction=0.5), Budget(fraction=0.5)),
])
def test_parse(value, expected):
    assert Budget.parse(value) == expected


@pytest.mark.parametrize("bad", [0, -5, 0.0, 1.5, -0.1, float("nan"), True, "0", "1/0", "x/2", "6 parsecs", "-1GiB",
                                 None])
def test_one_message_for_every_bad_budget(bad):
    with pytest.raises(BudgetError, match=r"^sim: the budget must be a positive number of bytes, .*\(0, 1\]"):
        Budget.parse(bad, "sim")


def test_exactly_one_of_bytes_and_fraction():
    with pytest.raises(BudgetError, match="exactly one"):
        Budget()
    with pytest.raises(BudgetError, match="exactly one"):
        Budget(bytes=1, fraction=0.5)


def test_resolve():
    assert Budget.parse("1/4").resolve(1000) == 250
    assert Budget.parse(64).resolve(1000) == 64
    assert Budget.parse(1e-9).resolve(1000) == 1  # never zero bytes


def test_parse_fraction():
    assert [Budget.parse_fraction(x) for x in (1, 0.5, "1/4", "0.125")] == [1.0, 0.5, 0.25, 0.125]
    with pytest.raises(BudgetError, match=r"\(0, 1\]"):
        Budget.parse_fraction("6GiB", "bench")


def test_every_caller_uses_it():
    """The simulator, the live manager, the train CLI and the bench CLI reject a bad budget with the
    one message, each naming itself."""
    from dynn_runtime.bench.cli import _budgets
    from dynn_runtime.runtime.manager import MemoryManager
    from dynn_runtime.runtime.train import parse_budget
    from dynn_runtime.sim import simulate

    needle = "the budget must be a positive number of bytes"
    with pytest.raises(BudgetError, match=f"^runtime: {needle}"):
        MemoryManager(1.5, device="cpu")
    with pytest.raises(BudgetError, match=f"^runtime: {needle}"):
        parse_budget("0")
    with pytest.raises(BudgetError, match=f"^sim: {needle}"):
        simulate(None, "none", -1)  # checked before the trace is read
    with pytest.raises(argparse.ArgumentTypeError, match=f"^bench: {needle}"):
        _budgets("1,2GiB")
    assert _budgets("1, 1/2,0.25") == [1.0, 0.5, 0.25]
