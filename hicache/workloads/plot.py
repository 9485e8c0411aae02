"""``hicache serve --plot``: mean TTFT per round, one line per configuration (matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.errors import ConfigError

__all__ = ["plot_rounds"]


def plot_rounds(rows: Sequence[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'hicache[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        per_round = row.get("rounds_ttft_ms") or []
        ax.plot(range(1, len(per_round) + 1), per_round, marker="o", label=row["name"])
    rounds = max((len(row.get("rounds_ttft_ms") or []) for row in rows), default=0)
    ax.set_xticks(range(1, rounds + 1))
    ax.set_xlabel("round")
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("TTFT per round")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
