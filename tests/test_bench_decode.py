"""benchmarks/bench_decode.py runs end to end at the tiny shapes and writes, per configuration, the median
decode step, its ratio to the wrapped full cache's and the bytes read (the timings are the benchmark's, not
asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_writes_the_step_time_ratio_and_bytes_read_per_configuration(tmp_path):
    out = tmp_path / "decode.json"
    quest = "quest:read_bytes_budget=0.5,image_tile=4"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--small", "--batch", "1", "--images", "1",
         "--steps", "2", "--warmup", "0", "--methods", "full", quest, "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", quest}
    assert rows["full"]["vs_full"] == 1.0 and rows["full"]["read_vs_dense"] == 1.0
    # the tiny prompt's always-read text alone is above half of dense: less than dense is what holds
    assert 0 < rows[quest]["read_vs_dense"] < 1.0 and len(rows[quest]["steps_ms"]) == 2
    bad = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--small", "--methods", quest],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 2 and "--methods must include 'full'" in bad.stderr
