"""The idiom tool: memory-access idiom vectors for every PyTorch (ATen) operator.

DyNN-Offload's pilot model does not see operator names; it sees each operator as a vector of six
memory-access idioms (Table V of the paper). This package names the six positions
(:data:`IDIOM_NAMES`), derives a vector for every operator registered in the running torch from
its schema, tags and name (:func:`all_vectors`, :func:`idiom_vector`), and measures how close the
result is to the paper's table (:func:`agreement`). ``docs/idioms.md`` explains each idiom.

Example::

    >>> from dynn_runtime.idioms import IDIOM_NAMES, idiom_vector
    >>> IDIOM_NAMES
    ('transpose', 'accumulate', 'indirect', 'reduction', 'elementwise', 'window')
    >>> v = idiom_vector("max_pool3d")
    >>> dict(zip(IDIOM_NAMES, v)), v.source
    ({'transpose': 0, 'accumulate': 0, 'indirect': 0, 'reduction': 1, 'elementwise': 0, 'window': 1}, 'pool')
"""

from .agreement import AgreementReport, Mismatch, agreement, paper_table
from .generator import all_vectors, cache_info, idiom_vector, operator_names, overload_cache_info
from .vector import IDIOM_NAMES, IdiomVector

__all__ = [
    "IDIOM_NAMES",
    "IdiomVector",
    "idiom_vector",
    "all_vectors",
    "agreement",
    "AgreementReport",
    "Mismatch",
    "paper_table",
    "operator_names",
    "cache_info",
    "overload_cache_info",
]
