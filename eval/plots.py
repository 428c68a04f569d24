"""Plots of sweep results: accuracy against KV budget, one line per method, the full cache as a reference."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from mm_oval.files import atomic_write_bytes


def _common_options(names: list[str]) -> list[str]:
    """The `key=value` options every method spec shares (e.g. the sinks of a sweep), in first-seen order."""
    opts = [n.split(":", 1)[1].split(",") if ":" in n else [] for n in names]
    return [o for o in opts[0] if all(o in rest for rest in opts[1:])] if opts else []


def _short(name: str, common: list[str]) -> str:
    if ":" not in name:
        return name
    head, tail = name.split(":", 1)
    rest = [o for o in tail.split(",") if o not in common]
    return head + (":" + ",".join(rest) if rest else "")


def plot_sweep(
    cells: list[dict[str, Any]], full: float | None, path: str | Path, title: str, ylabel: str
) -> Path:
    """`cells`: {"method", "budget", "primary"} rows. Writes a PNG atomically and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    methods: dict[str, list[tuple[float, float]]] = {}
    for c in cells:
        methods.setdefault(c["method"], []).append((float(c["budget"]), float(c["primary"])))
    # the options every method shares go to the title once; the legend, beside the axes, names the rest
    common = _common_options(list(methods))
    labels = {m: _short(m, common) for m in methods}
    width = 6.4 + 0.07 * max((len(x) for x in labels.values()), default=0)
    fig, ax = plt.subplots(figsize=(width, 4.2), dpi=120)
    if common:
        title = f"{title}\n(every method: {','.join(common)})"
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
            label=labels[name],
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
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
