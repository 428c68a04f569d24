"""Capture KVP training traces from a LLaVA-style model, or from a plain decoder-only LM on text samples.

For each sample (image + question, or a text context + question, with its answer) the model runs once
over prompt + answer. The Q/K
capture (`mm_oval.measures.capture_qk`: SDPA underneath, so outputs are unchanged) hands over every layer's
queries, keys and values after RoPE, and the trace records, for the prompt's n tokens:

- keys and values as they would be cached (L, Hkv, n, D), the prompt's queries (L, Hq, n, D) for the
  attention-based baselines (optional), positions, modality (text / image) and (image, row, col);
- the future utility u_i of each prompt token: the attention it receives from the answer tokens (the
  queries that read the cache during decode), summed over those queries, max over the query heads of its
  KV group (L, Hkv, n).

The answer is the reference answer teacher-forced (`answer="reference"`) or the model's own greedy answer
(`answer="greedy"`). Traces are stored as safetensors shards listed in manifest.json; a capture that is
interrupted resumes after the last complete shard. Keys, values and queries are stored in float16 (a
1k-token trace of SmolLM2-135M, 30 layers x 3 KV heads of 64, is about 24 MB of keys and values; its
queries add 36 MB, so `store_queries=False` for long text).

Text samples (`longtext:SPLIT[:N[:LENGTHS[:KINDS]]]`: the long-context text tasks of eval/longtext.py generated
with a training seed, never the dev set's) run on a plain LM with its tokenizer as `processor`. Their prompt
is the harness's (eval/textgen.py's `split_prompt`: the chat template's head with the context, then the
question and the assistant tag); with `compress="context"` the trace's prompt ends at the context, as
`eval --compress context` compresses it (question-agnostic), and the question, like the answer, is future.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save

from ..errors import ConfigError, DataError, ModelError, ResultsError
from ..files import atomic_write_bytes, atomic_write_text
from ..geometry import GEOMETRY_INPUTS, image_geometry
from ..measures import capture_qk
from ..policies.base import IMAGE, TEXT
from ..policies.signature import model_signature
from ..prompts import COMPRESS_AT
from ..zoo.generate import TrainSampler
from ..zoo.generate576 import TrainSampler576
from ..zoo.vocab import COLORS, SHAPES

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------------------------------------
# samples
# ----------------------------------------------------------------------------------------------------------


@dataclass
class TraceSample:
    """One prompt: `images` (PIL) and the user `question` (text after the image), with its `answer`. A text
    sample has no images and a `context` (the document read before the question, eval/longtext.py)."""

    sample_id: str
    images: list[Any]
    question: str
    answer: str
    # later turns about the same image (question, answer): their tokens read the cache after eviction too
    followups: list[tuple[str, str]] = field(default_factory=list)
    context: str | None = None
    # the longest greedy answer for this sample (its task's budget), else the capture's `max_new_tokens`
    max_new_tokens: int | None = None


def toy_samples(n: int, seed: int = 0, image_size: int = 128) -> list[TraceSample]:
    """Tiny built-in scenes (coloured shapes on a grid, one question each), words from the bundled vocabulary.
    For tests and smoke runs; real training uses the zoo's generator or an MMBench / VQA-format file."""

    rng = random.Random(seed)
    out = []
    cell = image_size // 4
    for i in range(n):
        img = Image.new("RGB", (image_size, image_size), "black")
        d = ImageDraw.Draw(img)
        objs = []
        for _ in range(rng.randint(1, 4)):
            r, c = rng.randrange(4), rng.randrange(4)
            color, shape = rng.choice(COLORS), rng.choice(SHAPES)
            box = (c * cell + 3, r * cell + 3, (c + 1) * cell - 3, (r + 1) * cell - 3)
            if shape == "circle":
                d.ellipse(box, fill=color)
            elif shape == "triangle":
                d.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=color)
            else:
                d.rectangle(box, fill=color)
            objs.append((color, shape))
        color, shape = rng.choice(objs)
        if rng.random() < 0.5:
            q, a = f"what color is the {shape} ?", color
        else:
            q, a = "how many objects are there ?", str(len(objs))
        out.append(TraceSample(f"toy-{seed}-{i}", [img], q, a))
    return out


