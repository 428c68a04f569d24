"""The benchmark scripts run end to end on the bundled model at their smallest sizes and write their
figures: a refactor that breaks one of them (a renamed type, a moved helper) fails here, not in a
user's hands. The figures themselves are the benchmarks' business, not asserted beyond their range."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def _load_benchmark(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_probe_retrieval_oracle_scores_pages_by_their_exact_attention_and_reads_ovals_bytes(tiny_lm):
    """The diagnostic's oracle: a page's score is the share of softmax attention the KV head's query heads
    pay its keys (group mean), and it is charged OVAL's record bytes only, so at one bytes budget it reads as
    many pages as OVAL."""
    from types import SimpleNamespace

    import torch

    import mm_oval
    from mm_oval.wrapper import last_stats

    mod = _load_benchmark("probe_retrieval_oracle")
    g = torch.Generator().manual_seed(0)
    b, hkv, grp, p, t, d = 2, 3, 3, 5, 4, 8
    keys = torch.randn(b, hkv, p, t, d, generator=g)
    mask = torch.rand(b, hkv, p, t, generator=g) > 0.3
    mask[..., 0] = True
    q = torch.randn(b, hkv * grp, 1, d, generator=g)
    ctx = SimpleNamespace(summaries={mod.KEYS: keys, mod.MASK: mask}, query=q, num_kv_groups=grp, scaling=0.3)
    logits = torch.einsum("bhgd,bhptd->bhgpt", q[:, :, 0].reshape(b, hkv, grp, d), keys) * 0.3
    att = logits.masked_fill(~mask[:, :, None], float("-inf")).flatten(-2).softmax(-1).unflatten(-1, (p, t))
    torch.testing.assert_close(mod.OraclePages.score_pages(None, ctx).exp(), att.sum(-1).mean(2))
    # the output oracle: how far the head's output over the closed pages moves, to first order, when a page
    # goes unread and the rest is renormalised: a_p * |v_p - o|, v_p the page's attention-weighted values
    values = torch.randn(b, hkv, p, t, d, generator=g)
    ctx.summaries[mod.VALUES] = values
    share = att.sum(-1)  # (b, hkv, grp, p)
    v_page = torch.einsum("bhgpt,bhptd->bhgpd", att, values) / share.unsqueeze(-1)
    out = (share.unsqueeze(-1) * v_page).sum(-2, keepdim=True)
    for j in range(p):  # leaving page j out moves the output by exactly a_p (o - v_p) / (1 - a_p)
        rest = torch.ones(p, dtype=torch.bool)
        rest[j] = False
        exact = (share[..., rest, None] * v_page[..., rest, :]).sum(-2) / share[..., rest].sum(
            -1, keepdim=True
        )
        first = share[..., j, None] * (v_page[..., j, :] - out[..., 0, :]) / (1 - share[..., j, None])
        torch.testing.assert_close(exact - out[..., 0, :], -first)
    want = (share * (v_page - out).norm(dim=-1)).mean(2)
    torch.testing.assert_close(mod.OutputOraclePages.score_pages(None, ctx).exp(), want)

    oracles = (mod.OraclePages.name, mod.OutputOraclePages.name)
    mod.RETRIEVAL_REGISTRY.update({o.name: o for o in mod.ORACLES.values()})
    try:
        ids = torch.randint(1, 300, (1, 400), generator=g)
        reads = {}
        for heads in ("uniform", "shared"):  # `--read-head-budget`: the heads of a layer share the bytes too
            for method in ("oval", *oracles):
                with mm_oval.wrapped(
                    tiny_lm, retrieval=method, read_bytes_budget=0.25, read_head_budget=heads
                ):
                    tiny_lm.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
                    reads[method, heads] = last_stats(tiny_lm)["bytes_read"]["total"]
    finally:
        for name in oracles:
            del mod.RETRIEVAL_REGISTRY[name]
    for heads in ("uniform", "shared"):
        oval = reads["oval", heads]
        assert oval["selected"] > 0
        assert all(reads[name, heads] == oval for name in oracles)


def test_smol_curve_compares_two_training_runs_step_by_step_on_the_steps_both_logged(tmp_path):
    """A branch of a train-smol run sees the same scenes at the same steps, so the curve pairs the two
    runs' losses by step; a step logged twice (a resumed run redid it) counts as its last logging."""

    def log(folder, rows):
        folder.mkdir()
        (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder)

    check = {"image": {"all": 40.0, "n": 8, "nll_all": 1.2}, "blank": {"all": 30.0, "n": 8, "nll_all": 1.3}}
    trunk = log(
        tmp_path / "trunk", [{"step": s, "loss": 1.0} for s in range(1, 7)] + [{"step": 6, "eval": check}]
    )
    branch_rows = [{"step": s, "loss": 1.0} for s in range(1, 4)]  # the common history
    branch_rows += [{"step": 4, "loss": 9.0}, {"step": 4, "loss": 0.5}, {"step": 5, "loss": 0.7}]  # 4 redone
    branch = log(tmp_path / "branch", branch_rows)
    d = _run("smol_curve", trunk, branch, "--since", "3", "--every", "2", tmp_path=tmp_path)
    p = d["paired"][branch]
    assert (p["steps"], p["first"], p["last"]) == (2, 4, 5)
    assert abs(p["mean_diff"] - ((0.5 - 1.0) + (0.7 - 1.0)) / 2) < 1e-9
    assert abs(p["stderr"] - 0.1) < 1e-9  # differences -0.5 and -0.3
    blocks = d["runs"][1]["blocks"]
    assert [(b["from"], b["steps"], round(b["mean"], 6)) for b in blocks] == [(4, 2, 0.6)]
    rows = d["runs"][0]["checks"]
    assert rows == {
        "6": {"n": 8, "right_image": 40.0, "right_blank": 30.0, "loss_image": 1.2, "loss_blank": 1.3}
    }

    (tmp_path / "trunk" / "log.jsonl").write_text('{"step": 1, "loss": 1.0}\nnot json\n')
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "smol_curve.py"), trunk, branch],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and "log.jsonl, line 2" in proc.stderr and "Traceback" not in proc.stderr


