"""The one way PNGs are written: headless backend, parent folders created, figure closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend (no display on CI or the GPU machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, out: str | Path) -> Path:
    """Lay out, write and close ``fig``; returns the path written."""
    plt = pyplot()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
