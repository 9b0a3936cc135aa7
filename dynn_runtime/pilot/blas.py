"""One BLAS thread for the pilot's own numpy work, on the calling thread only.

numpy's bundled OpenBLAS runs a matrix product on as many threads as the machine has cores. The
pilot's products are small (a 512-row minibatch by 103 features by 64 units in the online refit):
split over threads they cost more in wake-ups and spinning than they save, and those threads take
the cores the training thread needs. :func:`one_blas_thread` sets the calling thread's OpenBLAS
thread count to one for the block (``openblas_set_num_threads_local``, OpenBLAS 0.3.27 and later:
other threads, the user's included, keep theirs) and puts the previous count back after. Where
numpy's BLAS is not such an OpenBLAS (MKL, Accelerate, an older OpenBLAS) or the library cannot be
found, it changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["one_blas_thread"]


@functools.cache
def _set_local() -> Any:
    """OpenBLAS's ``openblas_set_num_threads_local`` as loaded by numpy, or None."""
    np.dot(np.ones((2, 2)), np.ones((2, 2)))  # numpy's BLAS is loaded by now
    try:
        with open("/proc/self/maps") as maps:  # Linux: the shared objects this process has mapped
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # already mapped: the same library numpy calls
            fn = lib.openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Within the block, numpy's matrix products on this thread run on one BLAS thread."""
    fn = _set_local()
    if fn is None:
        yield
        return
    previous = fn(1)
    try:
        yield
    finally:
        fn(previous)
