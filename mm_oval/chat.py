"""Chat about an image with a (wrapped) LLaVA-style model: the `mm-oval chat` command and the `Chat` helper.

    from mm_oval.chat import Chat
    chat = Chat(model, processor, "scene.png", method="snapkv", budget=0.25)
    chat.ask("what color is the circle ?")        # the image is prefilled and compressed here, once
    chat.ask("how many objects are there ?")      # later turns feed only their new tokens to the same cache
    chat.stats()                                  # mm_oval.stats figures of the conversation's cache
    chat.kept_image_tokens()                      # (layers, KV heads, rows, cols) bool: what eviction kept

    chat = Chat(model, tokenizer, context=report, method="kvp", budget=0.25)  # a plain LM (e.g. smollm2)
    chat.ask("what is the pass key ?")            # the context is prefilled and compressed before the question

The conversation is kept as token ids: each answer enters the next turn exactly as it was generated,
the first turn's prompt is the one the evaluation harness builds (`mm_oval.prompts.chat_prompt`), and the
later turns are the chat template's text between one answer and the next question, as the harness's
multi-turn mode builds them. A plain decoder-only language model (one `mm_oval.wrap` takes; its tokenizer in
the processor's place) chats about text; with a `context` (a document) the first turn is the harness's
question-agnostic one for text tasks (`--compress context`, eval/textgen.py): the chat template's head and
the context are prefilled and the cache compressed there, then the question is read from that cache, and
every later question is a turn over the same compressed context. The `mm-oval chat` command is
`mm_oval.cli_chat`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .config import OvalConfig
from .errors import ConfigError
from .geometry import FIXED, family_of, grid_shape, is_text_only, language_model, tokens_per_view
from .prompts import SEPARATOR, chat_prompt, context_prompt, load_image, render_chat, to_model, tokenizer_of
from .telemetry import cache_stats, kept_positions
from .wrapper import is_wrapped, make_policies, new_cache, prefill, wrap_info, wrapped

logger = logging.getLogger(__name__)

# stands for an answer while the chat template renders the conversation; the text after it is what the
# next turn feeds (end of the assistant turn, the next question, the assistant tag)
_ANSWER_MARKER = "\u2063MMOVAL-ANSWER\u2063"


@dataclass
class Turn:
    """One question and its answer."""

    question: str
    answer: str
    new_tokens: int  # tokens generated for the answer (end of sequence included)
    prompt_tokens: int  # tokens fed to the model for this turn (the whole first prompt, then the new ones)
    # the answer as generated: its first token comes from the prefill, each later one from a decode step
    token_ids: tuple[int, ...] = ()


class _ReadRecorder:
    """Stands between the cache and a retrieval policy; records, at each decode step and layer, which of
    the prompt's image patches each KV head read (the selected pages plus the pages always read)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.cache: Any = None
        self.grid: tuple[int, int, int] = (1, 1, 1)  # (images, rows, cols), set by the Chat
        self.counts: dict[int, torch.Tensor] = {}  # layer -> (Hkv, grids, rows, cols) steps read
        self.steps: dict[int, int] = {}  # layer -> decode steps seen
        self.per_step: dict[int, list[torch.Tensor]] | None = None  # layer -> each step's reads, when kept

    def __getattr__(self, name: str) -> Any:  # everything else is the policy's own
        if name == "inner":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def summarize(self, pages: Any) -> dict[str, torch.Tensor]:
        return self.inner.summarize(pages)

    def score_pages(self, ctx: Any) -> torch.Tensor:
        return self.inner.score_pages(ctx)

    def select(self, ctx: Any, read_budget: float) -> torch.Tensor:
        chosen = self.inner.select(ctx, read_budget)
        self._record(ctx, chosen)
        return chosen

    @torch.no_grad()
    def _record(self, ctx: Any, chosen: torch.Tensor) -> None:
        """The image patches of the pages read at this step: a page holds the slots [page_start, page_start
        + page_len) of its head (the retrieval context's public fields); image slots carry their (image, row,
        col) in the layer's `slot_rc`."""
        shapes = grid_shapes(self.cache, self.grid)
        n_grids = len(shapes)
        side_r, side_c = max(r for r, _ in shapes), max(c for _, c in shapes)
        read = (chosen & ctx.candidates) | (~ctx.candidates & (ctx.page_len > 0))  # (B, Hkv, P_s)
        rc = self.cache.layers[ctx.layer_idx].slot_rc[0]  # (Hkv, L, 3)
        start, length = ctx.page_start[0], ctx.page_len[0]  # (Hkv, P_s)
        slot = torch.arange(rc.shape[1], device=rc.device).view(1, 1, -1)
        in_page = (slot >= start.unsqueeze(-1)) & (slot < (start + length).unsqueeze(-1))  # (Hkv, P_s, L)
        slot_read = (in_page & read[0].unsqueeze(-1)).any(1)  # (Hkv, L)
        H = rc.shape[0]
        counts = self.counts.get(ctx.layer_idx)
        if counts is None:
            counts = torch.zeros(H, n_grids, side_r, side_c, dtype=torch.long, device=read.device)
            self.counts[ctx.layer_idx] = counts
        sel = (rc[..., 0] >= 0) & slot_read
        h = torch.arange(H, device=read.device).view(H, 1).expand_as(sel)
        counts.index_put_(
            (h[sel], rc[..., 0][sel], rc[..., 1][sel], rc[..., 2][sel]),
            torch.ones(int(sel.sum()), dtype=torch.long, device=read.device),
            accumulate=True,
        )
        if self.per_step is not None:
            hit = torch.zeros(counts.shape, dtype=torch.bool, device=read.device)
            hit[h[sel], rc[..., 0][sel], rc[..., 1][sel], rc[..., 2][sel]] = True
            self.per_step.setdefault(ctx.layer_idx, []).append(hit)
        self.steps[ctx.layer_idx] = self.steps.get(ctx.layer_idx, 0) + 1


