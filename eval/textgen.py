"""Greedy answers to text tasks (items with a `context` and no image) by a plain language model, wrapped or
not: the harness's three settings for a context read before its questions.

- `compress="prompt"`: context and question prefilled together (the cache compressed after both).
- `compress="context"`: the question-agnostic setting (kvpress's protocol): the chat template's head and
  the context are prefilled alone, the cache compressed there, then the question is read from that cache.
  Questions about one context share its compressed prefill (each gets a copy of the cache).
- multi-turn: the context prefilled and compressed once, then its questions asked in turn over that cache,
  each answer entering the next turn as generated.

The prompt is the model's chat template around one user message, context + "\\n\\n" + question; its tokens
are the head's (template head + context + "\\n\\n") followed by the rest's, in every setting, so the three
settings and every method see the same tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from mm_oval.errors import ConfigError
from mm_oval.prompts import SEPARATOR, context_prompt, render_chat, tokenizer_of
from mm_oval.wrapper import is_wrapped, prefill

from .tasks import Item


def _ids(tok: Any, text: str, device: torch.device) -> torch.Tensor:
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)


def split_prompt(tok: Any, item: Item, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(head ids, question ids), each (1, n): `context_prompt` of the item, tokenized."""
    head, tail = context_prompt(tok, item.context, item.prompt)
    return _ids(tok, head, device), _ids(tok, tail, device)


def _prefill_head(model: Any, head: torch.Tensor) -> Any:
    """The compressed cache of the head (a wrapped model compresses it here), or the plain model's."""
    if is_wrapped(model):
        return prefill(model, input_ids=head, attention_mask=torch.ones_like(head))
    cache = DynamicCache(config=model.config.get_text_config())
    model(input_ids=head, attention_mask=torch.ones_like(head), cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def _copy(model: Any, cache: Any) -> Any:
    """A copy of a context's prefilled cache for one of its questions."""
    return cache.copy() if is_wrapped(model) else copy.deepcopy(cache)


def _answer(tok: Any, new: torch.Tensor) -> tuple[str, int]:
    eos = tok.eos_token_id
    row = new[0].tolist()
    n = next((k + 1 for k, t in enumerate(row) if t == eos), len(row))
    return tok.decode(new[0], skip_special_tokens=True).strip(), n


def generate_text(
    model: Any,
    processor: Any,
    items: list[Item],
    max_new_tokens: int,
    compress: str = "prompt",
    on_request: Callable[[], None] | None = None,
) -> list[tuple[str, int]]:
    """Greedy (answer, new tokens) per item, one request per item (`compress="context"`: one prefill per
    distinct context, copied for each of its questions). `on_request` is called after each request (the
    harness records the wrapped model's KV figures there)."""
    tok = tokenizer_of(processor)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kw = {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1, "pad_token_id": pad}
    heads: dict[str, Any] = {}
    out = []
    for it in items:
        if it.context is None:
            raise ConfigError(
                f"item {it.id} has no context: text generation is for the long-context text tasks"
            )
        head, tail = split_prompt(tok, it, model.device)
        ids = torch.cat([head, tail], dim=1)
        with torch.inference_mode():
            if compress == "context":
                if it.context not in heads:
                    heads = {it.context: _prefill_head(model, head)}  # one context's cache at a time
                cache = _copy(model, heads[it.context])
                seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
            else:
                seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        out.append(_answer(tok, seq[:, ids.shape[1] :]))
        if on_request is not None:
            on_request()
    return out


def generate_text_conversation(
    model: Any, processor: Any, items: list[Item], max_new_tokens: int
) -> list[tuple[str, int]]:
    """One context, its items' questions asked in turn: the head (template + context) prefilled and
    compressed once, the first question read from it, each later turn feeding only its new tokens (end of
    turn, the next question, the assistant tag) on the same cache."""
    tok = tokenizer_of(processor)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kw = {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1, "pad_token_id": pad}
    first = items[0]
    if any(it.context != first.context for it in items):
        raise ConfigError("a conversation's questions must share one context (the items of one group)")
    head, tail = split_prompt(tok, first, model.device)
    # the conversation so far, up to the question now asked
    history: list[dict] = [{"role": "user", "content": f"{first.context}{SEPARATOR}{first.prompt}"}]
    marker = "\u2063MMOVAL-ANSWER\u2063"
    out: list[tuple[str, int]] = []
    with torch.inference_mode():
        cache = _prefill_head(model, head)
        ids = seq = torch.cat([head, tail], dim=1)
        for t, it in enumerate(items):
            if t > 0:
                # the template's text after the previous answer: end of turn, this question, the assistant tag
                question = {"role": "user", "content": it.prompt}
                rendered = render_chat(tok, [*history, {"role": "assistant", "content": marker}, question])
                if marker not in rendered:
                    raise ConfigError("multi-turn: the chat template drops assistant turns; cannot continue")
                prev = seq[:, :-1] if seq[0, -1].item() == tok.eos_token_id else seq
                ids = torch.cat([prev, _ids(tok, rendered.split(marker, 1)[1], model.device)], dim=1)
                history += [{"role": "assistant", "content": out[-1][0]}, question]
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, **kw)
            out.append(_answer(tok, seq[:, ids.shape[1] :]))
    return out
