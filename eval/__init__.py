"""Evaluation harness: MMBench CircularEval, VQAv2 / TextVQA accuracy and POPE scored exactly as the
official scripts do; a resumable runner launched with accelerate; budget sweeps and plots.
Imported as `mm_oval.eval`.

    from mm_oval.eval import evaluate, load_model
    model, processor = load_model("llava-hf/llava-1.5-7b-hf")
    results = evaluate(model, processor, "mmbench", "mmbench_dev_20230712.tsv", method="full", out_dir="runs/mmb")
"""

from __future__ import annotations

from typing import Any

__all__ = ["evaluate", "load_model", "score_file", "get_task"]


def __getattr__(name: str) -> Any:
    # lazy: `import mm_oval.eval` stays light (the CLI imports it for --help)
    if name in ("evaluate", "load_model", "score_file"):
        from . import runner

        return getattr(runner, name)
    if name == "get_task":
        from .tasks import get_task

        return get_task
    raise AttributeError(f"module 'mm_oval.eval' has no attribute {name!r}")
