"""The device-memory budget, as every part of dynn-runtime reads it.

A budget is either bytes or a fraction of the *unmanaged peak* (the device bytes the iteration holds
under ``none``, PyTorch alone): the simulator knows that peak from the trace, the live manager
measures it in its first step, the benchmark's grid is made of fractions. :meth:`Budget.parse` is
the one reader and validator; every caller (``MemoryManager``, ``simulate``, ``dynn train``,
``dynn bench --budgets``) goes through it, so each accepts the same spellings and rejects the same
values with the same message.

>>> Budget.parse("6GiB"), Budget.parse(4096), Budget.parse("1/4"), Budget.parse(0.25), Budget.parse("0.5")
(Budget(bytes=6442450944, fraction=None), Budget(bytes=4096, fraction=None), Budget(bytes=None, fraction=0.25), \
Budget(bytes=None, fraction=0.25), Budget(bytes=None, fraction=0.5))
>>> Budget.parse("1/4").resolve(1000)
250
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import BudgetError, ConfigError
from .memory import parse_size

__all__ = ["Budget", "is_plain_number"]


def is_plain_number(text: str) -> bool:
    """``text`` is a bare number (``"0.25"``, ``"4096"``, ``"1e9"``): no unit, no ``/``."""
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Budget:
    """Bytes, or a fraction in (0, 1] of the unmanaged peak: exactly one is set.

    Spellings :meth:`parse` reads: an ``int`` is bytes; a ``float`` is a fraction; a string is a
    fraction written ``"a/b"`` or as a bare number at most 1 (``"0.25"``, ``"1"``), bytes as a bare
    number above 1 (``"4096"``) or a size with a unit (``"6GiB"``, ``"512MB"``).
    """

    #: an absolute budget in bytes (> 0), or None for a fractional one
    bytes: int | None = None
    #: a fraction of the unmanaged peak in (0, 1], or None for an absolute one
    fraction: float | None = None

    def __post_init__(self) -> None:
        b, f = self.bytes, self.fraction
        if (b is None) == (f is None):
            raise BudgetError(f"budget: give bytes or a fraction, exactly one; got bytes={b!r}, fraction={f!r}.")
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            _invalid(b, "budget")
        if f is not None and (isinstance(f, bool) or not math.isfinite(f) or not 0 < f <= 1):
            _invalid(f, "budget")

    @classmethod
    def parse(cls, value: int | float | str | Budget, where: str = "budget") -> Budget:
        """Read ``value`` (see the class docstring); ``where`` names the subsystem in the error."""
        if isinstance(value, Budget):
            return value
        try:
            if isinstance(value, bool):
                raise BudgetError
            if isinstance(value, int):
                return cls(bytes=value)
            if isinstance(value, float):
                return cls(fraction=value)
            if not isinstance(value, str):
                raise BudgetError
            s = value.strip()
            if "/" in s:
                num, _, den = s.partition("/")
                try:
                    return cls(fraction=float(num) / float(den))
                except (ValueError, ZeroDivisionError):
                    raise BudgetError from None
            if is_plain_number(s):
                number = float(s)
                return cls(fraction=number) if number <= 1 else cls(bytes=int(number))
            try:
                return cls(bytes=parse_size(s))
            except ConfigError:
                raise BudgetError from None
        except BudgetError:
            _invalid(value, where)
            raise  # unreachable: _invalid raises

    @classmethod
    def parse_fraction(cls, value: int | float | str, where: str = "budget") -> float:
        """``value`` as a fraction of the unmanaged peak, for a grid of fractions (``dynn bench
        --budgets``): a number (``1`` included) or a string :meth:`parse` reads as a fraction."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        fraction = cls.parse(value, where).fraction
        if fraction is None:
            _invalid(value, where)
        return fraction

    def resolve(self, unmanaged_peak: int) -> int:
        """Bytes this budget allows an iteration whose unmanaged peak is ``unmanaged_peak``."""
        if self.bytes is not None:
            return self.bytes
        return max(1, int(unmanaged_peak * self.fraction))


def _invalid(value: object, where: str) -> None:
    raise BudgetError(f"{where}: the budget must be a positive number of bytes, a size like '6GiB', or a fraction "
                      f"of the unmanaged peak in (0, 1] like 0.25 or '1/4'; got {value!r}.")
