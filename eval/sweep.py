"""A grid of methods x budgets on one task: each cell is an ordinary (resumable) evaluation in its own
folder; the sweep writes sweep.json, a markdown table and a PNG plot of accuracy against budget.

    DIR/full/                      the full-cache reference (once; it has no budget)
    DIR/<method>@<budget>/         one evaluation per cell (run.json, predictions, results.json)
    DIR/sweep.json, sweep.md, sweep.png
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .files import atomic_write_json, atomic_write_text
from .plots import plot_sweep
from .runner import evaluate, parse_budget, process_state
from .tasks import get_task

log = logging.getLogger(__name__)


def cell_dir_name(method: str, budget: float | int | None) -> str:
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", method)
    return safe if budget is None else f"{safe}@{budget:g}"


def parse_methods(values: list[str]) -> list[str]:
    """`--methods snapkv,knorm "kvp:agents=a.safetensors,scope=all"`: commas split names only in
    arguments that carry no options (a ':' starts options, whose own commas stay)."""
    out: list[str] = []
    for v in values:
        out += [v] if ":" in v else [p.strip() for p in v.split(",") if p.strip()]
    if not out:
        raise ConfigError("--methods needs at least one method")
    return out


def parse_budgets(values: list[str]) -> list[float | int]:
    out: list[float | int] = []
    for v in values:
        out += [parse_budget(p.strip()) for p in v.split(",") if p.strip()]
    if not out:
        raise ConfigError("--budgets needs at least one budget")
    return out


def run_sweep(
    model: Any,
    processor: Any,
    task: str,
    data: str | Path,
    methods: list[str],
    budgets: list[float | int],
    out_dir: str | Path,
    include_full: bool = True,
    **eval_kwargs: Any,
) -> dict[str, Any]:
    """Evaluate every (method, budget) cell plus the full cache; write the table and the plot."""
    out = Path(out_dir)
    task_obj = get_task(task)
    full_result = None
    if include_full or "full" in methods:
        full_result = evaluate(
            model, processor, task, data, method="full", out_dir=out / "full", **eval_kwargs
        )
    cells = []
    for m in methods:
        if m == "full":
            continue
        for b in budgets:
            log.info("sweep cell: %s @ %s", m, b)
            r = evaluate(
                model,
                processor,
                task,
                data,
                method=m,
                budget=b,
                out_dir=out / cell_dir_name(m, b),
                **eval_kwargs,
            )
            cells.append(
                {
                    "method": m,
                    "budget": b,
                    "primary": r["primary"],
                    "kv_fraction_kept": r["kv"].get("kv_fraction_kept"),
                    "dir": cell_dir_name(m, b),
                }
            )
    summary = {
        "task": task_obj.name,
        "primary_metric": task_obj.primary_metric,
        "full": None if full_result is None else full_result["primary"],
        "full_ran": full_result is not None,
        "methods": [m for m in methods if m != "full"],
        "budgets": budgets,
        "cells": cells,
        "config": None
        if full_result is None
        else {k: full_result["config"][k] for k in ("model", "data", "limit")},
    }
    if process_state().is_main_process:
        atomic_write_json(out / "sweep.json", summary)
        atomic_write_text(out / "sweep.md", markdown_table(summary))
        scored = [c for c in cells if c["primary"] is not None]
        if scored:
            plot_sweep(
                scored,
                summary["full"],
                out / "sweep.png",
                title=f"{task_obj.name}: {task_obj.primary_metric} vs KV budget",
                ylabel=task_obj.primary_metric,
            )
    return summary


def markdown_table(summary: dict[str, Any]) -> str:
    """Rows: methods; columns: budgets; cells: the primary metric (and the KV fraction kept, when known)."""
    budgets = summary["budgets"]
    lines = [
        f"{summary['task']}: {summary['primary_metric']} by KV budget (cells: score, KV bytes kept)",
        "",
        "| method | " + " | ".join(f"{b:g}" for b in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    if summary.get("full_ran"):
        full = "n/a" if summary["full"] is None else f"{summary['full']:.2f}"
        lines.append("| full | " + " | ".join(full for _ in budgets) + " |")
    by = {(c["method"], c["budget"]): c for c in summary["cells"]}
    for m in summary["methods"]:
        row = []
        for b in budgets:
            c = by.get((m, b))
            if c is None:
                row.append("")
                continue
            kept = c.get("kv_fraction_kept")
            score = "n/a" if c["primary"] is None else f"{c['primary']:.2f}"
            row.append(score + (f" ({100 * kept:.0f}%)" if kept is not None else ""))
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
