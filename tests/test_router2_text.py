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


def test_the_error_teacher_weighs_a_page_by_how_far_its_estimate_is_from_its_exact_contribution(
    tiny_lm, byte_tokenizer
):
    """`--teacher error`: a page is worth reading by the distance between its exact contribution to the
    step's output and what `unread_pages="scored"` puts in its place (the base's estimate of its attention
    mass times its values' mean). A page whose values are constant and whose mass is estimated exactly is
    worth nothing; the others are worth the norm the definition gives. The capture refuses a base without
    mass estimates (Quest)."""
    from mm_oval.errors import ConfigError
    from mm_oval.training.router import estimate_error

    g = torch.Generator().manual_seed(0)
    hkv, G, P, T, D = 2, 3, 4, 5, 6
    n = P * T
    logits = torch.randn(hkv * G, n, generator=g) * 2
    att, lse = logits.softmax(-1), logits.logsumexp(-1)
    tok_idx = torch.arange(n).view(1, P, T).expand(hkv, P, T).clone()
    tok_idx[:, 3, 4] = -1  # a page one token short
    values = torch.randn(hkv, P, T, D, generator=g)
    values[:, 0] = values[:, 0, :1]  # page 0: constant values
    values[:, 3, 4] = 0
    mask = (tok_idx >= 0).unsqueeze(1)  # (hkv, 1, P, T)
    page_logits = logits.view(hkv, G, P, T).masked_fill(~mask, float("-inf"))
    log_mass = page_logits.logsumexp(-1)  # exact
    err = estimate_error(att, lse, log_mass, tok_idx, values)
    assert err.shape == (hkv, P)
    assert torch.allclose(err[:, 0], torch.zeros(hkv), atol=1e-6) and bool((err[:, 1:] > 1e-3).all())
    a = att.view(hkv, G, P, T) * mask
    for h in range(hkv):
        for p in range(P):
            k = int(mask[h, 0, p].sum())
            norms = [
                (
                    (a[h, gi, p, :k, None] * values[h, p, :k]).sum(0)
                    - a[h, gi, p].sum() * values[h, p, :k].mean(0)
                ).norm()
                for gi in range(G)
            ]
            assert float(err[h, p]) == pytest.approx(float(sum(norms) / G), rel=1e-5, abs=1e-6), (h, p)
    prompts = _prompts()[:1]
    with pytest.raises(ConfigError, match="teacher 'error' needs a base that estimates page masses"):
        capture_router2_data(tiny_lm, byte_tokenizer, prompts, make_retrieval("quest"), teacher="error")
    samples = capture_router2_data(
        tiny_lm, byte_tokenizer, prompts, make_retrieval("oval", rank=2), max_new_tokens=2, teacher="error"
    )
    mass = samples[0].mass
    assert bool((mass >= 0).all()) and bool((mass[..., samples[0].candidate] > 0).any())
