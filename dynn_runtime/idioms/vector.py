"""The six memory-access idioms and the vector that counts them for one operator.

Positions follow Table V of the DyNN-Offload paper; the paper leaves them unnamed, the names
below are ours (see ``docs/idioms.md`` for the reasoning behind each one):

====  ===============  =====  ==============================================================
pos   name             kind   set / counted when the operator ...
====  ===============  =====  ==============================================================
0     ``transpose``    flag   reads or writes in an order that permutes the logical layout
1     ``accumulate``   flag   writes memory that already holds live data (in-place, ``out=``,
                              accumulation of partial results into its output)
2     ``indirect``     flag   addresses memory through data (index tensors, masks) or re-reads
                              one value across a whole dimension (broadcast statistics)
3     ``reduction``    count  combines many input elements into one output element: reductions,
                              contractions, sliding windows, index-accumulation, the
                              vector-Jacobian product of a backward operator; fused adds count
4     ``elementwise``  count  applies arithmetic stages per element of a freshly written output
                              (an activation, a multiply-accumulate, a bias epilogue, ...)
5     ``window``       count  traverses a sliding window (stencil); the value is the paper's
                              window class: 2 planar convolution, 3 volumetric, 1 irregular pool
====  ===============  =====  ==============================================================
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IDIOM_NAMES", "IdiomVector"]

IDIOM_NAMES: tuple[str, ...] = (
    "transpose",
    "accumulate",
    "indirect",
    "reduction",
    "elementwise",
    "window",
)
"""Names of the six idiom positions, in vector order."""


@dataclass(frozen=True, slots=True)
class IdiomVector:
    """Six idiom values for one operator, and the rule that produced them.

    Example::

        >>> from dynn_runtime.idioms import IdiomVector
        >>> v = IdiomVector(0, 1, 0, 1, 2, 2, source="conv")
        >>> v.as_tuple()
        (0, 1, 0, 1, 2, 2)
        >>> v.window, v.source
        (2, 'conv')
    """

    transpose: int
    """Position 0 (flag): the access order permutes the layout (transpose, conv_transpose, im2col)."""
    accumulate: int
    """Position 1 (flag): writes memory that holds live data (in-place, ``out=``, accumulation)."""
    indirect: int
    """Position 2 (flag): data-dependent (index, mask) or broadcast addressing."""
    reduction: int
    """Position 3 (count): many-to-one combining stages (reduce, contract, window, VJP, fused add)."""
    elementwise: int
    """Position 4 (count): per-element arithmetic stages producing a fresh output."""
    window: int
    """Position 5 (count): sliding-window class (2 planar conv, 3 volumetric conv, 1 irregular pool)."""
    source: str = "default"
    """Name of the rule (or ``override:<op>``, or ``default``) that produced the vector."""

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        """The six values as a plain tuple, in :data:`IDIOM_NAMES` order."""
        return (self.transpose, self.accumulate, self.indirect, self.reduction, self.elementwise, self.window)

    def __iter__(self):
        return iter(self.as_tuple())

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        return self.as_tuple()[i]

    @classmethod
    def of(cls, values: tuple[int, ...] | list[int], source: str) -> IdiomVector:
        """Build from a 6-sequence; ``IdiomVector.of((1, 0, 0, 0, 0, 0), "transpose")``."""
        if len(values) != 6:
            raise ValueError(f"idioms: a vector has 6 values, got {len(values)}: {tuple(values)!r}")
        return cls(*(int(x) for x in values), source=source)

    def replace(self, source: str | None = None, **values: int) -> IdiomVector:
        """A copy with some positions (by idiom name) and/or the source changed."""
        cur = dict(zip(IDIOM_NAMES, self.as_tuple(), strict=True))
        cur.update(values)
        return IdiomVector(**cur, source=self.source if source is None else source)
