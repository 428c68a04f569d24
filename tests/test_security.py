"""Nothing a user or a download supplies is unpickled: training checkpoints load with weights_only=True,
model folders holding only pickled weights are refused unless allowed, and no custom model code runs."""

import json
import logging
import pathlib
import shutil

import pytest
import torch
from mm_oval.eval.runner import load_model

from mm_oval.cli import main
from mm_oval.errors import DataError, ModelError

pytestmark = pytest.mark.usefixtures("one_thread")


class _CreatesAFile:
    """Unpickling this calls `Path.touch(target)`: what a hostile checkpoint could do instead."""

    def __init__(self, target: pathlib.Path):
        self.target = target

    def __reduce__(self):
        return (pathlib.Path.touch, (self.target,))


def _hostile_checkpoint(path: pathlib.Path, target: pathlib.Path, **fields) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**fields, "settings": _CreatesAFile(target)}, path)
    return path


def test_a_kvp_resume_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    from mm_oval.policies.kvp import KVPAgentConfig
    from mm_oval.training.kvp import CHECKPOINT, KVPTrainConfig, train_agents

    target = tmp_path / "created_by_unpickling"
    _hostile_checkpoint(tmp_path / "run" / CHECKPOINT, target, step=0, history=[])
    cfg = KVPAgentConfig(num_layers=1, num_kv_heads=1, head_dim=8, proj=8, hidden=8, pos_table=16)
    with pytest.raises(DataError, match="not loaded"):
        train_agents([{}], cfg, KVPTrainConfig(steps=1), out_dir=tmp_path / "run")
    assert not target.exists()


def test_zoo_train_init_from_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    from mm_oval.zoo.train import TinyLlavaTrainConfig, Trainer

    target = tmp_path / "created_by_unpickling"
    ckpt = _hostile_checkpoint(tmp_path / "old" / "train_state.ckpt.pt", target, step=1)
    cfg = TinyLlavaTrainConfig(steps=1, vision_steps=1, vision_batch=2, images_per_batch=1, questions_per_image=1,
                      eval_items=1, init_from=str(ckpt))  # fmt: skip
    with pytest.raises(DataError, match="not loaded"):
        Trainer(tmp_path / "new", cfg).run()
    assert not target.exists()
    # the command says it in one line
    rc = main(["zoo", "train", "--out", str(tmp_path / "cli"), "--init-from", str(ckpt), "--steps", "1"])
    assert rc == 2 and not target.exists()


def _pickle_only_folder(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """A copy of a saved model whose weights are a pickled pytorch_model.bin instead of safetensors."""
    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    torch.save(state, dst / "pytorch_model.bin")
    return dst


def test_a_model_folder_with_only_pickled_weights_is_refused_unless_allowed(
    tiny_random_llava_dir, tmp_path, caplog
):
    folder = _pickle_only_folder(tiny_random_llava_dir, tmp_path / "bin_only")
    with pytest.raises(ModelError, match="pickled.*safetensors.*--allow-pickle-weights"):
        load_model(str(folder), device="cpu")
    with caplog.at_level(logging.WARNING, logger="mm_oval.modelfiles"):
        model, processor = load_model(str(folder), device="cpu", allow_pickle_weights=True)
    assert "safetensors is expected" in caplog.text
    assert model.config.model_type == "llava" and processor.tokenizer is not None
    # the commands refuse it too, in one line, and take the flag
    assert main(["chat", "--model", str(folder), "--prompt", "hi"]) == 2
    argv = ["eval", "--model", str(folder), "--task", "vqav2", "--data", "bundled", "--limit", "1"]
    argv += ["--max-new-tokens", "2", "--no-progress", "--dtype", "float32"]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2
    assert main([*argv, "--out", str(tmp_path / "allowed"), "--allow-pickle-weights"]) == 0


def test_a_config_that_needs_custom_code_is_refused_without_running_it(tmp_path, monkeypatch):
    """trust_remote_code stays off: a folder whose config names its own Python code is refused before any
    model is built, and the code never runs."""
    from transformers import LlavaForConditionalGeneration

    target = tmp_path / "created_by_remote_code"
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil-llava",
                "architectures": ["EvilModel"],
                "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"},
            }
        )
    )
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(target)!r}).touch()\n")

    def built(*args, **kwargs):
        raise AssertionError("a model was built from a config that is not LLaVA's")

    monkeypatch.setattr(LlavaForConditionalGeneration, "from_pretrained", built)
    for argv in (
        ["train-kvp", "--model", str(folder), "--data", "zoo:train:2", "--out", str(tmp_path / "k")],
        ["train-router", "--model", str(folder), "--data", "zoo:2", "--out", str(tmp_path / "r")],
    ):
        assert main(argv) == 2
    assert not target.exists()
