"""CMakeLists.txt: the results of CMake's find commands are read, not hidden.

``find_path(VAR ...)`` (and ``find_library``, ``find_file``, ``find_program``) store their result
in the cache; a normal variable of the same name set before (``set(VAR "")``) hides that cache
entry, so the variable reads empty whatever was found. That is how every GPU build failed to find
CUDA's headers, so CUDA frees were never heard (docs/benchmarks.md, session 33)."""

from __future__ import annotations

import re
from pathlib import Path

CMAKE = Path(__file__).resolve().parents[2] / "CMakeLists.txt"


def _found_and_set(text: str) -> tuple[set[str], set[str]]:
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    found = set(re.findall(r"\bfind_(?:path|library|file|program)\s*\(\s*(\w+)", code, re.IGNORECASE))
    assigned = set(re.findall(r"\bset\s*\(\s*(\w+)", code, re.IGNORECASE))
    return found, assigned


def test_no_find_result_is_hidden_by_a_normal_variable():
    found, assigned = _found_and_set(CMAKE.read_text())
    assert {"DYNN_CUDA_INCLUDE", "DYNN_C10_CUDA"} <= found
    assert not found & assigned, f"set() before a find command hides its cached result: {sorted(found & assigned)}"


def test_the_check_catches_the_pattern_that_hid_cudas_headers():
    bad = 'set(DYNN_CUDA_INCLUDE "")\nif(X)\n  find_path(DYNN_CUDA_INCLUDE cuda_runtime_api.h PATHS p)\nendif()\n'
    found, assigned = _found_and_set(bad)
    assert found & assigned == {"DYNN_CUDA_INCLUDE"}
