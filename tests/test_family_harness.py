"""The harness on tiny random LLaVA-NeXT, LLaVA-OneVision and Qwen2.5-VL folders: `mm-oval eval`, `sweep`
and `chat` load each with its own class and processor (chat template included) and run; the plain and the
budget-1.0 runs answer alike."""

from __future__ import annotations

import json

import pytest

from mm_oval.cli import main
from mm_oval.zoo.family import BUILDERS, random_image

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def folder(request, tmp_path_factory):
    model, processor = BUILDERS[request.param]()
    path = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_eval_and_sweep_run_on_each_class(folder, tmp_path):
    common = ["--task", "vqav2", "--data", "bundled", "--limit", "2", "--max-new-tokens", "3"]
    common += ["--dtype", "float32", "--no-progress"]
    for spec, out in (("full", "plain"), ("snapkv:budget=1.0", "same")):
        rc = main(["eval", "--model", str(folder), *common, "--method", spec, "--out", str(tmp_path / out)])
        assert rc == 0
    plain = json.loads((tmp_path / "plain" / "predictions_official.json").read_text())
    same = json.loads((tmp_path / "same" / "predictions_official.json").read_text())
    assert len(plain) == 2 and plain == same  # nothing evicted: the same answers
    rc = main(["sweep", "--model", str(folder), *common, "--methods", "knorm", "--budgets", "0.25",
               "--no-full", "--out", str(tmp_path / "sweep")])  # fmt: skip
    assert rc == 0


def test_chat_command_two_turns(folder, tmp_path, capsys):
    image = tmp_path / "image.png"
    random_image(48, 80, 1).save(image)
    argv = ["chat", "--model", str(folder), "--image", str(image), "--method", "snapkv", "--budget", "0.5"]
    argv += [
        "--max-new-tokens",
        "3",
        "--prompt",
        "what color is the circle ?",
        "--prompt",
        "why ?",
        "--stats",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "image KV kept" in out
