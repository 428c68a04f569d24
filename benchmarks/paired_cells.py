"""Is one evaluated cell's lead over another real? A paired comparison of two cells on the same questions.

A cell is a folder that `mm-oval sweep` (one per method and budget) or `mm-oval eval --out` wrote: its
run.json names the task, the data, the questions (limit) and the setting; results.json its score and its
predictions file. Both cells must hold the same questions in the same setting (the model and the method may
differ). Each is scored again with the task's own rule per unit, a unit being the questions that share an
image or a text context: they are read from one compressed cache, so they are not independent draws. A
cell's score is then the mean of its units' scores weighted by their question counts, which this checks
against the cell's own results.json (a task whose score is not such a mean, MMBench's circular rule over
rotations, is refused). It prints both scores, their difference, the units where each is ahead, and a 95%
bootstrap interval of the difference (units resampled with replacement; 10,000 draws, seed 0): an interval
that holds 0 says the two cells are not told apart by these questions.

    python benchmarks/paired_cells.py runs/sweep/kvp...@0.25 runs/sweep/h2o...@0.25 [--out paired.json]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from mm_oval.eval.files import read_json
from mm_oval.eval.tasks import get_task, resolve_data

from mm_oval.errors import DataError, MmOvalError, ResultsError
from mm_oval.files import atomic_write_json

# what must be equal for two cells to hold the same questions in the same setting
SAME = ("task", "data", "data_options", "limit", "multi_turn", "compress")


def read_cell(folder: Path) -> tuple[dict, dict]:
    """(identity from run.json, results.json) of an evaluated cell; a clear error naming what is missing."""
    run, res = folder / "run.json", folder / "results.json"
    for f in (run, res):
        if not f.is_file():
            raise DataError(
                f"{folder}: no {f.name}; name a folder that `mm-oval sweep` or `mm-oval eval` wrote"
            )
    identity, results = read_json(run, "run file"), read_json(res, "results file")
    try:
        identity = identity["identity"]
        results["primary"], results["official_predictions"]  # noqa: B018 (both must be there)
    except (KeyError, TypeError) as e:
        raise DataError(f"{folder}: run.json or results.json lacks {e}; rerun the cell") from e
    return identity, results


def unit_scores(
    folder: Path, identity: dict, results: dict, units: dict[str, list], sizes: np.ndarray, task: Any
) -> np.ndarray:
    """Each unit's score (the task's primary metric on its questions alone), in `units` order; `sizes` their
    question counts."""
    items = [it for members in units.values() for it in members]
    preds = task.read_predictions(folder / results["official_predictions"], items)
    scores = []
    for key, members in units.items():
        s = task.primary(task.score(members, preds))
        if s is None:
            raise ResultsError(f"{folder}: unit {key!r} has no score (no ground truth); nothing to compare")
        scores.append(s)
    out = np.array(scores, dtype=np.float64)
    mean = float((out * sizes).sum() / sizes.sum())
    if abs(mean - float(results["primary"])) > 0.006:  # results.json rounds to two decimals
        raise ResultsError(
            f"{folder}: {identity['task']}'s score {results['primary']} is not the question-weighted mean of its "
            f"units' scores ({mean:.4f}), so it cannot be compared unit by unit here; compare its tables"
        )
    return out


def compare(a: Path, b: Path, resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    ia, ra = read_cell(a)
    ib, rb = read_cell(b)
    differ = [k for k in SAME if ia.get(k) != ib.get(k)]
    if differ:
        what = "; ".join(f"{k}: {ia.get(k)!r} against {ib.get(k)!r}" for k in differ)
        raise DataError(f"{a} and {b} do not hold the same questions in the same setting ({what})")
    task = get_task(ia["task"])
    # the data as the run named it: `bundled` / `bundled576` (what the command line writes) or a path
    items = task.load(resolve_data(ia["data"], task), limit=ia["limit"], **(ia.get("data_options") or {}))
    units: dict[str, list] = defaultdict(list)
    for it in items:
        units[it.group or it.id].append(it)
    sizes = np.array([len(m) for m in units.values()], dtype=np.float64)
    sa = unit_scores(a, ia, ra, units, sizes, task)
    sb = unit_scores(b, ib, rb, units, sizes, task)
    diff = sa - sb
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(diff), size=(resamples, len(diff)))
    boot = (diff[draws] * sizes[draws]).sum(1) / sizes[draws].sum(1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return {
        "task": task.name,
        "metric": task.primary_metric,
        "questions": len(items),
        "units": len(units),
        "a": {"cell": str(a), "method": ia.get("method"), "budget": ia.get("budget"), "score": ra["primary"]},
        "b": {"cell": str(b), "method": ib.get("method"), "budget": ib.get("budget"), "score": rb["primary"]},
        "difference": round(float((diff * sizes).sum() / sizes.sum()), 4),
        "units_a_ahead": int((diff > 0).sum()),
        "units_b_ahead": int((diff < 0).sum()),
        "units_tied": int((diff == 0).sum()),
        "interval_95": [round(float(low), 4), round(float(high), 4)],
        "resamples": resamples,
        "seed": seed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="a cell's folder")
    ap.add_argument("b", type=Path, help="the cell to compare it with (the same questions and setting)")
    ap.add_argument("--resamples", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the comparison here (JSON)")
    args = ap.parse_args()
    try:
        if args.resamples < 1:
            raise DataError(f"--resamples must be >= 1, got {args.resamples}")
        r = compare(args.a, args.b, args.resamples, args.seed)
    except MmOvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a, b = r["a"], r["b"]
    print(
        f"{r['task']} ({r['metric']}), {r['questions']} questions in {r['units']} units (an image or a context)"
    )
    print(f"A {a['method']} @ {a['budget']}: {a['score']:.2f}")
    print(f"B {b['method']} @ {b['budget']}: {b['score']:.2f}")
    print(
        f"A - B = {r['difference']:+.2f}, 95% interval [{r['interval_95'][0]:+.2f}, {r['interval_95'][1]:+.2f}]"
        f" over units; A ahead in {r['units_a_ahead']}, B in {r['units_b_ahead']}, tied in {r['units_tied']}"
    )
    if args.out:
        atomic_write_json(args.out, r, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
