"""`Chat` and `mm-oval chat` on a plain language model: a text conversation, and a context compressed before
the questions are read (the harness's question-agnostic setting for text tasks). A user's own Llama-family
folder loads with its tokenizer and runs the text tasks and the chat from the command line."""

import json
import re

import pytest
import torch
from mm_oval.eval.tasks import get_task
from mm_oval.eval.textgen import generate_text, generate_text_conversation, split_prompt

import mm_oval
from mm_oval.chat import Chat
from mm_oval.cli import main
from mm_oval.errors import ConfigError, ModelError
from mm_oval.prompts import render_chat

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"seed": 7, "per_length": 2, "lengths": {"1k": 6, "2k": 8, "4k": 10}}


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    """Two questions (a pass key, an ingredient) about one generated context, and the data folder."""
    folder = tmp_path_factory.mktemp("longtext")
    (folder / "longtext.json").write_text(json.dumps(SMALL))
    items = get_task("duo_1k").load(folder)
    assert items[0].context == items[1].context
    return items[:2], folder


def test_a_chat_over_a_compressed_context_answers_as_the_harness_does(tiny_lm, byte_tokenizer, duo):
    """With a context, the first question is read from the compressed context (the harness's
    `--compress context`) and the next is a turn over the same cache (its multi-turn mode): the same
    answers, the budget a share of the context alone, and the model unwrapped between turns."""
    items, _ = duo
    chat = Chat(
        tiny_lm, byte_tokenizer, context=items[0].context, method="snapkv", budget=0.5, max_new_tokens=6
    )
    answers = [chat.ask(it.prompt) for it in items]
    assert not mm_oval.is_wrapped(tiny_lm)
    mm_oval.wrap(tiny_lm, method="snapkv", budget=0.5)
    try:
        agnostic = generate_text(tiny_lm, byte_tokenizer, items[:1], 6, compress="context")
        turns = generate_text_conversation(tiny_lm, byte_tokenizer, items, 6)
    finally:
        mm_oval.unwrap(tiny_lm)
    assert answers == [a for a, _ in turns]
    assert answers[0] == agnostic[0][0]
    head, tail = split_prompt(byte_tokenizer, items[0], torch.device("cpu"))
    assert chat.turns[0].prompt_tokens == head.shape[1] + tail.shape[1]  # the whole first prompt is read
    stats = chat.stats()
    # compressed before the question: half of the context's KV is kept, the question's never enters prefill
    assert stats["kv_fraction_kept"] == pytest.approx(0.5, abs=0.02)
    assert stats["layers"][0]["text_tokens_full"] == head.shape[1]
    assert stats["turns"] == 2
    kept = chat.kept_tokens()  # (layers, KV heads, context tokens): what each head kept
    assert kept.shape == (3, 2, head.shape[1]) and torch.equal(chat.prompt_ids, head[0])
    assert kept[..., :4].all() and kept[..., -16:].all()  # the sinks and the recent window
    assert (kept.sum(-1).float() - head.shape[1] / 2).abs().max() <= 1


def test_a_text_chat_without_a_context_is_the_models_own_answer(tiny_lm, byte_tokenizer):
    """No context: the question is the prompt; the full cache answers with the unwrapped model's tokens."""
    question = "what is the pass key ?"
    chat = Chat(tiny_lm, byte_tokenizer, max_new_tokens=6)
    answer = chat.ask(question)
    text = render_chat(byte_tokenizer, [{"role": "user", "content": question}])
    ids = byte_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = tiny_lm.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    assert answer == byte_tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert chat.turns[0].prompt_tokens == ids.shape[1]