def _decode_image(b64: str, where: str) -> Any:
    try:
        return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")
    except Exception as e:  # noqa: BLE001 - any decoding failure is a data error for the user
        raise DataError(f"{where}: image is not a valid base64-encoded picture ({e})") from e


def mmbench_samples(path: Path) -> list[TraceSample]:
    """An MMBench-format TSV (index, question, hint, A..D, answer, image base64); the prompt is LLaVA-1.5's."""
    csv.field_size_limit(sys.maxsize)
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t")
        for row_no, row in enumerate(reader, start=2):
            where = f"{path} row {row_no}"
            for col in ("index", "question", "image"):
                if not row.get(col):
                    raise DataError(f"{where}: column {col!r} is missing or empty (an MMBench TSV needs it)")
            hint = (row.get("hint") or "").strip()
            hint = "" if hint.lower() == "nan" else hint
            text = (hint + "\n" if hint else "") + row["question"]
            for letter in "ABCD":
                opt = (row.get(letter) or "").strip()
                if opt and opt.lower() != "nan":
                    text += f"\n{letter}. {opt}"
            text += "\nAnswer with the option's letter from the given choices directly."
            out.append(
                TraceSample(
                    f"mmb-{row['index']}", [_decode_image(row["image"], where)], text, row.get("answer", "")
                )
            )
    return out


def jsonl_samples(path: Path) -> list[TraceSample]:
    """JSON lines with `question`, `answer` and `image` (a file path relative to the JSONL, or base64)."""

    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e})") from e
            for col in ("question", "answer", "image"):
                if col not in rec:
                    raise DataError(f"{where}: field {col!r} is missing (need question, answer, image)")
            img_ref = rec["image"]
            img_path = (path.parent / img_ref) if isinstance(img_ref, str) else None
            if img_path is not None and img_path.is_file():
                image = Image.open(img_path).convert("RGB")
            else:
                image = _decode_image(str(img_ref), where)
            answer = rec["answer"]
            if isinstance(answer, list):  # VQA-style list of human answers: take the most common
                answer = max(set(answer), key=answer.count) if answer else ""
            out.append(
                TraceSample(
                    str(rec.get("id", f"{path.stem}-{line_no}")), [image], rec["question"], str(answer)
                )
            )
    return out


ZOO_HELDOUT_SEED_OFFSET = 1_000


def zoo_samples(split: str, n: int, seed: int, followups: int = 0, geometry: int = 64) -> list[TraceSample]:
    """Samples from the bundled tiny LLaVA's scene generator (its train split, drawn on the fly), with the
    evaluation prompts (VQA or MMBench style) and `followups` later questions about the same scene.
    `split="heldout"` draws from another seed, for held-out traces that share no scene with `train` (the dev
    sets are kept for evaluation). `geometry=576`: the 576-token benchmark's scenes (`zoo576:` specs)."""

    prefix = "zoo576" if geometry == 576 else "zoo"
    if split not in ("train", "heldout"):
        raise DataError(f"{prefix} split {split!r}: use {prefix}:train[:N] or {prefix}:heldout[:N]")
    sampler_seed = seed + (ZOO_HELDOUT_SEED_OFFSET if split == "heldout" else 0)
    sampler = TrainSampler576(sampler_seed) if geometry == 576 else TrainSampler(sampler_seed)
    out = []
    for i in range(n):
        item = sampler.item(i, 1 + followups)
        turns = [(q.mmbench_prompt() if q.options else q.vqa_prompt(), q.answer) for q in item.questions]
        (text, answer), later = turns[0], turns[1:]
        out.append(TraceSample(f"{prefix}-{split}-{seed}-{i}", [item.image], text, answer, later))
    return out


