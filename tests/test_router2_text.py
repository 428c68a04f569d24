"""Router v2 on a plain language model: the capture lays a text prompt out as the cache does (text pages,
every unpinned page a candidate, contents pooled from the context's token embeddings only, as the harness
prefills the context first), an untrained router reads what its base reads, and a trained one gets the
context's token embeddings from the wrapped model at serve time."""

import pytest
import torch
from mm_oval.eval import longtext
from mm_oval.eval.textgen import generate_text, split_prompt

import mm_oval
from mm_oval.policies.base import TEXT, make_retrieval
from mm_oval.policies.router2 import save_router2
from mm_oval.training.router import capture_router2_data, evaluate_router2, load_prompts, new_router2
from mm_oval.wrapper import wrap_info

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts():
    prompts = load_prompts("longtext:train:2:512:passkey,needle", seed=1000)
    assert [p.image for p in prompts] == [None, None] and all(p.context for p in prompts)
    return prompts


def test_text_capture_makes_every_unpinned_page_a_candidate_with_context_contents(tiny_lm, byte_tokenizer):
    model, tok = tiny_lm, byte_tokenizer
    prompts = _prompts()
    samples = capture_router2_data(
        model, tok, prompts, make_retrieval("oval", rank=2), max_new_tokens=3, text_page_size=16,
        sink_tokens=4, recent_tokens=16,
    )  # fmt: skip
    assert len(samples) == 2
    for prompt, s in zip(prompts, samples):
        head, tail = split_prompt(tok, prompt_item(prompt), torch.device("cpu"))
        n = head.shape[1] + tail.shape[1]
        assert bool((s.kind == TEXT).all()) and s.content.shape[0] == -(-n // 16)  # 16-token text pages
        # the first page holds the 4 sink tokens, the last ones the 16 recent tokens: always read
        assert not bool(s.candidate[0]) and not bool(s.candidate[-1]) and bool(s.candidate[1:-2].all())
        # pages wholly after the context (the question) pool no content: the wrapper keeps the embeddings of
        # the request's first forward (the context) only
        first_question_page = -(-head.shape[1] // 16)
        assert bool((s.content[first_question_page:] == 0).all()) and bool(
            s.content[:first_question_page].any()
        )
        L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
        assert s.mass.shape[1:] == (L, H, s.content.shape[0]) and bool((s.mass.sum(-1) <= 1 + 1e-5).all())
    net = new_router2(model, base="oval", base_options={"rank": 2})
    for budget in (0.1, 0.25):
        row = evaluate_router2(net, samples, budget)
        assert row["router2"] == pytest.approx(row["base"]) and row["oracle"] >= row["base"]


def prompt_item(prompt):
    return type("Item", (), {"context": prompt.context, "prompt": prompt.text})()


def test_a_router2_on_a_plain_lm_pools_the_context_token_embeddings_at_serve_time(
    tiny_lm, byte_tokenizer, tmp_path
):
    model, tok = tiny_lm, byte_tokenizer
    net = new_router2(model, base="oval", base_options={"rank": 2})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    save_router2(net, tmp_path)
    items = longtext.generate("passkey", "s", {"seed": 3, "per_length": 1, "lengths": {"s": 6}})
    mm_oval.wrap(
        model, retrieval="router2", retrieval_options={"weights": str(tmp_path)}, read_bytes_budget=0.5
    )
    seen = []
    try:
        policy = wrap_info(model).retrieval
        inner = policy.summarize

        def summarize(pages):
            seen.append(pages.request.inputs_embeds)
            return inner(pages)

        policy.summarize = summarize
        answers = generate_text(model, tok, items, max_new_tokens=3, compress="context")
    finally:
        mm_oval.unwrap(model)
    head, _ = split_prompt(tok, items[0], torch.device("cpu"))
    assert len(answers) == 1 and seen and all(e is not None for e in seen)
    assert torch.equal(seen[0], model.get_input_embeddings()(head))
