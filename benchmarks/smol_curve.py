"""The learning curve of `mm-oval train-smol` runs, read from their `OUT/log.jsonl`: the mean training loss per
block of steps, every held-out check (% right and answer loss, with the image and with the blank image) and,
for two runs or more, each run's loss against the first run's on the steps both logged.

`train-smol` draws its scenes from a fixed stream (seed, image index), so two runs of one seed see the same
image at the same step: a branch (a copy of a checkpoint resumed with, say, another learning rate) is
compared to its trunk step by step, on the same questions. A step's loss is on an image the run has not yet
trained on, so the paired difference is a held-out measure with the scene-to-scene variation taken out.

    python benchmarks/smol_curve.py /work/smol-run /work/smol-hi --since 1850 --out curve.json

A step logged twice (a run stopped between checkpoints and resumed) counts once, as its last logging: the
resumed run redid it from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mm_oval.errors import DataError
from mm_oval.files import atomic_write_json


def read_log(folder: Path) -> tuple[dict[int, float], dict[int, dict]]:
    """(loss by step, held-out check by step) of one run folder."""
    path = folder / "log.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass a train-smol --out folder")
    losses: dict[int, float] = {}
    checks: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}, line {n}: not a train-smol log row ({e})") from None
        if "loss" in row:
            losses[step] = float(row["loss"])
        if "eval" in row:
            checks[step] = row["eval"]
    return losses, checks


def block_means(losses: dict[int, float], since: int, every: int) -> list[dict]:
    blocks: dict[int, list[float]] = {}
    for step, loss in losses.items():
        if step > since:
            blocks.setdefault(since + (step - since - 1) // every * every + 1, []).append(loss)
    return [
        {"from": s, "to": s + every - 1, "steps": len(v), "mean": sum(v) / len(v)}
        for s, v in sorted(blocks.items())
    ]


def paired(base: dict[int, float], other: dict[int, float], since: int) -> dict | None:
    """Mean and standard error of other - base over the steps after `since` both logged."""
    steps = sorted(s for s in base.keys() & other.keys() if s > since)
    if len(steps) < 2:
        return None
    d = [other[s] - base[s] for s in steps]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return {
        "steps": len(steps),
        "first": steps[0],
        "last": steps[-1],
        "mean_diff": mean,
        "stderr": math.sqrt(var / len(d)),
        "base_mean": sum(base[s] for s in steps) / len(steps),
        "other_mean": sum(other[s] for s in steps) / len(steps),
    }


def check_row(check: dict) -> dict:
    img, blank = check["image"], check["blank"]
    return {
        "n": img["n"],
        "right_image": img["all"],
        "right_blank": blank["all"],
        "loss_image": img.get("nll_all"),
        "loss_blank": blank.get("nll_all"),
    }


def fmt(x: float | None, digits: int) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="train-smol --out folders (the first is the base)")
    ap.add_argument("--since", type=int, default=0, help="only steps after this one")
    ap.add_argument("--every", type=int, default=100, help="steps per block of the loss means")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.every < 1 or args.since < 0:
        ap.error("--every must be >= 1 and --since >= 0")
    try:
        logs = [read_log(r) for r in args.runs]
    except DataError as e:
        ap.error(str(e))
    result: dict = {"since": args.since, "runs": []}
    for run, (losses, checks) in zip(args.runs, logs):
        blocks = block_means(losses, args.since, args.every)
        rows = {s: check_row(c) for s, c in sorted(checks.items()) if s > args.since}
        result["runs"].append({"run": str(run), "blocks": blocks, "checks": rows})
        print(f"\n{run}: {len(losses)} steps logged, the last {max(losses, default=0)}")
        print("| steps | mean loss |\n|---|---:|")
        for b in blocks:
            print(f"| {b['from']}-{b['to']} ({b['steps']}) | {b['mean']:.4f} |")
        if rows:
            print("\n| check at step | questions | % right: image / blank | answer loss: image / blank |")
            print("|---:|---:|---:|---:|")
            for s, r in rows.items():
                print(
                    f"| {s} | {r['n']} | {r['right_image']:.1f} / {r['right_blank']:.1f} | "
                    f"{fmt(r['loss_image'], 3)} / {fmt(r['loss_blank'], 3)} |"
                )
    base_losses = logs[0][0]
    for run, (losses, _) in zip(args.runs[1:], logs[1:]):
        p = paired(base_losses, losses, args.since)
        result.setdefault("paired", {})[str(run)] = p
        if p is None:
            print(f"\n{run} against {args.runs[0]}: fewer than two common steps after {args.since}")
            continue
        print(
            f"\n{run} against {args.runs[0]}, steps {p['first']}-{p['last']} ({p['steps']} in both): "
            f"mean loss {p['other_mean']:.4f} against {p['base_mean']:.4f}, "
            f"difference {p['mean_diff']:+.4f} +- {p['stderr']:.4f} (standard error)"
        )
    if args.out:
        atomic_write_json(args.out, result)


if __name__ == "__main__":
    main()