LONGTEXT_SEED_BASE = 100  # training contexts use seed 100 + --seed, held-out ones 1100 + --seed
LONGTEXT_LENGTHS = {"512": 36, "1k": 80, "2k": 164, "4k": 332}  # sentences per document (eval/longtext.py)
LONGTEXT_DEFAULT_LENGTHS = ("512", "1k")
# the kinds drawn by default, named here (not eval/longtext.py's KINDS) so that a spec keeps meaning the
# same samples when the harness gains a kind: a capture resumes only on the samples it started with
LONGTEXT_DEFAULT_KINDS = ("passkey", "doorkeys", "keylist", "needle", "message", "trio")


def parse_longtext_spec(
    spec: str, limit: int | None = None
) -> tuple[str, int, tuple[str, ...], tuple[str, ...]]:
    """`longtext:SPLIT[:N[:LENGTHS[:KINDS]]]` -> (split, N, lengths, kinds); LENGTHS is a comma list of 512,
    1k, 2k, 4k (default 512,1k), KINDS one of eval/longtext.py's kinds (default LONGTEXT_DEFAULT_KINDS)."""
    from ..eval.longtext import KINDS

    parts = spec.split(":")
    if parts[0] != "longtext" or len(parts) > 5:
        raise DataError(
            f"text data {spec!r}: use longtext:train[:N[:LENGTHS[:KINDS]]] (e.g. longtext:train:96:512,1k)"
        )
    split = parts[1] if len(parts) > 1 and parts[1] else "train"
    if split not in ("train", "heldout"):
        raise DataError(f"longtext split {split!r}: use longtext:train[:N] or longtext:heldout[:N]")
    try:
        n = int(parts[2]) if len(parts) > 2 and parts[2] else (limit or 256)
    except ValueError:
        raise DataError(f"text data {spec!r}: N must be a number of samples") from None

    def listed(k: int) -> tuple[str, ...]:
        return tuple(x.strip() for x in parts[k].split(",") if x.strip()) if len(parts) > k else ()

    lengths = listed(3) or LONGTEXT_DEFAULT_LENGTHS
    kinds = listed(4) or LONGTEXT_DEFAULT_KINDS
    bad = [x for x in lengths if x not in LONGTEXT_LENGTHS]
    if bad:
        raise DataError(f"text data {spec!r}: unknown lengths {bad}; choose from {list(LONGTEXT_LENGTHS)}")
    bad = [x for x in kinds if x not in KINDS]
    if bad:
        raise DataError(f"text data {spec!r}: unknown kinds {bad}; choose from {list(KINDS)}")
    return split, min(n, limit or n), lengths, kinds


def _reference(meta: dict) -> str:
    if "keys" in meta:
        return ", ".join(meta["keys"])
    return str(meta.get("key") or meta.get("word") or meta.get("message") or "")


