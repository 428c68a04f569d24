"""`mm_oval.chat`: the Chat helper and `mm-oval chat` on a tiny random LLaVA. A conversation must say
exactly what the evaluation harness's multi-turn mode says, prefill the image once, keep the budget's
image tokens across turns, and report what the cache kept and which pages retrieval read."""

import io
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.chat import Chat
from mm_oval.cli import main
from mm_oval.cli_chat import run
from mm_oval.errors import ConfigError, DataError, ModelError
from mm_oval.registry import known_methods

QUESTIONS = ["what color is the circle ?", "how many blue objects are there ?", "is there a red square ?"]
QUESTIONS_SQUARE = "what color is the square ?"


def _scene(color: str = "red", size: int = 128) -> Image.Image:
    im = Image.new("RGB", (size, size), "black")
    im.paste(Image.new("RGB", (size // 4, size // 4), color), (size // 8, size // 2))
    return im


@pytest.fixture(scope="module")
def image_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "scene.png"
    _scene().save(path)
    return path


def _harness(model, processor, image, spec, budget, questions, max_new):
    from mm_oval.eval.runner import apply_method, generate_conversation, remove_method
    from mm_oval.eval.tasks import Item

    items = [Item(id=str(i), prompt=q, image=lambda: image, group="g") for i, q in enumerate(questions)]
    wrapped = apply_method(model, spec, budget)
    try:
        return [text for text, _ in generate_conversation(model, processor, items, max_new)]
    finally:
        if wrapped:
            remove_method(model)


def test_conversation_says_what_the_harness_says(tiny_random_llava):
    """Two chats (full cache, SnapKV at 25%) interleaved on one model answer each turn exactly as the
    harness's multi-turn conversation does; the model is left unwrapped."""
    model, processor = tiny_random_llava
    image = _scene("blue")
    full = Chat(model, processor, image, max_new_tokens=5)
    snap = Chat(model, processor, image, method="snapkv", budget=0.25, max_new_tokens=5)
    got_full, got_snap = [], []
    for q in QUESTIONS:
        got_full.append(full.ask(q))
        got_snap.append(snap.ask(q))
    assert not mm_oval.is_wrapped(model)
    assert got_full == _harness(model, processor, image, "full", None, QUESTIONS, 5)
    assert got_snap == _harness(model, processor, image, "snapkv", 0.25, QUESTIONS, 5)
    assert full.history == list(zip(QUESTIONS, got_full))
    assert all(isinstance(a, str) for a in got_full)


def test_image_is_prefilled_and_compressed_once(tiny_random_llava):
    model, processor = tiny_random_llava
    calls = []
    hook = model.model.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    try:
        chat = Chat(model, processor, _scene(), method="snapkv", budget=0.25, max_new_tokens=4)
        for q in QUESTIONS:
            chat.ask(q)
    finally:
        hook.remove()
    assert len(calls) == 1  # the image went through the vision tower once, for the first turn
    first, *later = chat.turns
    assert first.prompt_tokens > 64  # the 64 image tokens and the question
    assert all(t.prompt_tokens < 20 for t in later)  # only the new text of each later turn
    kept = chat.kept_image_tokens()
    n_layers = model.config.text_config.num_hidden_layers
    assert kept.shape == (n_layers, 2, 8, 8) and kept.dtype == torch.bool
    assert (kept.sum((-1, -2)) == math.ceil(0.25 * 64)).all()  # still the budget after three turns
    s = chat.stats()
    assert s["turns"] == 3 and s["image_kv_fraction_kept"] == pytest.approx(0.25)
    text_kept = sum(r["text_tokens_kept"] for r in s["layers"])
    per_token = 2 * model.config.text_config.head_dim * 4 * 2  # keys + values, fp32, 2 KV heads
    assert s["kv_bytes_kept"] == (text_kept + 16 * n_layers) * per_token
    # the conversation so far is the prompt plus every answer and turn; the cache holds 16 image tokens of 64
    assert s["cache_tokens"] > sum(t.prompt_tokens for t in chat.turns)
    assert s["cache_slots"] == pytest.approx(s["cache_tokens"] - 48)
    chat.reset()
    with pytest.raises(ConfigError, match="ask a question first"):
        chat.stats()


def test_full_cache_keeps_every_patch_of_every_image(tiny_random_llava):
    model, processor = tiny_random_llava
    chat = Chat(model, processor, images=[_scene("red"), _scene("green")], max_new_tokens=3)
    chat.ask("what color is the square ?")
    assert chat.turns[0].prompt_tokens > 128
    assert chat.kept_image_tokens(0).all() and chat.kept_image_tokens(1).all()
    with pytest.raises(ConfigError, match="out of range"):
        chat.kept_image_tokens(2)
    assert chat.stats()["image_kv_fraction_kept"] == pytest.approx(1.0)
    # no image: a text-only conversation, nothing of an image to report
    text_only = Chat(model, processor, method="snapkv", budget=0.25, max_new_tokens=2)
    text_only.ask("hello")
    text_only.ask("again")
    assert text_only.turns[0].prompt_tokens < 20 and text_only.stats()["image_kv_fraction_kept"] is None
    with pytest.raises(ConfigError, match="0 image"):
        text_only.kept_image_tokens()


def test_kept_tokens_are_the_kept_patches_at_the_image_tokens(tiny_random_llava):
    """`kept_tokens` covers the whole compressed prompt; at the image tokens it is `kept_image_tokens`, row by
    row, and every text token of the prompt is kept (the budget is the image's)."""
    model, processor = tiny_random_llava
    chat = Chat(model, processor, _scene(), method="snapkv", budget=0.25, max_new_tokens=3)
    chat.ask(QUESTIONS[0])
    kept = chat.kept_tokens()
    image = chat.prompt_ids == model.config.image_token_id
    assert kept.shape[-1] == chat.prompt_ids.numel() and int(image.sum()) == 64
    grid = chat.kept_image_tokens()
    assert torch.equal(kept[..., image], grid.flatten(2))
    assert kept[..., ~image].all()


def test_page_reads_match_the_pages_retrieval_read(tiny_random_llava):
    # 2x2 tiles: on the tiny model's 8x8 grid the default 4x4 tiles leave one page that no sink or recent
    # token pins, and reading a share of one page reads it all
    model, processor = tiny_random_llava
    chat = Chat(
        model,
        processor,
        _scene(),
        method="full:retrieval=quest,read_budget=0.25,image_tile=2",
        max_new_tokens=6,
        record_reads=True,
    )
    chat.ask(QUESTIONS[0])
    chat.ask(QUESTIONS[1])
    reads = chat.page_reads()
    steps = chat.decode_steps
    assert steps > 0 and reads.shape == (model.config.text_config.num_hidden_layers, 2, 8, 8)
    assert ((reads >= 0) & (reads <= 1)).all()
    counts = (reads * steps).round()
    assert torch.allclose(reads * steps, counts, atol=1e-4)
    cache = chat._cache
    pages_read = 0.0
    for i, layer in enumerate(cache.layers):
        L0 = layer.prompt_slots
        rc = layer.slot_rc[0, :, :L0]
        page = layer.slot_page[0, :, :L0]
        pinned = layer.page_pinned[0].gather(-1, page.clamp(min=0))
        for h in range(rc.shape[0]):
            img = rc[h, :, 0] >= 0
            r, c = rc[h, img, 1], rc[h, img, 2]
            # pages holding a sink token are read at every step
            assert (reads[i, h][r[pinned[h, img]], c[pinned[h, img]]] == 1).all()
            free = ~pinned[h, img]
            pages_read += float(counts[i, h][r[free], c[free]].sum()) / 4  # 2x2 tiles, all kept
    assert pages_read == float(cache.counters["pages_read"])
    frac = chat.stats()["page_read_fraction"]
    assert 0.25 <= frac < 0.5  # ceil(25%) of the candidate pages per head and step

    plain = Chat(
        model,
        processor,
        _scene(),
        method="full:retrieval=quest,read_budget=0.25,image_tile=2",
        max_new_tokens=2,
    )
    plain.ask(QUESTIONS[0])
    with pytest.raises(ConfigError, match="record_reads=True"):
        plain.page_reads()


def test_page_reads_per_step_are_what_each_decode_step_read(tiny_random_llava):
    """Each decode step's reads: as many steps as the answers' tokens after the first, at each step
    ceil(25%) of every head's candidate pages, and their mean over the steps is `page_reads`."""
    model, processor = tiny_random_llava
    spec = "full:retrieval=quest,read_budget=0.25,image_tile=2"
    chat = Chat(model, processor, _scene(), method=spec, max_new_tokens=6, record_steps=True)
    chat.ask(QUESTIONS[0])
    first = chat.turns[0]
    assert len(first.token_ids) == first.new_tokens
    assert processor.tokenizer.decode(list(first.token_ids), skip_special_tokens=True).strip() == first.answer
    chat.ask(QUESTIONS[1])  # a later turn: its prompt is one more step
    steps = chat.page_reads_per_step()
    n_layers = model.config.text_config.num_hidden_layers
    assert steps.dtype == torch.bool and steps.shape == (chat.decode_steps, n_layers, 2, 8, 8)
    assert chat.decode_steps == sum(t.new_tokens - 1 for t in chat.turns) + 1
    assert torch.allclose(steps.float().mean(0), chat.page_reads())
    cache = chat._cache
    for i, layer in enumerate(cache.layers):
        page = layer.slot_page[0, :, : layer.prompt_slots]
        rc = layer.slot_rc[0, :, : layer.prompt_slots]
        pinned = layer.page_pinned[0].gather(-1, page.clamp(min=0))
        for h in range(rc.shape[0]):
            free = (rc[h, :, 0] >= 0) & ~pinned[h]
            n_free_pages = int(page[h, free].unique().numel())
            pages = steps[:, i, h][:, rc[h, free, 1], rc[h, free, 2]].sum(-1) / 4  # 2x2 tiles, all kept
            assert (pages == math.ceil(0.25 * n_free_pages)).all(), (i, h, pages)
    reads_only = Chat(model, processor, _scene(), method=spec, max_new_tokens=2, record_reads=True)
    reads_only.ask(QUESTIONS[0])
    with pytest.raises(ConfigError, match="record_steps=True"):
        reads_only.page_reads_per_step()


def test_user_errors_are_clear(tiny_random_llava, tmp_path):
    model, processor = tiny_random_llava
    with pytest.raises(DataError, match="nope.png"):
        Chat(model, processor, tmp_path / "nope.png")
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    with pytest.raises(DataError, match="bad.png"):
        Chat(model, processor, bad)
    with pytest.raises(ConfigError, match="unknown|not one of|method"):
        Chat(model, processor, _scene(), method="no-such-method", budget=0.25)
    with pytest.raises(ConfigError, match="budget"):
        Chat(model, processor, _scene(), method="snapkv", budget=1.5)
    with pytest.raises(ModelError, match="LLaVA"):
        Chat(torch.nn.Linear(2, 2), processor, _scene())
    chat = Chat(model, processor, _scene(), max_new_tokens=2)
    with pytest.raises(ConfigError, match="empty"):
        chat.ask("   ")


def test_a_failed_turn_starts_the_conversation_over(tiny_random_llava):
    model, processor = tiny_random_llava
    chat = Chat(model, processor, _scene(), max_new_tokens=2)
    first = chat.ask(QUESTIONS[0])

    def boom(*args):
        raise DataError("generation failed")

    hook = model.model.language_model.register_forward_pre_hook(boom)
    try:
        with pytest.raises(DataError, match="generation failed"):
            chat.ask(QUESTIONS[1])
    finally:
        hook.remove()
    assert chat.turns == [] and not mm_oval.is_wrapped(model)
    with pytest.raises(ConfigError, match="ask a question first"):
        chat.stats()
    assert chat.ask(QUESTIONS[0]) == first  # a fresh first turn, image included
    assert chat.turns[0].prompt_tokens > 64


# ---------------------------------------------------------------------------------------- the command


def test_command_one_shot_prompts_with_stats(tiny_random_llava, tiny_random_llava_dir, image_path, capsys):
    model, processor = tiny_random_llava
    argv = ["chat", "--model", str(tiny_random_llava_dir), "--image", str(image_path), "--method", "snapkv"]
    argv += ["--budget", "0.25", "--max-new-tokens", "4", "--stats"]
    rc = main([*argv, "--prompt", QUESTIONS[0], "--prompt", QUESTIONS[1]])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    answers = [line for line in out if not line.startswith("[stats]")]
    chat = Chat(model, processor, image_path, method="snapkv", budget=0.25, max_new_tokens=4)
    assert answers == [chat.ask(QUESTIONS[0]), chat.ask(QUESTIONS[1])]
    stats = [line for line in out if line.startswith("[stats]")]
    assert any("image KV kept 25.0%" in line for line in stats)
    assert any("layer 0: image tokens kept 16/64" in line for line in stats)


def test_command_reads_questions_from_stdin(tiny_random_llava, tiny_random_llava_dir, image_path):
    import argparse

    from mm_oval.cli_chat import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_random_llava_dir), "--image", str(image_path), "--max-new-tokens", "3"]
    )
    stdin = io.StringIO(
        f"{QUESTIONS[0]}\n\n/stats\n{QUESTIONS[1]}\n/reset\n{QUESTIONS[0]}\n/bogus\n/quit\nnever\n"
    )
    stdout = io.StringIO()
    assert run(args, stdin=stdin, stdout=stdout) == 0
    lines = stdout.getvalue().splitlines()
    answers = [x for x in lines if not x.startswith("[stats]") and not x.startswith("unknown command")]
    model, processor = tiny_random_llava
    chat = Chat(model, processor, image_path, max_new_tokens=3)
    expected = [chat.ask(QUESTIONS[0]), chat.ask(QUESTIONS[1])]
    # /reset starts over: the third answer is the first turn's again; /quit stops before "never"
    assert answers == [*expected, expected[0]]
    assert any(x.startswith("[stats] method full") for x in lines)
    assert any(x.startswith("unknown command /bogus") for x in lines)


