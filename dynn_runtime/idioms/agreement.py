"""Compare the generated vectors with the paper's Table V.

The table ships inside the package (``dynn_runtime/idioms/data/paper_table_v.csv``, header
comments kept) so the comparison works from an installed wheel.
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass, field
from importlib import resources

from ..errors import ConfigError
from .generator import all_vectors
from .vector import IDIOM_NAMES

__all__ = ["Mismatch", "AgreementReport", "agreement", "paper_table"]

_TABLE = "paper_table_v.csv"


@functools.lru_cache(maxsize=1)
def _paper_table() -> tuple[tuple[str, tuple[int, ...]], ...]:
    text = resources.files("dynn_runtime.idioms").joinpath("data", _TABLE).read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, body = rows[0], rows[1:]
    expected = ["operator", *(f"i{i}" for i in range(6))]
    if header != expected:
        raise ConfigError(
            f"idioms: packaged {_TABLE} has header {header}, expected {expected}; "
            "the package data is damaged, reinstall dynn-runtime."
        )
    return tuple((r[0], tuple(int(x) for x in r[1:7])) for r in body)


def paper_table() -> dict[str, tuple[int, ...]]:
    """The paper's Table V as ``{operator: (i0, ..., i5)}`` (all rows, in torch or not).

    Example::

        >>> from dynn_runtime.idioms import paper_table
        >>> paper_table()["convolution"]
        (0, 1, 0, 1, 1, 2)
    """
    return dict(_paper_table())


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One table operator whose generated vector differs from the paper's."""

    op: str
    """Base name."""
    paper: tuple[int, ...]
    """The paper's vector."""
    ours: tuple[int, ...]
    """The generated vector."""
    source: str
    """Rule that produced ours."""

    @property
    def positions(self) -> tuple[str, ...]:
        """Idiom names of the positions that differ."""
        return tuple(n for n, a, b in zip(IDIOM_NAMES, self.paper, self.ours, strict=True) if a != b)


@dataclass(frozen=True, slots=True)
class AgreementReport:
    """How the generated vectors compare with Table V on the operators this torch has."""

    compared: int
    """Table operators that exist in this torch (the denominator)."""
    exact: int
    """Of those, how many match on all six positions."""
    per_position: tuple[int, ...]
    """Matches per position, in :data:`IDIOM_NAMES` order."""
    mismatches: tuple[Mismatch, ...]
    """Every operator that does not match exactly, in table order."""
    missing: tuple[str, ...] = field(default=())
    """Table operators that this torch does not register (not compared)."""

    @property
    def exact_fraction(self) -> float:
        """``exact / compared`` (0.0 when nothing could be compared)."""
        return self.exact / self.compared if self.compared else 0.0

    @property
    def per_position_fraction(self) -> tuple[float, ...]:
        """``per_position / compared``."""
        return tuple(p / self.compared if self.compared else 0.0 for p in self.per_position)

    def format(self) -> str:
        """A human-readable report (what ``dynn idioms --agreement`` prints)."""
        lines = [
            f"agreement with the paper's Table V: {self.exact}/{self.compared} exact "
            f"({100 * self.exact_fraction:.1f}%) on the table operators present in this torch "
            f"({len(self.missing)} table rows absent, not compared)",
            "per position:",
        ]
        for name, n, frac in zip(IDIOM_NAMES, self.per_position, self.per_position_fraction, strict=True):
            lines.append(f"  {name:<12} {n}/{self.compared} ({100 * frac:.1f}%)")
        lines.append(f"mismatches ({len(self.mismatches)}):")
        for m in self.mismatches:
            lines.append(
                f"  {m.op:<28} paper {m.paper}  ours {m.ours}  rule {m.source}  "
                f"differs in: {', '.join(m.positions)}"
            )
        if self.missing:
            lines.append("absent from this torch: " + ", ".join(self.missing))
        return "\n".join(lines)


def agreement() -> AgreementReport:
    """Compare :func:`all_vectors` with the paper's table on the operators present in torch.

    Example::

        >>> from dynn_runtime.idioms import agreement
        >>> rep = agreement()
        >>> rep.exact_fraction >= 0.9
        True
    """
    ours = all_vectors()
    compared = exact = 0
    per = [0] * 6
    mismatches: list[Mismatch] = []
    missing: list[str] = []
    for op, paper in _paper_table():
        v = ours.get(op)
        if v is None:
            missing.append(op)
            continue
        compared += 1
        mine = v.as_tuple()
        for i in range(6):
            per[i] += int(mine[i] == paper[i])
        if mine == paper:
            exact += 1
        else:
            mismatches.append(Mismatch(op=op, paper=paper, ours=mine, source=v.source))
    return AgreementReport(
        compared=compared,
        exact=exact,
        per_position=tuple(per),
        mismatches=tuple(mismatches),
        missing=tuple(missing),
    )
