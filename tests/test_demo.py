import pytest

from mm_oval import demo
from mm_oval.cli import main


def test_demo_prints_the_table_for_the_full_cache_and_a_method(capsys, tmp_path):
    args = ["demo", "--bench", "64", "--tasks", "vqav2", "--methods", "snapkv", "--limit", "5"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| method | VQAv2 acc | s |"
    assert lines[1].startswith("| full | ") and lines[2].startswith("| snapkv | ")
    assert "of full)" in lines[2]
    # the harness wrote its resumable runs where it was told to
    assert (tmp_path / "vqav2" / "snapkv" / "results.json").is_file()


def test_demo_shows_the_576_token_benchmark(capsys, tmp_path):
    args = ["demo", "--bench", "576", "--tasks", "vqav2,objlist", "--methods", "oval", "--limit", "3"]
    args += ["--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| method | VQAv2 acc | object list F1 | s |"
    assert lines[1].startswith("| full | ") and lines[2].startswith("| oval | ")
    assert "576 image tokens" in out
    assert (tmp_path / "objlist" / "oval" / "results.json").is_file()


@pytest.mark.real_lm
def test_demo_shows_smollm2_on_text_by_default(capsys, tmp_path, monkeypatch, smollm2):
    asked = []

    def load(name):  # the session's SmolLM2, not a second load of the GGUF file (about 30 s here)
        asked.append(name)
        return smollm2

    monkeypatch.setattr(demo, "load_model", load)
    args = ["demo", "--tasks", "passkey_1k", "--methods", "keydiff", "--limit", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    assert asked == ["smollm2"]
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| method | passkey_1k acc | s |"
    assert lines[1].startswith("| full | ") and lines[2].startswith("| keydiff | ")
    assert "SmolLM2-135M-Instruct (real attention)" in out and "compress=context" in out
    run = tmp_path / "passkey_1k" / "keydiff" / "results.json"
    assert run.is_file() and '"kv_fraction_kept"' in run.read_text()
