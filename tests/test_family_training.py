"""train-kvp and train-router on tiny random LLaVA-NeXT, LLaVA-OneVision and Qwen2.5-VL models saved to a
folder (smoke runs): each command trains for its own model, the traces carry the cache's image geometry,
and what was trained loads into `mm_oval.wrap` for that model and generates (another model is refused)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import mm_oval
from mm_oval.cli import main
from mm_oval.errors import ModelError
from mm_oval.geometry import GEOMETRY_INPUTS, image_geometry
from mm_oval.zoo.family import BUILDERS, mixed_batch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def saved(request, tmp_path_factory):
    model, processor = BUILDERS[request.param]()
    path = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return request.param, model, processor, path


def test_train_kvp_runs_and_its_agents_serve_the_model(saved, tmp_path):
    name, model, processor, path = saved
    out = tmp_path / "kvp"
    argv = ["train-kvp", "--model", str(path), "--data", "zoo:train:3", "--heldout-samples", "1"]
    argv += ["--out", str(out), "--steps", "2", "--batch", "3", "--device", "cpu"]
    assert main(argv) == 0
    # the traces hold the image tokens and (grid, row, col) the cache gives the agents at inference
    shard = load_file(str(next((out / "traces" / "train").glob("shard_*.safetensors"))))
    rc = next(v for k, v in shard.items() if k.endswith("image_rc"))
    mod = next(v for k, v in shard.items() if k.endswith("modality"))
    assert (rc[..., 0][mod == 1] >= 0).all() and (rc[..., 0][mod != 1] == -1).all()
    if name != "qwen2_5_vl":  # anyres: a base grid and a high-resolution grid per image
        assert int(rc[..., 0].max()) >= 1
    inputs = mixed_batch(processor)
    mm_oval.wrap(model, method="kvp", budget=0.25, method_options={"agents": str(out)})
    try:
        seq = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    finally:
        mm_oval.unwrap(model)
    assert seq.shape[1] == inputs["input_ids"].shape[1] + 3
    other = next(b for n, b in BUILDERS.items() if n != name)()[0]
    with pytest.raises(ModelError):
        mm_oval.wrap(other, method="kvp", budget=0.25, method_options={"agents": str(out)})


def test_train_router_runs_and_its_router_serves_the_model(saved, tmp_path):
    name, model, processor, path = saved
    out = tmp_path / "router"
    argv = ["train-router", "--model", str(path), "--out", str(out), "--device", "cpu"]
    argv += ["--data", "zoo:4", "--val", "zoo:2", "--epochs", "1", "--batch", "4"]
    assert main(argv) == 0
    inputs = mixed_batch(processor)
    plain = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    opts = {"weights": str(out)}
    mm_oval.wrap(model, retrieval="router", retrieval_options=opts, read_budget=1.0)
    try:
        assert model.generate(**inputs, max_new_tokens=3, do_sample=False).tolist() == plain.tolist()
        mm_oval.wrap(model, retrieval="router", retrieval_options=opts, read_budget=0.25, image_tile=2)
        seq = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    finally:
        mm_oval.unwrap(model)
    assert seq.shape == plain.shape


def test_the_geometry_of_a_loaded_folder_is_the_built_models(saved):
    """load_pretrained builds the folder's own class; its geometry is the in-process model's."""
    from mm_oval.modelfiles import load_pretrained

    name, model, processor, path = saved
    loaded, loaded_processor = load_pretrained(str(path))
    assert type(loaded) is type(model)
    inputs = mixed_batch(loaded_processor)
    kw = {k: inputs[k] for k in GEOMETRY_INPUTS if k in inputs}
    a = image_geometry(model, inputs["input_ids"], inputs["attention_mask"], **kw)
    b = image_geometry(loaded, inputs["input_ids"], inputs["attention_mask"], **kw)
    assert torch.equal(a.image_rc, b.image_rc) and a.image_tokens == b.image_tokens