def grid_shapes(cache: Any, fixed: tuple[int, int, int] | None = None) -> list[tuple[int, int]]:
    """(rows, cols) of each image grid of the conversation, in the order of `slot_rc`'s grid index: the
    cache's geometry (LLaVA-1.5: one grid per image; LLaVA-NeXT / OneVision: each image's base grid, then
    its high-resolution one; Qwen2-VL: each image's merged grid), else `fixed` (images, rows, cols)."""
    geometry = getattr(cache, "geometry", None)
    if geometry is not None and geometry.grids and geometry.grids[0]:
        return [(g.rows, g.cols) for g in geometry.grids[0]]
    n, rows, cols = fixed or (1, 1, 1)
    return [(rows, cols)] * n


def _max_positions(model: Any) -> int | None:
    """The language model's maximum context length (`text_config.max_position_embeddings`), if it has one."""
    cfg = model.config
    n = getattr(getattr(cfg, "text_config", None) or cfg, "max_position_embeddings", None)
    return int(n) if n else None


class Chat:
    """A conversation about one or more images with a LLaVA-style model, or about a text with a plain
    language model, through mm-oval's cache.

    `method`/`budget` are those of `mm_oval.wrap` (a method spec such as `"snapkv"`, `"kvp"`, or
    `"full:retrieval=oval,read_budget=0.25"`; `config` an `OvalConfig` instead). The first `ask` prefills
    the images and the question and compresses the cache once; later questions reuse it. The model is
    wrapped for the duration of each `ask` and unwrapped afterwards unless it was wrapped already, so
    several `Chat`s (e.g. full cache and compressed) can share one model: a model wrapped with another
    configuration is wrapped with this conversation's for the `ask` and has its own wrap back after. The
    conversation's policies are built once, here (those of the model's wrap when it is wrapped with the
    same configuration), and serve every turn. `record_reads=True` records
    which image patches decode-time retrieval read (`page_reads`); `record_steps=True` also keeps what
    each decode step read (`page_reads_per_step`).

    A plain decoder-only LM (`mm_oval.wrap`'s text families; `processor` its tokenizer) takes no images;
    the budget is a share of its prompt. `context` (a document, plain LM only) makes the first turn
    question-agnostic: the chat template's head and `context` + a blank line are prefilled and compressed
    before the first question is read (the harness's `--compress context`), and the questions are turns over
    that compressed context."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        image: Any = None,
        *,
        images: list[Any] | None = None,
        context: str | None = None,
        method: str = "full",
        budget: float | int | None = None,
        config: OvalConfig | None = None,
        max_new_tokens: int = 32,
        record_reads: bool = False,
        record_steps: bool = False,
    ):
        language_model(model)  # a clear error for a model that is not LLaVA-style
        if image is not None and images is not None:
            raise ConfigError("pass either image= or images=, not both")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        raw = images if images is not None else ([] if image is None else [image])
        self.text_only = is_text_only(model)
        if self.text_only and raw:
            raise ConfigError(
                f"{type(model).__name__} is a plain language model: it reads no images; chat about a text "
                "(context=, mm-oval chat --context FILE) or load a LLaVA-style model"
            )
        if context is not None and not self.text_only:
            raise ConfigError(
                "context= (mm-oval chat --context) is for a plain language model; with a LLaVA-style model, put "
                "the text in the question"
            )
        if context is not None and (not isinstance(context, str) or not context.strip()):
            raise ConfigError("the context is empty; pass the text the questions are about")
        if self.text_only and (record_reads or record_steps):
            raise ConfigError(
                "record_reads / record_steps record the image patches retrieval reads; a plain language model "
                "has none"
            )
        self.images = [load_image(im) for im in raw]
        self.context = context
        self.model = model
        self.processor = processor
        self.tokenizer = tokenizer_of(processor)
        config = config if config is not None else OvalConfig.from_spec(method, budget)
        # a plain LM's wrap reads the budget as a share of the context (what `wrap` makes of the config)
        self.config = config.for_text_only() if self.text_only else config
        self.max_new_tokens = max_new_tokens
        self.record_reads = record_reads or record_steps
        self.record_steps = record_steps
        self.tokens_per_image = tokens_per_view(model)
        info = wrap_info(model) if is_wrapped(model) else None
        if info is not None and info.config == self.config:
            self._eviction, self._retrieval = info.eviction, info.retrieval
        else:  # built and checked against the model as wrap builds them, once for the conversation
            self._eviction, self._retrieval = make_policies(model, self.config)
        self.max_positions = _max_positions(model)
        self.reset()

    # ---- the conversation ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation (the next `ask` prefills the images again)."""
        self.turns: list[Turn] = []
        self._prefilled: torch.Tensor | None = None  # the token ids compressed in the first turn
        self._cache: Any = None
        self._recorder: _ReadRecorder | None = None
        self._seq: torch.Tensor | None = None

    @property
    def history(self) -> list[tuple[str, str]]:
        return [(t.question, t.answer) for t in self.turns]

    def prompt_text(self, question: str) -> str:
        """The text the chat template makes of the conversation so far plus `question` (what the model
        has read once the question is fed)."""
        return self._render(question, self.history)

    def ask(self, question: str) -> str:
        """Answer `question` (greedy decoding) and return the answer's text. If generation fails, the
        conversation is reset (its cache may hold part of the failed turn) and the error propagates."""
        if not isinstance(question, str) or not question.strip():
            about = "the text" if self.text_only else "the image"
            raise ConfigError(f"the question is empty; ask something about {about}")
        question = question.strip()
        tok = self.tokenizer
        head = None
        if self._cache is None:
            inputs, head = self._first_inputs(question)
        else:
            inputs = self._next_inputs(question)
        n_in = int(inputs["input_ids"].shape[1])
        max_new = self._room_for_answer(n_in)  # refused here: the conversation is left as it was
        if self._cache is None:
            self._new_recorder()
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        before = 0
        try:
            with self._wrapped(), torch.inference_mode():
                if self._cache is None:  # the first turn: a cache over this wrap's policies
                    if head is not None:  # the context prefilled and compressed before the question
                        self._cache = prefill(
                            self.model, input_ids=head, attention_mask=torch.ones_like(head)
                        )
                    else:
                        self._cache = new_cache(self.model)
                    if self._recorder is not None:
                        self._recorder.cache = self._cache
                else:
                    before = int(self._cache.get_seq_length())  # tokens already in the cache
                seq = self.model.generate(
                    **inputs,
                    cache=self._cache,
                    max_new_tokens=max_new,
                    do_sample=False,
                    num_beams=1,
                    pad_token_id=pad,
                )
        except BaseException:
            # the cache may hold part of this turn: the conversation cannot go on from it
            self.reset()
            raise
        self._seq = seq
        if self._prefilled is None:
            self._prefilled = (head if head is not None else inputs["input_ids"])[0].detach().cpu()
        new = seq[:, n_in:]
        answer = tok.decode(new[0], skip_special_tokens=True).strip()
        fed = n_in - before
        self.turns.append(Turn(question, answer, int(new.shape[1]), fed, tuple(new[0].tolist())))
        return answer

    def _room_for_answer(self, n_in: int) -> int:
        """New tokens this turn may generate: `max_new_tokens`, fewer (with a warning) where the model's
        maximum context length would be passed; a ConfigError when the prompt alone reaches it."""
        limit = self.max_positions
        if limit is None or n_in + self.max_new_tokens <= limit:
            return self.max_new_tokens
        if n_in >= limit and self._cache is None and self.context is not None:
            raise ConfigError(
                f"the context and the first question are {n_in} tokens, more than the {limit} the model handles "
                "(its max_position_embeddings): pass a shorter context"
            )
        if n_in >= limit:
            raise ConfigError(
                f"the conversation would reach {n_in} tokens with this question, more than the {limit} the "
                "model handles (its max_position_embeddings): start a new conversation (/reset, "
                "Chat.reset()) or ask a shorter question"
            )
        room = limit - n_in
        logger.warning(
            "the answer is cut to %d new tokens (not %d): the conversation is %d tokens long and the model "
            "handles %d (its max_position_embeddings); /reset starts a new conversation",
            room,
            self.max_new_tokens,
            n_in,
            limit,
        )
        return room

    # ---- what the cache holds ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """`mm_oval.stats` figures of this conversation's cache (what prefill kept, per layer and in total;
        prefill and decode time over all turns) plus `turns`, `cache_tokens` (the conversation's length)
        and `cache_slots` (the tokens the cache holds now, per KV head, averaged over layers and heads)."""
        cache = self._require_cache()
        out = cache_stats(cache)
        layers = [layer for layer in cache.layers if layer.phase == "decode"]
        out["turns"] = len(self.turns)
        out["cache_tokens"] = int(cache.get_seq_length())
        out["cache_slots"] = (
            sum(float(layer.slot_valid[0].sum()) / layer.slot_valid.shape[1] for layer in layers)
            / len(layers)
            if layers
            else 0.0
        )
        return out

    @property
    def prompt_ids(self) -> torch.Tensor:
        """(N,) the token ids the first turn prefilled and compressed: a plain LM's chat template head with
        its context when the chat has one, else the whole first prompt (image tokens included)."""
        self._require_cache()
        return self._prefilled

    def kept_tokens(self) -> torch.Tensor:
        """(layers, KV heads, N) bool: which of the N tokens of `prompt_ids` each KV head of each layer kept
        (e.g. `kept_tokens().float().mean((0, 1))`: the share of heads that kept each token)."""
        return torch.stack(kept_positions(self._require_cache(), int(self._prefilled.numel())))

    def grids(self) -> list[tuple[int, int]]:
        """(rows, cols) of each image grid of the conversation, the index `kept_image_tokens` and
        `page_reads` take: one grid per image for LLaVA-1.5; for LLaVA-NeXT / OneVision each image's base
        grid, then its high-resolution grid; for Qwen2-VL each image's merged grid."""
        self._refuse_text_only("image grids")
        return grid_shapes(self._require_cache(), self.grid if family_of(self.model) == FIXED else None)

    def _grid_shape(self, image: int) -> tuple[int, int]:
        shapes = self.grids()
        if not 0 <= image < len(shapes):
            what = "image(s)" if family_of(self.model) == FIXED else "image grid(s) (chat.grids())"
            raise ConfigError(f"image {image} is out of range: this conversation has {len(shapes)} {what}")
        return shapes[image]

    def kept_image_tokens(self, image: int = 0) -> torch.Tensor:
        """(layers, KV heads, rows, cols) bool: the patches of image grid `image` (see `grids`; for
        LLaVA-1.5 the image's index) whose keys and values each KV head of each layer kept after prefill."""
        cache = self._require_cache()
        rows, cols = self._grid_shape(image)
        out = []
        for layer in cache.layers:
            L0 = layer.prompt_slots
            rc = layer.slot_rc[0, :, :L0]  # (Hkv, L0, 3)
            ok = layer.slot_valid[0, :, :L0] & (rc[..., 0] == image)
            H = rc.shape[0]
            grid = torch.zeros(H, rows, cols, dtype=torch.bool, device=rc.device)
            h = torch.arange(H, device=rc.device).view(H, 1).expand_as(ok)
            grid[h[ok], rc[..., 1][ok], rc[..., 2][ok]] = True
            out.append(grid)
        return torch.stack(out).cpu()

    def page_reads(self, image: int = 0) -> torch.Tensor:
        """(layers, KV heads, rows, cols) float: for each kept patch of image `image`, the fraction of decode
        steps so far at which that head read its page (1.0 for pages always read; 0 for evicted patches).
        Needs `record_reads=True` and a retrieval method."""
        self._refuse_text_only("image patches")
        self._require_cache()
        if self._recorder is None:
            raise ConfigError(
                "page reads were not recorded: create the Chat with record_reads=True and a retrieval "
                "method (e.g. method='full:retrieval=oval,read_budget=0.25')"
            )
        rows, cols = self._grid_shape(image)
        cache = self._cache
        out = []
        for i, layer in enumerate(cache.layers):
            counts = self._recorder.counts.get(i)
            steps = self._recorder.steps.get(i, 0)
            if counts is None or steps == 0:
                out.append(torch.zeros(layer.keys.shape[1], rows, cols))
            else:
                out.append(counts[:, image, :rows, :cols].float().cpu() / steps)
        return torch.stack(out)

    def page_reads_per_step(self, image: int = 0) -> torch.Tensor:
        """(decode steps, layers, KV heads, rows, cols) bool: at each decode step so far, the kept patches of
        image `image` whose page that head read (the selected pages plus those always read); its mean over
        the steps is `page_reads`. Decode step s reads with the answer's token s as the query and writes
        token s + 1 (`turns[-1].token_ids`; the first token comes from the prefill). Needs
        `record_steps=True` and a retrieval method."""
        self._refuse_text_only("image patches")
        self._require_cache()
        if self._recorder is None or self._recorder.per_step is None:
            raise ConfigError(
                "the page reads of each decode step were not recorded: create the Chat with record_steps=True "
                "and a retrieval method (e.g. method='full:retrieval=oval,read_budget=0.25')"
            )
        rows, cols = self._grid_shape(image)
        steps = self.decode_steps
        out = []
        for i, layer in enumerate(self._cache.layers):
            grid = torch.zeros(steps, layer.keys.shape[1], rows, cols, dtype=torch.bool)
            for s, hit in enumerate(self._recorder.per_step.get(i, [])):
                grid[s] = hit[:, image, :rows, :cols].cpu()
            out.append(grid)
        return torch.stack(out, 1)

    @property
    def decode_steps(self) -> int:
        """Decode steps whose page reads were recorded (per layer)."""
        if self._recorder is None or not self._recorder.steps:
            return 0
        return max(self._recorder.steps.values())

    @property
    def grid(self) -> tuple[int, int, int]:
        """(images, rows, cols) of the patch grid."""
        self._refuse_text_only("an image grid")
        if family_of(self.model) != FIXED:  # grids of their own sizes, several per image
            raise ConfigError(
                f"{type(self.model).__name__} gives each image grids of their own sizes, not one "
                "(images, rows, cols) grid: chat.grids() lists them, and kept_image_tokens(g) / page_reads(g) "
                "draw grid g"
            )
        return (len(self.images), *grid_shape(self.tokens_per_image))

    # ---- inside ----------------------------------------------------------------------------------------
    def _refuse_text_only(self, what: str) -> None:
        if self.text_only:
            raise ConfigError(
                f"{type(self.model).__name__} is a plain language model: a text conversation has no {what} "
                "(kept_image_tokens, page_reads and grids describe image patches); kept_tokens() and stats() say "
                "what the cache kept"
            )

    def _require_cache(self) -> Any:
        if self._cache is None:
            raise ConfigError("nothing is cached yet: ask a question first")
        return self._cache

    def _new_recorder(self) -> None:
        """A fresh recorder of this conversation's page reads, standing for its retrieval policy (when
        reads are recorded and there is retrieval)."""
        self._recorder = None
        if self._retrieval is not None and self.record_reads:
            self._recorder = _ReadRecorder(self._retrieval)
            if self.record_steps:
                self._recorder.per_step = {}
            if family_of(self.model) == FIXED:
                self._recorder.grid = self.grid

    @contextlib.contextmanager
    def _wrapped(self) -> Iterator[None]:
        """The model wrapped with this conversation's configuration and policies for one `ask` (the
        recorder standing for the retrieval policy when reads are recorded), and as it was afterwards;
        left as it is when its wrap already serves exactly these."""
        retrieval = self._recorder if self._recorder is not None else self._retrieval
        info = wrap_info(self.model) if is_wrapped(self.model) else None
        if (
            info is not None
            and info.config == self.config
            and info.eviction is self._eviction
            and info.retrieval is retrieval
        ):
            yield
            return
        with wrapped(self.model, self.config, eviction_policy=self._eviction, retrieval_policy=retrieval):
            yield

    def _render(self, question: str, history: list[tuple[str, str]]) -> str:
        if not self.text_only:
            return chat_prompt(self.processor, question, history, images=len(self.images))
        messages: list[dict] = []
        for i, (q, a) in enumerate([*history, (question, None)]):
            if i == 0 and self.context is not None:
                q = f"{self.context}{SEPARATOR}{q}"
            messages.append({"role": "user", "content": q})
            if a is not None:
                messages.append({"role": "assistant", "content": a})
        return render_chat(self.tokenizer, messages)

    def _ids(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return ids.to(self.model.device)

    def _first_inputs(self, question: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The first turn's inputs, and the head to prefill and compress before the question (a plain LM's
        context: the template's head with it), else None."""
        if self.text_only:
            if self.context is None:
                ids, head = self._ids(self._render(question, [])), None
            else:
                head_text, tail_text = context_prompt(self.tokenizer, self.context, question)
                head = self._ids(head_text)
                ids = torch.cat([head, self._ids(tail_text)], dim=1)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, head
        text = self._render(question, [])
        kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
        if self.images:
            kwargs["images"] = self.images
        return to_model(self.processor(**kwargs), self.model), None

    def _next_inputs(self, question: str) -> dict[str, torch.Tensor]:
        tok = self.tokenizer
        hist = self.history
        rendered = self._render(question, hist[:-1] + [(hist[-1][0], _ANSWER_MARKER)])
        if _ANSWER_MARKER not in rendered:
            raise ConfigError("the chat template drops assistant turns; cannot continue the conversation")
        tail = rendered.split(_ANSWER_MARKER, 1)[1]
        tail_ids = tok(tail, add_special_tokens=False, return_tensors="pt")["input_ids"].to(self._seq.device)
        prev = self._seq
        if prev[0, -1].item() == tok.eos_token_id:
            prev = prev[:, :-1]  # the template closes the turn itself
        ids = torch.cat([prev, tail_ids], dim=1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
