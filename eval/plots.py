"""Plots of sweep results: accuracy against KV budget, one line per method, the full cache as a reference."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def plot_sweep(
    cells: list[dict[str, Any]], full: float | None, path: str | Path, title: str, ylabel: str
) -> Path:
    """`cells`: {"method", "budget", "primary"} rows. Writes a PNG atomically and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    methods: dict[str, list[tuple[float, float]]] = {}
    for c in cells:
        methods.setdefault(c["method"], []).append((float(c["budget"]), float(c["primary"])))
    # more methods than the default 10-colour cycle: tab20 colours and alternating markers keep lines apart
    palette = plt.get_cmap("tab20").colors
    markers = "osD^v<>ph*"
    for i, (name, pts) in enumerate(methods.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker=markers[i % len(markers)],
            color=palette[(2 * i) % 20 + (i // 10) % 2],
            label=name,
        )
    if full is not None:
        ax.axhline(full, color="black", linestyle="--", linewidth=1, label=f"full cache ({full:.2f})")
    budgets = sorted({float(c["budget"]) for c in cells})
    if budgets and all(b > 1 for b in budgets):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV budget (tokens kept)")
    else:
        ax.set_xlabel("KV budget (fraction kept)")
    if budgets:
        ax.set_xticks(budgets)
        ax.set_xticklabels([f"{b:g}" for b in budgets])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