def test_command_errors_name_what_to_fix(tiny_random_llava_dir, tmp_path, capsys):
    rc = main(
        [
            "chat",
            "--model",
            str(tiny_random_llava_dir),
            "--image",
            str(tmp_path / "missing.png"),
            "--prompt",
            "hi",
        ]
    )
    assert rc == 2 and "missing.png" in capsys.readouterr().err
    rc = main(
        [
            "chat",
            "--model",
            str(tiny_random_llava_dir),
            "--method",
            "snapkv",
            "--budget",
            "lots",
            "--prompt",
            "hi",
        ]
    )
    assert rc == 2 and "budget" in capsys.readouterr().err
    rc = main(["chat", "--model", str(tmp_path), "--prompt", "hi"])
    assert rc == 2 and str(tmp_path) in capsys.readouterr().err


# ------------------------------------------------------------------------------- limits and interruptions


@pytest.fixture(scope="module")
def short_context_llava_dir(tmp_path_factory):
    """The random tiny LLaVA saved with a context of 80 tokens: the first prompt (75 tokens) fits, a few
    answer tokens fit after it, a second turn does not."""
    from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

    model, processor = build_tiny_llava(seed=0, sizes=TinyLlavaSizes(max_positions=80))
    path = tmp_path_factory.mktemp("short_llava")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_the_conversation_stays_within_the_models_context_length(
    short_context_llava_dir, image_path, caplog, capsys
):
    from mm_oval.modelfiles import load_model

    model, processor = load_model(str(short_context_llava_dir), device="cpu")
    chat = Chat(model, processor, _scene(), max_new_tokens=32)
    with caplog.at_level("WARNING", logger="mm_oval.chat"):
        chat.ask(QUESTIONS[0])
    first = chat.turns[0]
    assert first.prompt_tokens + first.new_tokens <= 80  # the answer was cut to what fits, and said so
    assert "cut to 5 new tokens" in caplog.text and "max_position_embeddings" in caplog.text
    with pytest.raises(ConfigError, match=r"reach \d+ tokens.*more than the 80 the model handles"):
        chat.ask(QUESTIONS[1])
    assert len(chat.turns) == 1  # refused before anything was fed: the conversation is as it was
    chat.reset()
    chat.ask(QUESTIONS[0])
    # the command says it in one line
    argv = ["chat", "--model", str(short_context_llava_dir), "--image", str(image_path)]
    assert main([*argv, "--prompt", QUESTIONS[0], "--prompt", QUESTIONS[1]]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "mm-oval chat: error: the conversation"
    )
    assert "max_position_embeddings" in err.strip().splitlines()[-1]