def longtext_samples(
    split: str,
    n: int,
    seed: int = 0,
    lengths: tuple[str, ...] = LONGTEXT_DEFAULT_LENGTHS,
    kinds: tuple[str, ...] = LONGTEXT_DEFAULT_KINDS,
    followups: int = 0,
) -> list[TraceSample]:
    """`n` text samples of eval/longtext.py's generator (each of `kinds` at each of `lengths`, interleaved so
    that any prefix mixes them), one question per context (the kinds with several questions per context,
    doorkeys and trio, ask each context one of them in turn). With `followups` > 0 a context of several
    questions asks its first one and up to `followups` more as the sample's follow-ups, each asked of the
    context on its own (`_capture_text`): the future a question-agnostic cache must serve is every question
    the context answers, not the one drawn. The generator's seed is LONGTEXT_SEED_BASE +
    `seed` for `train` and another 1000 above for `heldout`; the dev set's seed (eval/longtext.py's
    BUNDLED_SPEC) is refused. The answer recorded is the reference (the pass key(s), the word or the
    message); traces normally use the model's greedy answer, up to the harness's budget for the kind."""
    from ..eval import longtext

    if split not in ("train", "heldout"):
        raise DataError(f"longtext split {split!r}: use longtext:train[:N] or longtext:heldout[:N]")
    gen_seed = LONGTEXT_SEED_BASE + seed + (ZOO_HELDOUT_SEED_OFFSET if split == "heldout" else 0)
    if gen_seed == longtext.BUNDLED_SPEC["seed"]:
        raise ConfigError(
            f"seed {seed} makes the long-context generator draw the dev set (seed {gen_seed}); pick another --seed"
        )
    slots = [(k, length) for length in lengths for k in kinds]
    per = -(-n // len(slots)) if n else 0
    spec = {"seed": gen_seed, "per_length": per, "lengths": {x: LONGTEXT_LENGTHS[x] for x in lengths}}
    columns = []
    for kind, length in slots:
        groups: dict[str, list] = {}
        for it in longtext.generate(kind, length, spec):
            groups.setdefault(it.group, []).append(it)
        budget = longtext.TASK_CLASSES[f"{kind}_1k"].max_new_tokens  # the harness's, the same at every length
        col = []
        for c, g in enumerate(groups.values()):
            # one question per context, in turn; with follow-ups the first and the next `followups`
            it = g[0] if followups else g[c % len(g)]
            later = [(x.prompt, _reference(x.meta)) for x in g[1 : 1 + followups]]
            sid = f"longtext-{split}-{gen_seed}-{kind}_{length}-{it.id}"
            col.append(
                TraceSample(
                    sid,
                    [],
                    it.prompt,
                    _reference(it.meta),
                    later,
                    context=it.context,
                    max_new_tokens=budget,
                )
            )
        columns.append(col)
    out = [col[i] for i in range(per) for col in columns]
    return out[:n]


def load_samples(spec: str, limit: int | None = None, seed: int = 0, followups: int = 0) -> list[TraceSample]:
    """`toy[:N]`, `zoo:SPLIT[:N]` (`zoo576:SPLIT[:N]`: the 576-token scenes),
    `longtext:SPLIT[:N[:LENGTHS[:KINDS]]]` (text samples for a plain LM), an MMBench TSV, or a JSONL of
    {image, question, answer}. `followups` (zoo and longtext) adds later questions about the same image, or
    the same context, to each sample."""
    if spec.startswith("longtext"):
        split, n, lengths, kinds = parse_longtext_spec(spec, limit)
        return longtext_samples(split, n, seed, lengths, kinds, followups)
    if spec.startswith("toy"):
        n = int(spec.split(":", 1)[1]) if ":" in spec else (limit or 64)
        return toy_samples(min(n, limit or n), seed=seed)
    if spec.startswith("zoo"):
        parts = spec.split(":")
        split = parts[1] if len(parts) > 1 and parts[1] else "train"
        n = int(parts[2]) if len(parts) > 2 else (limit or 512)
        geometry = 576 if parts[0] == "zoo576" else 64
        return zoo_samples(split, min(n, limit or n), seed, followups, geometry)
    path = Path(spec)
    if not path.is_file():
        raise DataError(
            f"KVP data {spec!r}: no such file; give an MMBench .tsv, a .jsonl, 'zoo:train[:N]' or 'toy:N'"
        )
    if path.suffix == ".tsv":
        samples = mmbench_samples(path)
    elif path.suffix in (".jsonl", ".json"):
        samples = jsonl_samples(path)
    else:
        raise DataError(f"KVP data {path}: unknown format {path.suffix!r}; use an MMBench .tsv or a .jsonl")
    if not samples:
        raise DataError(f"KVP data {path} holds no samples")
    return samples[:limit] if limit else samples


# ----------------------------------------------------------------------------------------------------------
# the recorder of one sample (fed each layer by the Q/K capture)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Recorder:
    prompt_len: int
    store_queries: bool
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def record(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> None:
        n = self.prompt_len
        B, Hq, T, D = query.shape
        Hkv = key.shape[1]
        G = Hq // Hkv
        rec = {
            "keys": key[:, :, :n].detach().to(torch.float16).cpu(),
            "values": value[:, :, :n].detach().to(torch.float16).cpu(),
        }
        if self.store_queries:
            rec["queries"] = query[:, :, :n].detach().to(torch.float16).cpu()
        if T > n:  # answer queries j >= n read keys 0..j (causal); utility = their attention to the prompt
            qa = query[:, :, n:].float()
            kk = key.float().repeat_interleave(G, dim=1)
            logits = torch.matmul(qa, kk.transpose(-1, -2)) * scaling  # (B, Hq, T-n, T)
            j = torch.arange(n, T, device=query.device)[:, None]
            i = torch.arange(T, device=query.device)[None, :]
            logits = logits.masked_fill(i > j, float("-inf"))
            att = logits.softmax(dim=-1)[..., :n].sum(dim=2)  # (B, Hq, n)
            util = att.view(B, Hkv, G, n).amax(dim=2)
        else:
            util = torch.zeros(B, Hkv, n)
        rec["utility"] = util.float().cpu()
        self.layers[int(module.layer_idx)] = rec


def _conversation(sample: TraceSample, answer: str | None) -> list[dict]:
    content = [{"type": "image"} for _ in sample.images] + [{"type": "text", "text": sample.question}]
    msgs = [{"role": "user", "content": content}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        for q, a in sample.followups:
            msgs.append({"role": "user", "content": [{"type": "text", "text": q}]})
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return msgs


def _tokenise(processor: Any, sample: TraceSample, text: str) -> dict:
    return dict(processor(images=sample.images or None, text=[text], return_tensors="pt"))


@torch.no_grad()
def capture_sample(
    model: Any,
    processor: Any,
    sample: TraceSample,
    answer: str = "reference",
    max_new_tokens: int = 32,
    store_queries: bool = True,
    compress: str = "prompt",
    reconstruction: bool = False,
) -> dict[str, torch.Tensor]:
    """Run one sample and return its trace tensors (see the module docstring). The future queries are every
    token after the prompt that is fed back to the model: the answer, then the follow-up turns (the final
    end-of-sequence token is never fed, so it is not a query). With `compress="image"` the trace's prompt
    ends at the last image token, as the cache is compressed with `--compress image` (question-agnostic):
    the question then belongs to the future, whose attention is the utility. A text sample (`context` set)
    runs on a plain LM (`_capture_text`); `compress="context"` ends its prompt at the context likewise."""
    if compress not in COMPRESS_AT:
        raise ConfigError(f"compress must be one of {COMPRESS_AT}, got {compress!r}")
    if sample.context is not None:
        return _capture_text(
            model, processor, sample, answer, max_new_tokens, store_queries, compress, reconstruction
        )
    if reconstruction:
        raise DataError(
            f"sample {sample.sample_id}: the reconstruction utility is captured for text samples only"
        )
    if compress == "context":
        raise DataError(
            f"sample {sample.sample_id}: compress='context' is for text samples (a context read before the "
            "question); use compress='image' for the question-agnostic setting of an image"
        )
    device = next(model.parameters()).device
    prompt = processor.apply_chat_template(_conversation(sample, None), add_generation_prompt=True)
    inputs = {k: v.to(device) for k, v in _tokenise(processor, sample, prompt).items()}
    ids = inputs["input_ids"]
    n = ids.shape[1]
    if answer == "greedy":
        gen = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        text_answer = processor.tokenizer.decode(gen[0, n:], skip_special_tokens=True).strip()
    elif answer == "reference":
        text_answer = sample.answer
    else:
        raise DataError(f"answer mode {answer!r}: use 'reference' or 'greedy'")
    conv = processor.apply_chat_template(_conversation(sample, text_answer))
    full = {k: v.to(device) for k, v in _tokenise(processor, sample, conv).items()}
    full_ids = full["input_ids"]
    if full_ids.shape[1] <= n or not torch.equal(full_ids[:, :n], ids):
        raise DataError(
            f"sample {sample.sample_id}: the prompt's tokens are not a prefix of the conversation's; "
            "the processor's chat template must render the user turn the same way with and without the answer"
        )
    if compress == "image":
        image_token_id = getattr(model.config, "image_token_id", None)
        where = (ids[0] == image_token_id).nonzero()
        if image_token_id is None or where.numel() == 0:
            raise DataError(f"sample {sample.sample_id}: compress='image' needs an image in the prompt")
        n = int(where[-1]) + 1
        ids = ids[:, :n]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    if int(full_ids[0, -1]) in eos_ids:
        full_ids = full_ids[:, :-1]
    full["input_ids"] = full_ids
    if "attention_mask" in full:
        full["attention_mask"] = torch.ones_like(full_ids)
    if "mm_token_type_ids" in full:  # Qwen2-VL: one per token, cut with the ids
        full["mm_token_type_ids"] = full["mm_token_type_ids"][:, : full_ids.shape[1]]
    out = _recorded_forward(model, full, n, store_queries)
    # image tokens and their (grid, row, col) as the cache sees them (newlines are text), prompt part
    pixel = {k: v for k, v in inputs.items() if k in GEOMETRY_INPUTS}
    geo = image_geometry(model, inputs["input_ids"], None, **pixel)
    is_img = geo.is_image[0, :n].cpu()
    out["positions"] = torch.arange(n, dtype=torch.int32)
    out["modality"] = torch.where(is_img, IMAGE, TEXT).to(torch.int8)
    out["image_rc"] = geo.image_rc[0, :n].cpu().to(torch.int16)
    out["future_len"] = torch.tensor([full_ids.shape[1] - n], dtype=torch.int32)
    return out


def _recorded_forward(model: Any, inputs: dict, n: int, store_queries: bool) -> dict[str, torch.Tensor]:
    """One forward over the whole conversation through the Q/K capture: per layer, the first `n`
    tokens' keys / values (/ queries) and the utility the later tokens give them, stacked over layers."""
    rec = _Recorder(prompt_len=n, store_queries=store_queries)
    with capture_qk(model, on_layer=lambda qk: rec.record(qk.module, qk.query, qk.key, qk.value, qk.scaling)):
        model(**inputs, use_cache=False)
    L = len(rec.layers)
    if L == 0 or sorted(rec.layers) != list(range(L)):
        raise ModelError(
            f"{type(model).__name__}: the capture attention saw layers {sorted(rec.layers)}; KVP traces need a "
            "model whose attention goes through transformers' attention interface"
        )
    return {k: torch.cat([rec.layers[i][k] for i in range(L)], dim=0) for k in rec.layers[0]}


def _capture_text(
    model: Any,
    processor: Any,
    sample: TraceSample,
    answer: str,
    max_new_tokens: int,
    store_queries: bool,
    compress: str,
    reconstruction: bool = False,
) -> dict[str, torch.Tensor]:
    """`capture_sample` for a text sample on a plain LM (`processor`: its tokenizer, or a processor holding
    one). The tokens are the harness's (eval/textgen.py): the head (chat template + context + separator),
    the question with the assistant tag, then the answer (greedy: the model's own, from the full cache, cut
    before its end-of-turn token, which is never fed back). A sample with follow-ups (compress='context'
    only) asks each of its questions of the context on its own; the context's utility is the sum of the
    attention every question's future pays it (each future summed over its queries, as for one)."""
    from ..eval.textgen import split_prompt
    from ..prompts import tokenizer_of

    if compress == "image":
        raise DataError(
            f"sample {sample.sample_id} is text (no image): use compress='context' for the question-agnostic "
            "setting (the prompt ends at the context) or 'prompt'"
        )
    if sample.followups and compress != "context":
        raise DataError(
            f"sample {sample.sample_id}: follow-up questions of a text context are asked of the compressed "
            "context, so they need compress='context' (or no follow-ups)"
        )
    if sample.followups:  # each question asked of the context on its own; the utilities add up
        out = None
        for q, a in [(sample.question, sample.answer), *sample.followups]:
            one = replace(sample, question=q, answer=a, followups=[])
            # the context (and so its reconstruction utility) is the same for every question: the first's
            first = out is None
            rec = _capture_text(
                model,
                processor,
                one,
                answer,
                max_new_tokens,
                store_queries,
                compress,
                reconstruction and first,
            )
            if first:
                out = rec
            else:
                out["utility"] = out["utility"] + rec["utility"]
                out["future_len"] = out["future_len"] + rec["future_len"]
        return out
    tok = tokenizer_of(processor)
    device = next(model.parameters()).device
    asked = SimpleNamespace(context=sample.context, prompt=sample.question)
    head, tail = split_prompt(tok, asked, device)
    ids = torch.cat([head, tail], dim=1)
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    if answer == "greedy":
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=sample.max_new_tokens or max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad,
        )
        new = gen[:, ids.shape[1] :]
    elif answer == "reference":
        new = tok(sample.answer, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    else:
        raise DataError(f"answer mode {answer!r}: use 'reference' or 'greedy'")
    row = new[0].tolist()
    cut = next((k for k, t in enumerate(row) if t in stop), len(row))
    full_ids = torch.cat([ids, new[:, :cut]], dim=1)
    n = head.shape[1] if compress == "context" else ids.shape[1]
    out = _recorded_forward(model, {"input_ids": full_ids}, n, store_queries)
    out["positions"] = torch.arange(n, dtype=torch.int32)
    out["modality"] = torch.full((n,), TEXT, dtype=torch.int8)
    out["image_rc"] = torch.full((n, 3), -1, dtype=torch.int16)
    out["future_len"] = torch.tensor([full_ids.shape[1] - n], dtype=torch.int32)
    if reconstruction:
        out["reconstruction"] = reconstruction_utility(model, tok, full_ids[:, :n])
    return out


def reconstruction_utility(model: Any, tokenizer: Any, prompt_ids: torch.Tensor) -> torch.Tensor:
    """(L, Hkv, n) float32: KVzip's score of each prompt token (policies/kvzip.py: the largest attention it
    receives while the model reconstructs the prompt after a repeat prompt, encoded with `tokenizer`; the
    first tokens score 1), a question-agnostic utility that needs no future."""
    from ..policies.kvzip import KVzip

    kvzip = KVzip()
    kvzip.bind_tokenizer(tokenizer)
    prepared = kvzip.prepare_request(model, prompt_ids, torch.ones_like(prompt_ids))
    return torch.stack([s[0] for s in prepared.scores]).float().cpu()


UTILITIES = ("future", "reconstruction", "mixed")


def check_utility(utility: str, weight: float = 1.0) -> None:
    """A ConfigError for a utility `select_utility` does not know or a reconstruction weight not > 0."""
    if utility not in UTILITIES:
        raise ConfigError(f"utility must be one of {UTILITIES}, got {utility!r}")
    if not weight > 0:
        raise ConfigError(f"reconstruction_weight must be > 0, got {weight}")


def select_utility(trace: dict[str, Any], utility: str, weight: float = 1.0) -> dict[str, Any]:
    """The trace with `utility` as its "utility": `future` (the attention the future pays, as captured),
    `reconstruction` (KVzip's reconstruction attention) or `mixed` (the two, each normalised to sum 1 per
    layer and KV head, the reconstruction's times `weight`, added: a token either one needs ranks high)."""
    check_utility(utility, weight)
    if utility == "future":
        return trace
    if "reconstruction" not in trace:
        raise DataError(
            "these traces hold no reconstruction utility: capture them with the reconstruction utility "
            "(train-kvp --utility reconstruction or mixed) into a new --out"
        )
    rec = trace["reconstruction"].float()
    if utility == "reconstruction":
        return trace | {"utility": rec}

    def share(u: torch.Tensor) -> torch.Tensor:
        return u / u.sum(-1, keepdim=True).clamp_min(1e-12)

    return trace | {"utility": share(trace["utility"].float()) + weight * share(rec)}


# ----------------------------------------------------------------------------------------------------------
# shards
# ----------------------------------------------------------------------------------------------------------


def _read_manifest(out_dir: Path) -> dict | None:
    p = out_dir / MANIFEST
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ResultsError(f"{p} is corrupt ({e}); delete {out_dir} to capture again") from e


def capture_traces(
    model: Any,
    processor: Any,
    samples: list[TraceSample],
    out_dir: str | Path,
    data_spec: str = "",
    answer: str = "reference",
    shard_size: int = 64,
    store_queries: bool = True,
    max_new_tokens: int = 32,
    progress: Callable[[int, int], None] | None = None,
    compress: str = "prompt",
    reconstruction: bool = False,
) -> Path:
    """Capture traces for `samples` into `out_dir` (shard_XXXXX.safetensors + manifest.json). Resumes a
    previous capture of the same model, data and settings after its last complete shard."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sig = model_signature(model)
    settings = {
        "data": data_spec,
        "answer": answer,
        "shard_size": shard_size,
        "store_queries": store_queries,
        "num_samples": len(samples),
    }
    if compress != "prompt":  # recorded only when set, so captures made before the option still resume
        settings["compress"] = compress
    if reconstruction:  # likewise
        settings["reconstruction"] = True
    manifest = _read_manifest(out_dir)
    if manifest is None:
        manifest = {"model": sig, "settings": settings, "shards": []}
    else:
        if manifest["model"].get("fingerprint") != sig["fingerprint"] or manifest["settings"] != settings:
            raise ResultsError(
                f"{out_dir} holds traces of another capture (model {manifest['model'].get('fingerprint')}, "
                f"settings {manifest['settings']}); use a new --out directory or delete it"
            )
    done = sum(s["count"] for s in manifest["shards"])
    if done:
        logger.info("resuming capture in %s after %d samples", out_dir, done)
    model.eval()
    for start in range(done, len(samples), shard_size):
        chunk = samples[start : start + shard_size]
        tensors: dict[str, torch.Tensor] = {}
        ids = []
        for k, s in enumerate(chunk):
            tr = capture_sample(
                model,
                processor,
                s,
                answer=answer,
                max_new_tokens=max_new_tokens,
                store_queries=store_queries,
                compress=compress,
                reconstruction=reconstruction,
            )
            for name, t in tr.items():
                tensors[f"{k}.{name}"] = t.contiguous()
            ids.append(s.sample_id)
            if progress:
                progress(start + k + 1, len(samples))
        name = f"shard_{len(manifest['shards']):05d}.safetensors"
        atomic_write_bytes(out_dir / name, save(tensors, metadata={"sample_ids": json.dumps(ids)}))
        manifest["shards"].append({"file": name, "count": len(chunk), "sample_ids": ids})
        atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1))
    return out_dir


def iter_traces(trace_dir: str | Path) -> Iterator[dict[str, torch.Tensor]]:
    """Every captured sample of a trace directory, in capture order, as a dict of tensors."""

    trace_dir = Path(trace_dir)
    manifest = _read_manifest(trace_dir)
    if manifest is None:
        raise DataError(
            f"{trace_dir} holds no KVP traces ({MANIFEST} missing); capture them with `mm-oval train-kvp`"
        )
    for shard in manifest["shards"]:
        path = trace_dir / shard["file"]
        try:
            tensors = load_file(str(path))
        except Exception as e:  # noqa: BLE001
            raise DataError(
                f"{path}: trace shard cannot be read ({e}); delete it and its manifest entry, then resume"
            ) from e
        for k in range(shard["count"]):
            prefix = f"{k}."
            yield {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)} | {
                "sample_id": shard["sample_ids"][k]
            }


def trace_model_signature(trace_dir: str | Path) -> dict:
    manifest = _read_manifest(Path(trace_dir))
    if manifest is None:
        raise DataError(f"{trace_dir} holds no KVP traces ({MANIFEST} missing)")
    return manifest["model"]


def load_traces(trace_dirs: Iterable[str | Path]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for d in trace_dirs:
        out.extend(iter_traces(d))
    return out
