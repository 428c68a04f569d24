"""Fit how a retrieval method's read bytes are divided over the layers (`read_layer_budget`) on SmolLM2.

On training contexts of the long-context text tasks (eval/longtext.py's generator on the training seed,
never a dev set's), question-agnostic as the harness runs them, it generates each answer under the
retrieval spec at each of `--budgets` (read_bytes_budget, every layer within the same budget) with
`monitor_retrieval`, and records each layer's attention-mass recall at the one-token decode steps (the
stats' `layer_attention_mass_recall`: the share of the step's exact attention on the tokens read). With
the recall of each layer as a function of its read fraction (piecewise linear between the budgets measured,
1 at every page), it divides `layers x --target` of read fraction over the layers, greedily in steps of
0.005 from the smallest budget measured, the layer that gains most next, by `--objective`:
- `mass`: the attention mass kept, summed over the layers;
- `log`: the log of the mass missed, summed over the layers (halving a layer's missed mass counts the same
  in every layer).
A layer's weight is its fraction over the target (they average 1); `read_layer_budget=<file>` then reads
layer l within `weight_l x` any budget. With `--evaluate B,...` it then scores the division against the
uniform one on the next `--per-kind` training contexts of each kind (not those it was fitted on) at those
budgets. Learned here (from the model's attention on training contexts); nothing is fitted on a dev set.

    python benchmarks/retrieval_layer_budget.py --out runs/division-mass.json --evaluate 0.18,0.25
    python benchmarks/retrieval_layer_budget.py --curves runs/division-mass.json --objective log \
        --out runs/division-log.json --evaluate 0.18,0.25
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from mm_oval.eval import longtext
from mm_oval.eval.textgen import generate_text

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.errors import MmOvalError
from mm_oval.files import atomic_write_json
from mm_oval.stats import get_stats
from mm_oval.training.traces import LONGTEXT_LENGTHS, LONGTEXT_SEED_BASE

DEFAULT_SPEC = "oval:read_head_budget=shared,read_chunks=dense"
STEP = 0.005


def training_items(
    kinds: list[str], length: str, per_kind: int, skip: int = 0
) -> list[tuple[str, list[Any]]]:
    """Per kind, `per_kind` training contexts (one question each) on the training seed, after its first
    `skip`."""
    spec = {"seed": LONGTEXT_SEED_BASE, "per_length": skip + per_kind,
            "lengths": {length: LONGTEXT_LENGTHS[length]}}  # fmt: skip
    out = []
    for kind in kinds:
        seen, items = set(), []
        for it in longtext.generate(kind, length, spec):
            if it.group not in seen:
                seen.add(it.group)
                items.append(it)
        out.append((kind, items[skip:]))
    return out


def score(model: Any, processor: Any, cfg: OvalConfig, data: list[tuple[str, list[Any]]], length: str,
          on_request: Any = None) -> dict[str, float]:  # fmt: skip
    """Each kind's accuracy (the task's own rule) under `cfg`, question-agnostic."""
    out = {}
    for kind, items in data:
        task = longtext.TASK_CLASSES[f"{kind}_{length}"]()
        with mm_oval.wrapped(model, cfg):
            answers = generate_text(model, processor, items, task.max_new_tokens, "context", on_request)
        out[kind] = task.score(items, {it.id: a[0] for it, a in zip(items, answers)})[task.primary_metric]
    return out


def measure_curves(
    model: Any, processor: Any, spec: str, budgets: list[float], kinds: list[str], length: str, per_kind: int
) -> dict[str, Any]:
    """Per budget: each layer's mean attention-mass recall over the contexts, and each kind's accuracy."""
    layers = model.config.get_text_config().num_hidden_layers
    curves: dict[str, Any] = {}
    data = training_items(kinds, length, per_kind)
    for b in budgets:
        cfg = OvalConfig.from_spec(spec, read_bytes_budget=b, monitor_retrieval=True)
        sums, counts = [0.0] * layers, [0] * layers

        def collect(sums: list[float] = sums, counts: list[int] = counts) -> None:
            per_layer = get_stats(model)["retrieval_monitor"]["layer_attention_mass_recall"]
            for li, r in enumerate(per_layer):
                if r is not None:
                    sums[li] += r
                    counts[li] += 1

        t0 = time.time()
        scores = score(model, processor, cfg, data, length, collect)
        recall = [s / c if c else None for s, c in zip(sums, counts)]
        curves[str(b)] = {"recall": recall, "accuracy": scores}
        print(f"budget {b}: accuracy {scores}; recall by layer "
              + " ".join("-" if r is None else f"{r:.2f}" for r in recall) + f" ({time.time() - t0:.0f} s)",
              flush=True)  # fmt: skip
    return curves


OBJECTIVES = {
    "mass": lambda r: r,
    "log": lambda r: -math.log(max(1.0 - r, 1e-3)),
}


def fit_fractions(curves: dict[str, Any], target: float, objective: str = "mass") -> list[float]:
    """Each layer's read fraction, averaging `target`, that maximises `objective` summed over the layers
    (see the module's doc). A layer never measured (read densely) keeps `target`."""
    gain = OBJECTIVES[objective]
    budgets = sorted(float(b) for b in curves)
    if not budgets[0] <= target <= 1.0:
        raise MmOvalError(f"--target {target} is below the smallest budget measured ({budgets[0]})")
    layers = len(curves[str(budgets[0])]["recall"])
    xs = [*budgets, 1.0] if budgets[-1] < 1.0 else budgets

    def recall(li: int, f: float) -> float:
        ys = [curves[str(b)]["recall"][li] for b in budgets] + ([1.0] if budgets[-1] < 1.0 else [])
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if f <= x1:
                return y0 + (y1 - y0) * (f - x0) / (x1 - x0)
        return ys[-1]

    measured = [li for li in range(layers) if curves[str(budgets[0])]["recall"][li] is not None]
    frac = [budgets[0] if li in measured else target for li in range(layers)]
    left = round((target * layers - sum(frac)) / STEP)
    for _ in range(max(left, 0)):
        gains = [(gain(recall(li, min(frac[li] + STEP, 1.0))) - gain(recall(li, frac[li])), li)
                 for li in measured if frac[li] < 1.0]  # fmt: skip
        _, best = max(gains)
        frac[best] = min(frac[best] + STEP, 1.0)
    return frac


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="the retrieval spec, without its bytes budget")
    ap.add_argument("--kinds", default="message,passkey")
    ap.add_argument("--length", default="1k")
    ap.add_argument("--per-kind", type=int, default=8)
    ap.add_argument("--budgets", default="0.12,0.18,0.25,0.35,0.5,0.7")
    ap.add_argument("--target", type=float, default=0.25, help="the bytes budget the division is fitted at")
    ap.add_argument("--objective", choices=sorted(OBJECTIVES), default="mass")
    ap.add_argument("--curves", default=None, help="refit from the curves of an earlier --out instead")
    ap.add_argument("--evaluate", default="", help="budgets at which to score the division against uniform")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        model = processor = None
        if a.curves:
            try:
                old = json.loads(open(a.curves).read())
                curves, fitted = old["curves"], old["fitted"]
            except (OSError, ValueError, KeyError) as e:
                raise MmOvalError(f"--curves {a.curves}: not a file this script wrote ({e})") from e
        else:
            from mm_oval.modelfiles import load_model

            model, processor = load_model(a.model, device="cpu", dtype="float32")
            budgets = [float(b) for b in a.budgets.split(",")]
            kinds = a.kinds.split(",")
            curves = measure_curves(model, processor, a.spec, budgets, kinds, a.length, a.per_kind)
            fitted = {"model": a.model, "spec": a.spec, "kinds": kinds, "length": a.length,
                      "contexts_per_kind": a.per_kind, "seed": LONGTEXT_SEED_BASE}  # fmt: skip
        frac = fit_fractions(curves, a.target, a.objective)
    except MmOvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mean = sum(frac) / len(frac)
    weights = [round(f / mean, 4) for f in frac]
    weights[-1] = round(len(weights) - sum(weights[:-1]), 4)  # the rounding kept out of the mean
    args = sys.argv[1:] if argv is None else argv
    fitted = {**fitted, "target": a.target, "objective": a.objective,
              "command": "python benchmarks/retrieval_layer_budget.py " + " ".join(args)}  # fmt: skip
    out: dict[str, Any] = {"weights": weights, "fitted": fitted, "curves": curves}
    atomic_write_json(a.out, out, indent=1)
    print("weights:", " ".join(f"{w:.2f}" for w in weights))
    if a.evaluate:
        if model is None:
            from mm_oval.modelfiles import load_model

            model, processor = load_model(fitted["model"], device="cpu", dtype="float32")
        kinds, n = fitted["kinds"], fitted["contexts_per_kind"]
        data = training_items(kinds, fitted["length"], n, skip=n)  # the next contexts, not those fitted on
        rows = []
        for b in (float(x) for x in a.evaluate.split(",")):
            for name in ("uniform", a.out):
                cfg = OvalConfig.from_spec(fitted["spec"], read_bytes_budget=b, read_layer_budget=name)
                got = score(model, processor, cfg, data, fitted["length"])
                rows.append({"budget": b, "division": "uniform" if name == "uniform" else a.objective, **got})
                print(f"budget {b} {rows[-1]['division']:8s} " + " ".join(f"{k} {v:.1f}" for k, v in got.items()),
                      flush=True)  # fmt: skip
        out["evaluated"] = {"contexts_per_kind": n, "after": n, "rows": rows}
        atomic_write_json(a.out, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