class _CtrlCAtThePrompt(io.StringIO):
    def isatty(self) -> bool:
        return True

    def readline(self, *args) -> str:
        raise KeyboardInterrupt


def test_ctrl_c_at_the_prompt_ends_the_session_with_one_line(tiny_random_llava_dir, capsys):
    import argparse

    from mm_oval.cli_chat import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_random_llava_dir)])
    try:
        rc = run(args, stdin=_CtrlCAtThePrompt(), stdout=io.StringIO())
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C at the chat prompt escaped as a traceback")
    err = capsys.readouterr().err
    assert (
        rc == 130 and "Traceback" not in err and err.strip().splitlines()[-1] == "mm-oval chat: interrupted"
    )


@pytest.fixture(scope="module")
def bundled():
    """The bundled trained tiny LLaVA (64 image tokens), loaded from its folder (KVzip reads its tokenizer)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mm_oval.zoo import bundled_model_path

    try:
        path = bundled_model_path()
    except ModelError as e:
        pytest.skip(f"bundled model not built yet: {e}")
    return LlavaForConditionalGeneration.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


# options a method needs on the bundled 64-token model (router v2's default weights are the 576-token model's)
BUNDLED_OPTIONS = {"router2": "weights=none"}


def _every_method() -> list:
    """Every registered eviction method at budget 0.25 and retrieval method at read budget 0.5."""
    eviction, retrieval = known_methods()
    specs = [pytest.param(m, 0.25, id=m) for m in eviction if m != "full"]
    for r in retrieval:
        specs.append(pytest.param(f"{r}:{BUNDLED_OPTIONS[r]}" if r in BUNDLED_OPTIONS else r, 0.5, id=r))
    return specs


@pytest.mark.parametrize("spec, budget", _every_method())
def test_every_method_answers_in_a_chat_as_the_wrapped_model_does(bundled, spec, budget):
    """A Chat serves its method exactly as `mm_oval.wrap` does (KVzip's pass over the prompt included): its
    first answer is the wrapped model's greedy answer to the same prompt; a second turn answers on the same
    cache; the model is left unwrapped."""
    import mm_oval
    from mm_oval.config import OvalConfig
    from mm_oval.prompts import chat_prompt, to_model

    model, processor = bundled
    image = _scene("red")
    config = OvalConfig.from_spec(spec, budget)
    chat = Chat(model, processor, image, config=config, max_new_tokens=3)
    first = chat.ask(QUESTIONS_SQUARE)
    second = chat.ask("what shape is it ?")
    assert first and second and len(chat.turns) == 2 and not mm_oval.is_wrapped(model)
    stats = chat.stats()
    if config.evicts:
        assert stats["image_kv_fraction_kept"] < 1.0
    else:
        assert stats["retrieval"] == config.retrieval and stats["decode_steps"] > 0
    enc = to_model(
        processor(images=[image], text=[chat_prompt(processor, QUESTIONS_SQUARE)], return_tensors="pt"), model
    )
    with mm_oval.wrapped(model, config), torch.inference_mode():
        seq = model.generate(**enc, max_new_tokens=3, do_sample=False)
    assert (
        processor.tokenizer.decode(seq[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        == first
    )


def test_a_chat_gives_a_wrapped_model_its_own_wrap_back(bundled):
    """A Chat with another configuration than the model's wrap serves its own (KVzip here) for each ask and
    leaves the model's wrap (configuration, policies, last stats) as it was."""
    import mm_oval
    from mm_oval.stats import get_stats
    from mm_oval.wrapper import wrap_info

    model, processor = bundled
    mm_oval.wrap(model, method="knorm", budget=0.5)
    try:
        info = wrap_info(model)
        chat = Chat(model, processor, _scene("red"), method="kvzip", budget=0.25, max_new_tokens=3)
        assert chat.ask(QUESTIONS_SQUARE)
        assert chat.stats()["method"] == "kvzip"
        assert wrap_info(model) == info
        with pytest.raises(ConfigError, match="no request"):
            get_stats(model)  # the chat's requests were its own wrap's
        same = Chat(model, processor, _scene("red"), method="knorm", budget=0.5, max_new_tokens=3)
        assert same.ask(QUESTIONS_SQUARE)  # the model's own wrap and policies serve it
        assert get_stats(model)["method"] == "knorm" and wrap_info(model) == info
    finally:
        mm_oval.unwrap(model)


def test_the_chat_library_does_not_pull_in_the_evaluation_harness():
    import subprocess
    import sys

    code = "import sys, mm_oval.chat; print(sorted(m for m in sys.modules if m.startswith('mm_oval.eval')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
