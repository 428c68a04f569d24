"""Model folders and learned parts are checked before they are used: a model that is not LLaVA-style is
refused before anything is built, broken model folders and truncated agent / router files are one clear
error each, and the learned router is checked against the model it is wrapped onto."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from mm_oval.eval.runner import load_model

import mm_oval
from mm_oval.cli import main
from mm_oval.errors import DataError, ModelError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def no_model_is_built(monkeypatch):
    """Any attempt to build a LLaVA from weights fails the test (the check must come first)."""
    from transformers import LlavaForConditionalGeneration

    def built(*args, **kwargs):
        raise AssertionError("a LLaVA model was built before the model type was checked")

    monkeypatch.setattr(LlavaForConditionalGeneration, "from_pretrained", built)


def test_training_commands_check_the_model_type_before_building_anything(tmp_path, no_model_is_built, capsys):
    folder = tmp_path / "gpt2"  # neither LLaVA-style nor a plain LM family wrap takes
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for argv in (
        ["train-kvp", "--model", str(folder), "--data", "zoo:train:2", "--out", str(tmp_path / "k")],
        ["train-router", "--model", str(folder), "--data", "zoo:2", "--out", str(tmp_path / "r")],
        ["zoo", "check", "--model", str(folder)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "'gpt2' model" in err and "LLaVA-style" in err and len(err.strip().splitlines()) == 1


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_broken_model_folders_are_clear_errors_that_name_the_folder(tiny_random_llava_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    truncated = _copy(tiny_random_llava_dir, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError, match=r"truncated.*model\.safetensors is truncated or corrupt"):
        load_model(str(truncated), device="cpu")
    assert main(["chat", "--model", str(truncated), "--prompt", "hi"]) == 2
    assert str(truncated) in capsys.readouterr().err

    no_weights = _copy(tiny_random_llava_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no_weights holds no weights \(expected model\.safetensors\)"):
        load_model(str(no_weights), device="cpu")

    # a tensor missing from the file: transformers would fill it with random values and say nothing to the caller
    partial = _copy(tiny_random_llava_dir, tmp_path / "partial")
    state = load_file(str(partial / "model.safetensors"))
    del state[next(k for k in sorted(state) if "up_proj" in k)]
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"1 missing.*up_proj.*random values"):
        load_model(str(partial), device="cpu")

    for name, files in (("no_image_processor", ["processor_config.json"]),
                        ("no_tokenizer", ["tokenizer.json", "tokenizer_config.json"])):  # fmt: skip
        folder = _copy(tiny_random_llava_dir, tmp_path / name)
        for f in files:
            (folder / f).unlink()
        with pytest.raises(ModelError, match=f"processor.*{name}.*save_pretrained"):
            load_model(str(folder), device="cpu")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_truncated_or_incomplete_agent_and_router_files_are_clear_errors(tiny_random_llava, tmp_path):
    from mm_oval.policies.kvp import KVPAgentConfig, KVPAgents, load_agents, save_agents
    from mm_oval.policies.kvp import model_signature as kvp_signature
    from mm_oval.policies.kvp_io import CONFIG_NAME, WEIGHTS_NAME
    from mm_oval.policies.router import CONFIG_FILE, WEIGHTS_FILE, load_router, save_router
    from mm_oval.training.router import new_router

    model, _ = tiny_random_llava
    cfg = KVPAgentConfig(num_layers=4, num_kv_heads=2, head_dim=32, proj=8, hidden=8, pos_table=64)
    agents = save_agents(KVPAgents(cfg), tmp_path / "agents", kvp_signature(model))
    _truncate(agents / WEIGHTS_NAME)
    with pytest.raises(ModelError, match=f"{WEIGHTS_NAME} is truncated or corrupt.*retrain or restore"):
        load_agents(agents)
    with pytest.raises(ModelError, match="truncated"):
        mm_oval.wrap(model, method="kvp", budget=0.25, method_options={"agents": str(agents)})
    assert not mm_oval.is_wrapped(model)
    incomplete = save_agents(KVPAgents(cfg), tmp_path / "incomplete", kvp_signature(model))
    text = json.loads((incomplete / CONFIG_NAME).read_text())
    del text["agent"]
    (incomplete / CONFIG_NAME).write_text(json.dumps(text))
    with pytest.raises(ModelError, match=f"{CONFIG_NAME} is incomplete"):
        load_agents(incomplete)

    router = save_router(new_router(model), tmp_path / "router")
    _truncate(router / WEIGHTS_FILE)
    with pytest.raises(DataError, match=f"{WEIGHTS_FILE} is truncated or corrupt"):
        load_router(router)
    other = save_router(new_router(model), tmp_path / "router2")
    (other / CONFIG_FILE).write_text("[]")
    with pytest.raises(DataError, match="not a valid router config"):
        load_router(other)


def test_the_router_is_checked_against_the_model_it_is_wrapped_onto():
    """As KVP agents are: another model's weights or another depth is a ModelError naming both."""
    from transformers import LlavaForConditionalGeneration

    from mm_oval.policies.kvp import model_signature
    from mm_oval.policies.router import bundled_router_path
    from mm_oval.zoo import bundled_model_path
    from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

    trained_for = json.loads((bundled_router_path() / "router.json").read_text())["model"]["fingerprint"]
    model, _ = build_tiny_llava(
        seed=1, sizes=TinyLlavaSizes(text_head_dim=64)
    )  # the bundled shapes, other weights
    with pytest.raises(ModelError, match=rf"fingerprint {trained_for}.*fingerprint {model_signature(model)['fingerprint']}"):  # fmt: skip
        mm_oval.wrap(model, retrieval="router", read_budget=0.25)
    assert not mm_oval.is_wrapped(model)
    shallow, _ = build_tiny_llava(seed=0, sizes=TinyLlavaSizes(text_layers=3, text_head_dim=64))
    with pytest.raises(ModelError, match=r"'num_layers': 4.*'num_layers': 3"):
        mm_oval.wrap(shallow, retrieval="router", read_budget=0.25)
    # the model it was trained for wraps, and its pages are read at the budget
    bundled = LlavaForConditionalGeneration.from_pretrained(bundled_model_path()).eval()
    mm_oval.wrap(bundled, retrieval="router", read_budget=0.25)
    mm_oval.unwrap(bundled)
    # a policy made by hand (no wrap) checks each layer's weights when its pages first close
    from mm_oval.policies.base import PageBatch, make_retrieval

    policy = make_retrieval("router")
    k = torch.zeros(1, 2, 1, 4, 64)
    pages = PageBatch(0, k, k, torch.ones(1, 2, 1, 4, dtype=torch.bool), torch.zeros(1, 2, 1, dtype=torch.int8), 0,
                      module=model.model.language_model.layers[0].self_attn)  # fmt: skip
    with pytest.raises(ModelError, match="layer 0 of this model has other weights"):
        policy.summarize(pages)


def test_a_sharded_model_folder_missing_a_shard_names_it(tiny_random_llava, tmp_path):
    model, processor = tiny_random_llava
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="1MB")
    processor.save_pretrained(folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    load_model(str(folder), device="cpu")  # complete: loads
    shards[-1].unlink()
    with pytest.raises(ModelError, match=f"sharded lacks the weights file {shards[-1].name}"):
        load_model(str(folder), device="cpu")
