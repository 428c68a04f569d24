"""A grid of methods x budgets on one task: each cell is an ordinary (resumable) evaluation in its own
folder; the sweep writes sweep.json, a markdown table and a PNG plot of accuracy against budget.

    DIR/full/                      the full-cache reference (once; it has no budget)
    DIR/<method>@<budget>/         one evaluation per cell (run.json, predictions, results.json)
    DIR/sweep.json, sweep.md, sweep.png

Every cell's method and budget are checked (and applied to the model once) before the first cell runs,
so a typo in the last cell stops the sweep before it has written anything. The sweep holds DIR's lock
and each cell its folder's, so a second sweep into DIR is refused.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mm_oval.config import budget_field
from mm_oval.errors import ConfigError, MmOvalError
from mm_oval.files import atomic_write_json, atomic_write_text

from .plots import plot_sweep
from .runner import (
    apply_method,
    check_method,
    claim_folder,
    evaluate,
    parse_budget,
    process_state,
    remove_method,
)
from .tasks import get_task

log = logging.getLogger(__name__)


def cell_dir_name(method: str, budget: float | int | None) -> str:
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", method)
    return safe if budget is None else f"{safe}@{budget:g}"


def parse_methods(values: list[str]) -> list[str]:
    """`--methods snapkv,knorm "kvp:agents=a.safetensors,eviction_scope=all"`: commas split names only in
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
    rule = task_obj.rule(eval_kwargs.get("rules"))  # an unknown scoring rule fails before any cell runs
    grid = [(m, b) for m in methods if m != "full" for b in budgets]
    check_cells(model, grid)
    lock = claim_folder(out, process_state())
    try:
        full_result = None
        if include_full or "full" in methods:
            full_result = evaluate(
                model, processor, task, data, method="full", out_dir=out / "full", **eval_kwargs
            )
        cells = []
        for m, b in grid:
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
                    "read_vs_dense": r["kv"].get("read_vs_dense"),
                    "one_token_read_vs_dense": r["kv"].get("one_token_read_vs_dense"),
                    "dir": cell_dir_name(m, b),
                }
            )
        return _write_summary(out, task_obj, methods, budgets, cells, full_result, rule)
    finally:
        if lock is not None:
            lock.release()


def check_cells(model: Any | None, grid: list[tuple[str, float | int]]) -> None:
    """Every cell's spec and budget, then (given a model) each method once on the model itself (what a
    spec alone cannot tell: agents trained for another model, options the policy rejects); the error
    names the cell."""
    for m, b in grid:
        try:
            check_method(m, b)
        except MmOvalError as e:
            raise type(e)(f"sweep cell {m} @ {b:g}: {e}") from e
    if model is None:
        return
    for m in dict.fromkeys(m for m, _ in grid):
        b = next(b for mm, b in grid if mm == m)
        try:
            wrapped = apply_method(model, m, b)
        except MmOvalError as e:
            raise type(e)(f"sweep cell {m} @ {b:g}: {e}") from e
        if wrapped:
            remove_method(model)


def _write_summary(
    out: Path,
    task_obj: Any,
    methods: list[str],
    budgets: list[float | int],
    cells: list[dict],
    full_result: dict | None,
    rule: Any,
) -> dict[str, Any]:
    summary = {
        "task": task_obj.name,
        "rules": rule.record(),
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
    """Rows: methods; columns: budgets; cells: the primary metric (and the KV fraction kept, when known;
    for retrieval rows also the measured bytes read per step over dense attention's, when known)."""
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
            cell = score + (f" ({100 * kept:.0f}%)" if kept is not None else "")
            read_x = c.get("read_vs_dense")
            if read_x is not None and budget_field(m) != "budget":
                cell += f" read {read_x:.2f}x"
                one = c.get("one_token_read_vs_dense")
                if one is not None and round(one, 2) != round(read_x, 2):
                    cell += f" ({one:.2f}x a token)"
            row.append(cell)
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    read = [m for m in summary["methods"] if budget_field(m) == "read_budget"]
    if read:
        lines += [
            "",
            f"For {', '.join(read)} (retrieval) the budget is `read_budget`, the share of image pages each decode "
            "step reads, and the whole cache stays resident; for every other method it is `budget`, the share "
            "of the image KV kept.",
        ]
    by_bytes = [m for m in summary["methods"] if budget_field(m) == "read_bytes_budget"]
    if by_bytes:
        lines += [
            "",
            f"For {', '.join(by_bytes)} (retrieval) the budget is `read_bytes_budget`, the bytes each decode "
            "step reads as a share of dense attention's, and the whole cache stays resident.",
        ]
    if any(
        c.get("read_vs_dense") is not None and budget_field(c["method"]) != "budget" for c in summary["cells"]
    ):
        lines += [
            "",
            "`read Nx`: the bytes the retrieval decode steps read (page summaries scanned + keys and values of "
            "the selected and always-read pages) over dense attention's over the resident cache, measured.",
        ]
    if any(
        c.get("one_token_read_vs_dense") is not None
        and c.get("read_vs_dense") is not None
        and round(c["one_token_read_vs_dense"], 2) != round(c["read_vs_dense"], 2)
        for c in summary["cells"]
    ):
        lines += [
            "",
            "`(Nx a token)`: the same over the steps that feed one token only, without the forwards that feed "
            "several (the question read after a compressed context, a later turn): what `read_bytes_budget` "
            "bounds; with `read_chunks=dense` those forwards read every page.",
        ]
    r = summary.get("rules")
    if r:
        src = r["source"]
        lines += [
            "",
            f"Scored with rule {r['name']} ({src['repository']} @ {src['commit'][:10]}, {src['file']}).",
        ]
    return "\n".join(lines) + "\n"