def test_a_text_chat_refuses_what_a_plain_lm_cannot_do(tiny_lm, byte_tokenizer, tiny_random_llava):
    from PIL import Image

    with pytest.raises(ConfigError, match="reads no images"):
        Chat(tiny_lm, byte_tokenizer, Image.new("RGB", (32, 32)))
    with pytest.raises(ConfigError, match="the context is empty"):
        Chat(tiny_lm, byte_tokenizer, context="  \n")
    with pytest.raises(ConfigError, match="image patches"):
        Chat(tiny_lm, byte_tokenizer, method="full:retrieval=quest", record_reads=True)
    chat = Chat(tiny_lm, byte_tokenizer, context="The pass key is 12345.", max_new_tokens=2)
    with pytest.raises(ConfigError, match="ask something about the text"):
        chat.ask(" ")
    chat.ask("what is the pass key ?")
    for call in (chat.kept_image_tokens, chat.page_reads, chat.grids):
        with pytest.raises(ConfigError, match="plain language model"):
            call()
    long = Chat(tiny_lm, byte_tokenizer, context="x" * 5000)  # the tiny Llama handles 4,096 positions
    with pytest.raises(ConfigError, match="pass a shorter context"):
        long.ask("what is the pass key ?")
    model, processor = tiny_random_llava
    with pytest.raises(ConfigError, match="is for a plain language model"):
        Chat(model, processor, context="some text")


@pytest.fixture(scope="module")
def llama_dir(tiny_lm, byte_tokenizer, tmp_path_factory):
    """The tiny Llama and its tokenizer saved as a user's model folder."""
    path = tmp_path_factory.mktemp("llama")
    tiny_lm.save_pretrained(path)
    byte_tokenizer.save_pretrained(path)
    return path


def test_a_plain_lm_folder_loads_with_its_tokenizer_and_chats_from_the_command_line(
    tiny_lm, byte_tokenizer, llama_dir, duo, tmp_path, capsys
):
    from mm_oval.modelfiles import load_model

    model, tok = load_model(str(llama_dir), device="cpu")
    assert type(model) is type(tiny_lm) and tok.chat_template == byte_tokenizer.chat_template
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny_lm.state_dict().values()))

    items, folder = duo
    ctx = tmp_path / "context.txt"
    ctx.write_text(items[0].context, encoding="utf-8")
    argv = ["chat", "--model", str(llama_dir), "--context", str(ctx), "--method", "snapkv", "--budget", "0.5"]
    rc = main([*argv, "--max-new-tokens", "6", "--prompt", items[0].prompt, "--prompt", items[1].prompt])
    assert rc == 0
    chat = Chat(
        tiny_lm, byte_tokenizer, context=items[0].context, method="snapkv", budget=0.5, max_new_tokens=6
    )
    # one printed line per answer; compared whole, since a random model's bytes may hold a '\r' (splitlines
    # would cut there)
    assert capsys.readouterr().out == "".join(f"{chat.ask(it.prompt)}\n" for it in items)
    assert main([*argv, "--max-new-tokens", "2", "--prompt", items[0].prompt, "--stats"]) == 0
    head, _ = split_prompt(byte_tokenizer, items[0], torch.device("cpu"))
    line = re.search(r"\[stats\] layer 0: tokens kept: text (\d+)/(\d+),", capsys.readouterr().out)
    # half of the context, the question read after the compression
    assert int(line[2]) == head.shape[1] and abs(int(line[1]) - head.shape[1] / 2) <= 1

    # the text tasks run on the folder through the harness's command
    out = tmp_path / "run"
    rc = main(
        ["eval", "--model", str(llama_dir), "--task", "duo_1k", "--data", str(folder), "--compress", "context",
         "--method", "snapkv", "--budget", "0.5", "--max-new-tokens", "4", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0 and json.loads((out / "results.json").read_text())["scores"]["count"] == 4


def test_the_chat_commands_errors_name_the_context_file(llama_dir, tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(["chat", "--model", str(llama_dir), "--context", str(missing), "--prompt", "hi"]) == 2
    assert f"context file {missing} does not exist" in capsys.readouterr().err
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    assert main(["chat", "--model", str(llama_dir), "--context", str(latin), "--prompt", "hi"]) == 2
    assert f"context file {latin} is not UTF-8" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["chat", "--model", str(llama_dir), "--context", str(empty), "--prompt", "hi"]) == 2
    assert f"context file {empty} is empty" in capsys.readouterr().err


def test_a_folder_of_another_model_type_is_refused_naming_what_loads(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from mm_oval.modelfiles import load_model

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="'gpt2' model.*LlamaForCausalLM"):
        load_model(str(tmp_path), device="cpu")
