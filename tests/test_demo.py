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
def test_demo_shows_smollm2_on_text_and_on_images_by_default(
    capsys, tmp_path, monkeypatch, smollm2, bundled_smol
):
    asked = []
    loaded = {"smollm2": smollm2, "bundled-smol": bundled_smol}

    def load(name):  # the session's models, not a second load of the GGUF file (about 30 s here)
        asked.append(name)
        return loaded[name]

    monkeypatch.setattr(demo, "load_model", load)
    args = ["demo", "--methods", "keydiff", "--limit", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    assert asked == ["smollm2", "bundled-smol"]  # text first, then images
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| method | passkey_1k acc | s |"
    assert lines[1].startswith("| full | ") and lines[2].startswith("| keydiff | ")
    assert lines[3] == "| method | VQAv2 acc | s |"
    assert lines[4].startswith("| full | ") and lines[5].startswith("| keydiff | ")
    assert "SmolLM2-135M-Instruct (real attention)" in out and "compress=context" in out
    assert "bundled-smol: real attention" in out and "compress=image" in out
    run = tmp_path / "smollm2" / "passkey_1k" / "keydiff" / "results.json"
    assert run.is_file() and '"kv_fraction_kept"' in run.read_text()
    assert (tmp_path / "smol" / "vqav2" / "keydiff" / "results.json").is_file()


def test_demo_refuses_an_unknown_benchmark_and_checks_every_one_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(demo, "load_model", lambda name: pytest.fail(f"loaded {name}"))
    with pytest.raises(SystemExit) as e:  # argparse's refusal: usage and the error on stderr
        main(["demo", "--bench", "smol,text"])
    assert e.value.code == 2
    assert "unknown benchmark 'text': choose from smollm2, smol, 576, 64" in capsys.readouterr().err
    # the second benchmark's task check fails before the first benchmark's model loads
    assert main(["demo", "--bench", "576,64", "--tasks", "objlist", "--methods", "snapkv"]) == 2
    assert "objlist has no bundled dev set 'bundled'" in capsys.readouterr().err
