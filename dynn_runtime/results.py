"""What result files (``dynn bench``, ``dynn train --out``) are written with: strict JSON."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["strict_json"]


def strict_json(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None and dict keys made strings: strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x
