"""benchmarks/bench_memory.py runs end to end at the tiny shapes and writes, per configuration, the KV and
summary bytes and the peak memory its request added (the figures are the benchmark's, not asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_memory_writes_kv_summary_and_peak_bytes_per_configuration(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "--small", "--batch", "1", "--images", "1",
         "--configs", "quest", "oval", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    rows = {r["config"]: r for r in d["rows"]}
    assert set(rows) == {"dense", "quest", "oval"}
    assert all(r["error"] is None and r["kv_bytes"] > 0 and r["peak_mib"] > 0 for r in rows.values())
    assert (
        rows["dense"]["summary_bytes"] == 0 < rows["quest"]["summary_bytes"] < rows["oval"]["summary_bytes"]
    )
    assert d["layer_kv_bytes"] > 0 and "peak_over_dense_mib" in rows["oval"]
    assert "one layer's full KV" in proc.stdout