def test_blank_images_copies_a_data_folder_with_every_image_grey(tmp_path):
    from PIL import Image

    src = tmp_path / "data"
    (src / "images").mkdir(parents=True)
    Image.new("RGB", (40, 30), (255, 0, 0)).save(src / "images" / "a.png")
    (src / "questions.json").write_text('{"q": 1}')
    script = [sys.executable, str(ROOT / "benchmarks" / "blank_images.py")]
    proc = subprocess.run([*script, str(src), str(tmp_path / "blank")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with Image.open(tmp_path / "blank" / "images" / "a.png") as im:
        assert im.size == (40, 30) and im.convert("RGB").getcolors() == [(40 * 30, (128, 128, 128))]
    assert (tmp_path / "blank" / "questions.json").read_text() == '{"q": 1}'
    with Image.open(src / "images" / "a.png") as im:  # the source is left as it was
        assert im.getpixel((0, 0)) == (255, 0, 0)
    proc = subprocess.run([*script, str(src), str(tmp_path / "blank")], capture_output=True, text=True)
    assert proc.returncode == 2 and "exists" in proc.stderr


def test_kvp_temperature_layer_shares_are_what_one_ranking_over_every_layer_keeps():
    """benchmarks/kvp_temperature.py reports how far the calibrated ranking over every layer moves from the
    same count per layer: a layer whose head puts all its mass on one token gives up the rest of its count
    to a layer whose mass is spread, and a temperature that flattens a head changes that."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kvp_temperature import layer_shares

    raw = torch.stack([torch.tensor([[20.0] + [0.0] * 9]), torch.zeros(1, 10)])  # (L 2, H 1, n 10)
    ones = torch.ones(2, 1)
    # 10%: one token per layer's head in all, two in all: layer 0's peak (log share ~0) and one of layer 1's
    # (log 0.1); layer 0's other tokens (log share ~ -20) lose to layer 1's
    torch.testing.assert_close(layer_shares(raw, ones, 0.1), torch.tensor([1.0, 1.0], dtype=torch.float64))
    # 50%: ten in all: layer 0 keeps its peak alone (0.1 of its tokens = 0.2 of the budget), layer 1 nine
    torch.testing.assert_close(layer_shares(raw, ones, 0.5), torch.tensor([0.2, 1.8], dtype=torch.float64))
    # both heads peaked, layer 0's at temperature 0.01: nearly flat there (log shares -2.12 and -2.32), so
    # layer 1 keeps its peak (~0) alone and layer 0 the other nine
    peaked = torch.stack([raw[0], raw[0]])
    flat0 = torch.tensor([[0.01], [1.0]])
    torch.testing.assert_close(
        layer_shares(peaked, flat0, 0.5), torch.tensor([1.8, 0.2], dtype=torch.float64)
    )


def test_paired_cells_compares_two_cells_unit_by_unit_and_refuses_cells_it_cannot_pair(tmp_path):
    """benchmarks/paired_cells.py: two cells of one sweep are scored again per image, their scores are the
    cells' own, and the difference, the units each is ahead in and the interval follow from the predictions;
    cells of other questions, or whose score is not the mean over images, are refused with the reason."""
    import shutil
    from collections import Counter

    import pytest
    from mm_oval.eval.sweep import run_sweep
    from mm_oval.eval.tasks import get_task, resolve_data

    from mm_oval.errors import DataError, ResultsError
    from mm_oval.modelfiles import load_model

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from paired_cells import compare

    model, processor = load_model("bundled", device="cpu", dtype="float32")
    task = get_task("vqav2")
    data = resolve_data("bundled", task)
    s = run_sweep(model, processor, "vqav2", data, ["streamingllm"], [0.1], tmp_path / "sw", limit=12,
                  max_new_tokens=3, progress=False)  # fmt: skip
    full, cell = tmp_path / "sw" / "full", tmp_path / "sw" / s["cells"][0]["dir"]
    items = task.load(data, limit=12)
    images = len({it.group for it in items})
    r = compare(full, cell, resamples=200)
    assert r["questions"] == 12 and r["units"] == images > 1
    assert r["a"]["score"] == json.loads((full / "results.json").read_text())["primary"]
    assert r["b"]["score"] == json.loads((cell / "results.json").read_text())["primary"]
    assert r["units_a_ahead"] + r["units_b_ahead"] + r["units_tied"] == images
    # cells made by the command line name a bundled dev set by its name, not its path
    for d in (full, cell):
        run = json.loads((d / "run.json").read_text())
        run["identity"]["data"] = "bundled"
        (d / "run.json").write_text(json.dumps(run))
    assert compare(full, cell, resamples=200) == r

    # two hand-made cells on the same questions: every answer right, and every answer wrong but one
    right = {it.id: Counter(a["answer"] for a in it.meta["answers"]).most_common(1)[0][0] for it in items}
    wrong = {it.id: "no such answer" for it in items} | {items[0].id: right[items[0].id]}
    for name, preds in (("right", right), ("wrong", wrong)):
        shutil.copytree(full, tmp_path / name)
        res = json.loads((tmp_path / name / "results.json").read_text())
        task.write_predictions(tmp_path / name / res["official_predictions"], items, preds)
        res["primary"] = round(task.primary(task.score(items, preds)), 2)
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    r = compare(tmp_path / "right", tmp_path / "wrong", resamples=500)
    assert r["a"]["score"] == 100.0 and r["b"]["score"] == pytest.approx(100 / 12, abs=0.01)
    assert r["difference"] == pytest.approx(100 - 100 / 12, abs=1e-3)
    # every image has a wrong answer in B, the first image's other questions too unless it has one question
    assert r["units_a_ahead"] + r["units_tied"] == images and r["units_b_ahead"] == 0
    assert 0.0 <= r["interval_95"][0] <= r["difference"] <= r["interval_95"][1] <= 100.0

    # a score that is not the mean of its units' (here: edited) is refused, and so are other questions
    res = json.loads((tmp_path / "wrong" / "results.json").read_text())
    (tmp_path / "wrong" / "results.json").write_text(json.dumps({**res, "primary": 50.0}))
    with pytest.raises(ResultsError, match="not the question-weighted mean"):
        compare(tmp_path / "right", tmp_path / "wrong")
    run = json.loads((tmp_path / "right" / "run.json").read_text())
    run["identity"]["limit"] = 11
    (tmp_path / "right" / "run.json").write_text(json.dumps(run))
    with pytest.raises(DataError, match="limit: 11 against 12"):
        compare(tmp_path / "right", full)
    with pytest.raises(DataError, match="no run.json"):
        compare(tmp_path / "sw", full)


def test_probe_answer_pages_forces_the_answers_pages_and_reads_layers_densely(
    tiny_lm, byte_tokenizer, tmp_path
):
    """benchmarks/probe_answer_pages.py: the answer's tokens are found in the context; `as is` is the
    configuration's own answer; forcing the answer's pages, or reading every layer densely, makes every KV
    head of every layer read all of them at every decode step, where the selection alone does not."""
    from mm_oval.eval.tasks import get_task
    from mm_oval.eval.textgen import generate_text

    import mm_oval
    from mm_oval.config import OvalConfig

    mod = _load_benchmark("probe_answer_pages")
    (tmp_path / "longtext.json").write_text(json.dumps({"seed": 7, "per_length": 2, "lengths": {"1k": 40}}))
    item = get_task("message_1k").load(tmp_path, limit=1)[0]
    span = mod.answer_span(byte_tokenizer, item)
    head_ids, _ = mod.split_prompt(byte_tokenizer, item, tiny_lm.device)
    assert byte_tokenizer.decode(head_ids[0, span[0] : span[-1] + 1]).lower() == item.meta["message"].lower()

    spec = "oval:read_budget=0.25"
    layers = tiny_lm.config.num_hidden_layers
    rows = mod.probe(tiny_lm, byte_tokenizer, "message_1k", [item], spec, widen=4, dense=[(0, layers)],
                     max_new_tokens=6, trace=True)  # fmt: skip
    v = rows[0]["variants"]
    with mm_oval.wrapped(tiny_lm, OvalConfig.from_spec(spec)):
        own = generate_text(tiny_lm, byte_tokenizer, [item], 6, compress="context")[0][0]
    assert v["as is"]["answer"] == own
    assert len(rows[0]["trace"]) > 0 and {"answer read (+-4)", f"dense 0:{layers}"} <= set(v)

    kv_heads = tiny_lm.config.num_key_value_heads
    trace: list = []
    with (
        mm_oval.wrapped(tiny_lm, OvalConfig.from_spec(spec)),
        mod.patched_reads((span[0], span[-1]), True, None, trace),
    ):
        generate_text(tiny_lm, byte_tokenizer, [item], 6, compress="context")
    assert trace and all(shares == [1.0] * kv_heads for _, shares in trace)
    dense: list = []  # layers read densely read every page, the answer's among them
    with (
        mm_oval.wrapped(tiny_lm, OvalConfig.from_spec(spec)),
        mod.patched_reads((span[0], span[-1]), dense=(0, layers), trace=dense),
    ):
        generate_text(tiny_lm, byte_tokenizer, [item], 6, compress="context")
    assert dense and all(shares == [1.0] * kv_heads for _, shares in dense)
    unforced: list = []  # the selection alone leaves some of them unread
    with (
        mm_oval.wrapped(tiny_lm, OvalConfig.from_spec(spec)),
        mod.patched_reads((span[0], span[-1]), trace=unforced),
    ):
        generate_text(tiny_lm, byte_tokenizer, [item], 6, compress="context")
    assert unforced and any(min(shares) < 1.0 for _, shares in unforced)
    assert mod.decode.read_pages is not None and mod.decode.read_pages.__name__ == "read_pages"
    assert mod.decode.read_pages.__module__ == "mm_oval.cache.decode"  # restored


def test_retrieval_layer_budget_gives_the_read_bytes_to_the_layers_whose_recall_rises_most():
    """benchmarks/retrieval_layer_budget.py divides a mean read fraction over the layers from each layer's
    measured recall curve: by the mass kept, to the layer that gains most per byte; by the log of the mass
    missed, to the layer whose missed mass falls by the largest factor; the mean stays the target, a layer
    read densely (never measured) keeps the target, and the smallest budget measured is each layer's floor."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from retrieval_layer_budget import fit_fractions

    from mm_oval.errors import MmOvalError

    # layer 0 diffuse (recall grows with what it reads), layer 1 near-saturated, layer 2 read densely
    curves = {"0.1": {"recall": [0.2, 0.9, None]}, "0.5": {"recall": [0.6, 0.99, None]}}
    mass = fit_fractions(curves, 0.3, "mass")
    assert sum(mass) / 3 == pytest.approx(0.3, abs=0.003) and mass[2] == 0.3
    assert mass[0] == pytest.approx(0.5, abs=0.003) and mass[1] == pytest.approx(0.1)  # 1.0/0.4 vs 0.09/0.4
    log = fit_fractions(curves, 0.3, "log")
    assert log[1] > log[0] >= 0.1  # missed mass 10x down (0.1 -> 0.01) beats 2x down (0.8 -> 0.4)
    with pytest.raises(MmOvalError, match="below the smallest budget measured"):
        fit_fractions(curves, 0.05)


def test_probe_unread_estimate_measures_the_two_estimates_against_exact_attention(tiny_lm):
    """benchmarks/probe_unread_estimate.py: on one decode step, the unread pages' exact log-mass is what a
    float LOCKS record that spans each page's keys estimates ("scored", to float rounding), and the key-mean
    estimate ("centroid") never exceeds it (Jensen); the shares and output errors come with them. Recording
    leaves the step's output unchanged and restores the decode path afterwards."""
    import torch

    import mm_oval
    from mm_oval.wrapper import prefill

    mod = _load_benchmark("probe_unread_estimate")
    ids = torch.randint(1, 300, (1, 300), generator=torch.Generator().manual_seed(0))
    spec = {"retrieval": "locks", "retrieval_options": {"rank": 16, "summary_format": "float"}}
    with mm_oval.wrapped(tiny_lm, read_budget=0.25, unread_pages="scored", **spec):
        cache = prefill(tiny_lm, input_ids=ids)
        layer = cache.layers[1]
        D = layer.store.keys.shape[-1]
        query = 3 * torch.randn(
            1, tiny_lm.config.num_attention_heads, 1, D, generator=torch.Generator().manual_seed(1)
        )
        pages = layer.read_pages(query, D**-0.5)
        e = mod.step_errors(layer, query, pages, D**-0.5)
        rows: dict = {}
        plain = layer.attend(query, D**-0.5)
        with mod.recorded(rows):
            seen = layer.attend(query, D**-0.5)
    assert e["true_lse"].numel() > 0
    torch.testing.assert_close(e["scored_lse"], e["true_lse"], rtol=1e-4, atol=1e-4)
    assert bool((e["centroid_lse"] <= e["true_lse"] + 1e-4).all())
    assert bool((e["centroid_lse"] < e["true_lse"] - 1e-3).any())
    assert bool((e["scored_share"] - e["true_share"]).abs().max() < 1e-4)
    torch.testing.assert_close(seen, plain)
    assert list(rows) == [1] and set(rows[1][0]) == set(e)
    assert mod.decode.add_unread_pages.__module__ == "mm_oval.cache.decode"  # restored
    table = mod.summarize({0: [e], 1: [e]}, groups=2)
    assert [r["layers"] for r in table] == ["0-0", "1-1", "all"]
    assert table[-1]["scored_share_abs_err"] < 1e-4 < table[-1]["centroid_share_abs_err"]
