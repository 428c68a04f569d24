"""The benchmark scripts run end to end on the bundled model at their smallest sizes and write their
figures: a refactor that breaks one of them (a renamed type, a moved helper) fails here, not in a
user's hands. The figures themselves are the benchmarks' business, not asserted beyond their range."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{script}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_bench_retrieval_writes_every_methods_share_of_attention(tmp_path):
    d = _run("bench_retrieval", "--prompts", "2", "--cost-prompts", "1", "--cost-tokens", "2",
             "--repeats", "1", tmp_path=tmp_path)  # fmt: skip
    shares = {k: v for k, v in d["quality"].items() if "|" in k}
    methods = {k.split("|")[0] for k in shares}
    assert {"quest", "oracle", "random", "router"} <= methods and any(m.startswith("oval") for m in methods)
    assert all(0.0 <= v <= 1.0 + 1e-6 for v in shares.values())
    assert {"none", "quest"} <= set(d["cost"])


def test_bench_wrap_writes_time_and_memory_for_each_configuration(tmp_path):
    d = _run("bench_wrap", "--repeats", "1", "--new-tokens", "2", "--batch", "1",
             "--methods", "full", "snapkv:budget=0.25", "full:retrieval=quest", tmp_path=tmp_path)  # fmt: skip
    assert len(d["rows"]) >= 3


def test_bench_retrieval_writes_the_bytes_each_method_reads_and_its_quality_at_equal_bytes(tmp_path):
    d = _run("bench_retrieval", "--prompts", "1", "--ranks", "1", "--cost-prompts", "1", "--cost-tokens", "2",
             "--repeats", "1", tmp_path=tmp_path)  # fmt: skip
    rvd, at, rvd_b = d["read_vs_dense"], d["quality_at_bytes"], d["read_vs_dense_at_bytes"]
    methods = {k.split("|")[0] for k in d["quality"] if "|" in k}
    assert {k.split("|")[0] for k in rvd} == {k.split("|")[0] for k in at} == methods
    for m in methods:  # more pages read, more bytes; every budget reads at least what is always read
        assert 0 < rvd[f"{m}|0.1"] <= rvd[f"{m}|0.25"] <= rvd[f"{m}|0.5"]
        assert all(v > 0 for k, v in rvd_b.items() if k.startswith(f"{m}|"))
    assert rvd["quest|0.25"] > rvd["oracle|0.25"]  # the same pages' count, plus the summaries scanned
    assert all(0.0 <= v <= 1.0 + 1e-6 for v in at.values())
