"""The generic evaluation runner: a LLaVA-style model (optionally wrapped by a method spec) answers a
task's items, greedily and in left-padded batches; each process of an `accelerate launch` takes a
stride of the items; predictions are appended to a per-rank JSONL as they come, so a rerun with the
same output directory resumes; the results JSON is written atomically.

The runner knows nothing of policies: "full" is the plain model, any other spec goes to
`mm_oval.wrap(model, config=OvalConfig.from_spec(spec, budget))` and is unwrapped afterwards.

Output directory:
    run.json                     the run's identity (task, data, model, dtype, device kind, weights
                                 fingerprint, method, budget, limit, ...): a resume must match it
    .lock                        held (flock) by the run writing into the folder; a second run is refused
    predictions.rank<R>.jsonl    {"id", "prediction", "rank", "new_tokens"[, "turn"][, "kv"]} per item,
                                 appended; "kv" (the batch's KV figures) rides on a batch's last record
    results.json                 config, versions, counts, scores, KV figures, timings (rank 0, atomic)
    predictions_official.*       the predictions in the task's official format (readable by `mm-oval score`)
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
from tqdm.auto import tqdm
from transformers import DynamicCache

from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError, DataError, ModelError, ResultsError
from mm_oval.files import FolderLock, atomic_write_json, remove_stale_tmp
from mm_oval.geometry import SUPPORTED_CLASSES, TEXT_FAMILIES, is_text_only
from mm_oval.modelfiles import load_model  # noqa: F401 (the harness's loader is the library's)
from mm_oval.prompts import COMPRESS_AT, chat_prompt, to_model
from mm_oval.stats import get_stats
from mm_oval.wrapper import is_wrapped, new_cache, new_request, prefill, unwrap, wrap

from .files import JsonlAppender, iter_records, read_json
from .tasks import Item, Task, get_task, resolve_data
from .textgen import generate_text, generate_text_conversation

log = logging.getLogger(__name__)

# bump when prompts or the prediction record change: a resumed directory must hold the same kind of run
# (3: the identity holds the method's resolved configuration, `resolved`, as well as its spec string)
RUN_FORMAT = 3
IDENTITY_KEYS = ("format", "task", "data", "data_options", "model", "dtype", "device", "weights", "method",
                 "resolved", "budget", "limit", "max_new_tokens", "multi_turn", "compress")  # fmt: skip


@dataclass
class RunConfig:
    """What defines a run (everything that can change a prediction) plus how it is executed."""

    task: str
    data: str
    model: str
    method: str = "full"
    budget: float | int | None = None
    limit: int | None = None
    max_new_tokens: int | None = None
    multi_turn: int | None = None
    compress: str = "prompt"
    data_options: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None  # the weights' dtype: float16 and bfloat16 answers differ
    device: str | None = None  # the device kind (cpu, cuda, mps): kernels and numerics differ
    weights: dict[str, Any] | None = None  # `weights_fingerprint`: the same path may hold other weights
    # `resolved_method`: the spec with every default spelled out (a default that changes between versions
    # changes the run, not silently its meaning)
    resolved: dict[str, Any] | None = None
    batch_size: int = 1  # does not change predictions (tested), so not part of the identity
    format: int = RUN_FORMAT

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: d[k] for k in IDENTITY_KEYS}


# ---------------------------------------------------------------- processes


def process_state() -> Any:
    """accelerate's process state. Without a GPU the processes of a launch (torchrun-style env vars)
    talk over gloo on the CPU; accelerate only does that when told it is on the CPU."""
    return PartialState(cpu=not torch.cuda.is_available())


# ---------------------------------------------------------------- model loading


def parse_budget(raw: str | float | int | None) -> float | int | None:
    """ "0.25" -> 0.25 (a fraction), "64" -> 64 (a token count)."""
    if raw is None or isinstance(raw, (int, float)):
        return raw
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(
            f"budget {raw!r} is neither a fraction like 0.25 nor a token count like 64"
        ) from None


def check_model(model: Any, text_task: bool) -> None:
    """A text task runs on a plain decoder-only LM (or any model the wrapper takes); an image task needs a
    LLaVA-style model."""
    if text_task:
        if is_text_only(model) or getattr(getattr(model, "config", None), "image_token_id", None) is not None:
            return
        raise ModelError(
            f"{type(model).__name__} is not a model the long-context text tasks run on: pass a plain "
            f"decoder-only LM ({', '.join(TEXT_FAMILIES.values())}), e.g. --model smollm2"
        )
    if is_text_only(model):
        raise ModelError(
            f"{type(model).__name__} is a language model without a vision tower: image tasks need a LLaVA-style "
            "model; for a plain LM pick a text task (passkey_1k, needle_1k, message_1k, duo_1k)"
        )
    check_llava(model)


def check_llava(model: Any) -> None:
    cfg = getattr(model, "config", None)
    if (
        getattr(cfg, "model_type", None) not in SUPPORTED_CLASSES
        or getattr(cfg, "image_token_id", None) is None
    ):
        raise ModelError(
            f"{type(model).__name__} is not a LLaVA-style model: the evaluation needs a "
            f"{' / '.join(SUPPORTED_CLASSES.values())} (config.model_type one of {', '.join(SUPPORTED_CLASSES)}, "
            "with an image_token_id)"
        )


# the files of a model folder whose change can change an answer (weights, configs, tokenizer, template)
FINGERPRINT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".txt", ".jinja")
FINGERPRINT_SAMPLES = 16  # values read from each parameter tensor
_CONFIG_VOLATILE = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash")


def weights_fingerprint(model: Any) -> dict[str, Any]:
    """A cheap fingerprint of the weights a model holds, loaded from a folder or built in Python: a hash of
    its config, a hash of every parameter's name, shape and dtype plus a few values strided across it
    (16 per tensor: milliseconds at 7B), and, when `config._name_or_path` is a local folder, the size and
    modification time of its weight, config and tokenizer files."""
    cfg = model.config

    def scrub(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: scrub(v) for k, v in d.items() if k not in _CONFIG_VOLATILE}
        return d

    cfg_text = json.dumps(scrub(cfg.to_dict()), sort_keys=True, default=str)
    h = hashlib.sha256()
    samples = []
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        if p.numel() == 0 or p.device.type == "meta":  # offloaded weights: shape only
            continue
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
        samples.append(flat[::step][:FINGERPRINT_SAMPLES].float().cpu())
    if samples:
        h.update(torch.cat(samples).numpy().tobytes())
    out: dict[str, Any] = {
        "config": hashlib.sha256(cfg_text.encode()).hexdigest()[:16],
        "tensors": h.hexdigest()[:16],
        "files": {},
    }
    src = str(getattr(cfg, "_name_or_path", "") or "")
    folder = Path(src) if src else None
    if folder is not None and folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.name.endswith(FINGERPRINT_FILES):
                st = f.stat()
                out["files"][f.name] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- methods


def check_method(method: str, budget: float | int | None) -> Any:
    """The `OvalConfig` of a method spec and budget (None for 'full'), or the ConfigError a typo causes;
    nothing is touched, so a run (or every cell of a sweep) can be checked before anything is written."""
    if method == "full":
        if budget not in (None, 1, 1.0):
            raise ConfigError("--budget applies to compressed methods; method 'full' keeps the whole cache")
        return None
    return OvalConfig.from_spec(method, budget)


def resolved_method(config: OvalConfig | None) -> dict[str, Any]:
    """The configuration a method spec and budget run (`check_method`'s result), every default included, as
    JSON values (the form a run.json holds, so an identity read back compares equal): `OvalConfig.resolved`;
    {"method": "full"} for None."""
    resolved = {"method": "full"} if config is None else config.resolved()
    return json.loads(json.dumps(resolved, sort_keys=True, default=str))


def apply_method(model: Any, method: str, budget: float | int | None) -> bool:
    """Wrap `model` in place for a method spec; return whether it was wrapped (to unwrap afterwards)."""
    if is_wrapped(model):
        raise ConfigError("the model is already wrapped: pass the plain model and a method spec instead")
    config = check_method(method, budget)
    if config is None:
        return False
    wrap(model, config=config)
    return True


def remove_method(model: Any) -> None:
    unwrap(model)


def kv_stats(model: Any) -> dict[str, Any] | None:
    if not is_wrapped(model):
        return None
    try:
        s = get_stats(model)
    except Exception as e:  # stats are a report, never a reason to lose an evaluation
        log.debug("no KV stats: %s", e)
        return None
    return {k: v for k, v in s.items() if k != "layers"}


KV_TIME_KEYS = ("prefill_s", "decode_s")


def summarize_kv(rows: list[dict]) -> dict[str, Any]:
    """Totals over the requests of a run (each row: one generate call's stats, in item order).
    Wall-clock figures are left out here (they go to the timings): these figures are reproducible."""
    if not rows:
        return {}
    full = sum(r.get("kv_bytes_full") or 0 for r in rows)
    kept = sum(r.get("kv_bytes_kept") or 0 for r in rows)

    out = {
        k: rows[0].get(k)
        for k in ("method", "budget", "text_budget", "eviction_scope", "retrieval", "read_budget")
    }
    out.update(
        {
            "requests": len(rows),
            "kv_bytes_full": int(full),
            "kv_bytes_kept": int(kept),
            "kv_fraction_kept": kept / full if full else None,
            "image_kv_fraction_kept": _mean_of(rows, "image_kv_fraction_kept"),
            "page_read_fraction": _mean_of(rows, "page_read_fraction"),
            "decode_steps": sum(r.get("decode_steps") or 0 for r in rows),
        }
    )
    # bytes the decode steps read against dense attention (rows of runs saved before they were counted
    # have none: the figures are then absent rather than wrong)
    reads = [r["bytes_read"]["total"] for r in rows if isinstance(r.get("bytes_read"), dict)]
    if reads:
        read, dense = sum(t["read"] for t in reads), sum(t["dense"] for t in reads)
        out["read_bytes_budget"] = rows[0].get("read_bytes_budget")
        out["bytes_read"] = int(read)
        out["bytes_dense"] = int(dense)
        out["read_vs_dense"] = read / dense if dense else None
        # the steps that feed one token, without the forwards of several (a question read after a
        # compressed context, a later turn): what read_bytes_budget bounds
        chunks = [r["bytes_read"].get("chunks") for r in rows if isinstance(r.get("bytes_read"), dict)]
        if all(isinstance(ch, dict) for ch in chunks):  # absent from rows saved before it was counted
            read1 = read - sum(ch["read"] for ch in chunks)
            dense1 = dense - sum(ch["dense"] for ch in chunks)
            out["one_token_read_vs_dense"] = read1 / dense1 if dense1 else None
    # with monitor_retrieval: the selection against exact attention, the mean over the requests measured
    mons = [r["retrieval_monitor"] for r in rows if isinstance(r.get("retrieval_monitor"), dict)]
    if mons:
        per_layer = [m.get("layer_attention_mass_recall") or [] for m in mons]
        layers = max(len(p) for p in per_layer)
        by_layer = [[p[i] for p in per_layer if i < len(p) and p[i] is not None] for i in range(layers)]
        out["retrieval_monitor"] = {
            "requests": len(mons),
            **{k: _mean_of(mons, k) for k in ("hit_rate", "attention_mass_recall", "page_utilisation")},
            "layer_attention_mass_recall": [sum(v) / len(v) if v else None for v in by_layer],
        }
    return out


def _mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


# ---------------------------------------------------------------- generation


def model_inputs(processor: Any, model: Any, images: list, texts: list[str]) -> dict[str, torch.Tensor]:
    processor.tokenizer.padding_side = "left"
    return to_model(processor(images=images, text=texts, return_tensors="pt", padding=True), model)


def gen_kwargs(processor: Any, max_new_tokens: int) -> dict[str, Any]:
    tok = processor.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1, "pad_token_id": pad}


def generate_batch(
    model: Any, processor: Any, items: list[Item], max_new_tokens: int
) -> list[tuple[str, int]]:
    """Greedy answers for a batch (left padding); (text, number of new tokens) per item."""
    images = [it.image() for it in items]
    inputs = model_inputs(processor, model, images, [chat_prompt(processor, it.prompt) for it in items])
    kw = gen_kwargs(processor, max_new_tokens)
    with torch.inference_mode():
        seq = model.generate(**inputs, **kw)
    return decode_answers(processor.tokenizer, seq[:, inputs["input_ids"].shape[1] :])


def prompt_cache(model: Any, **inputs: Any) -> Any:
    """The cache a request's prompt (`inputs`) runs through: for a wrapped model, a fresh one with the request
    begun (`mm_oval.wrapper.new_request`: the images checked, the method's own pass over the prompt run);
    for the plain model, an empty DynamicCache. Then `model(**inputs, cache=cache, use_cache=True)`."""
    if is_wrapped(model):
        return new_request(model, **inputs)
    return DynamicCache(config=model.config.get_text_config())


def decode_answers(tok: Any, new: torch.Tensor) -> list[tuple[str, int]]:
    """(answer text, number of generated tokens up to and including the first EOS) per row."""
    texts = tok.batch_decode(new, skip_special_tokens=True)
    eos = tok.eos_token_id
    counts = [next((k + 1 for k, t in enumerate(row) if t == eos), len(row)) for row in new.tolist()]
    return [(t.strip(), n) for t, n in zip(texts, counts)]


def generate_image_first(
    model: Any,
    processor: Any,
    items: list[Item],
    max_new_tokens: int,
    kv_rows: list[dict] | None = None,
) -> list[tuple[str, int]]:
    """Greedy answers with the cache compressed right after the image: each prompt is split after its last
    image token; the first part (template head + image) is prefilled alone (a wrapped model compresses its
    cache there), then `generate` continues on that cache with the question. The question is not part of
    that prefill, so questions about one image share it: each distinct head (the same ids up to the image and
    the same pixels) is prefilled and compressed once, and every question about it is answered on its own
    copy of that cache (one at a time: the copies cannot be stacked into a batch). Each question's generate
    call is one request: a wrapped model's KV figures of every one are appended to `kv_rows`."""
    tok = processor.tokenizer
    kw = gen_kwargs(processor, max_new_tokens)
    wrapped = is_wrapped(model)
    heads: dict[tuple, list[int]] = defaultdict(list)  # a distinct head -> the items that ask about it
    encoded = []
    for i, it in enumerate(items):
        enc = model_inputs(processor, model, [it.image()], [chat_prompt(processor, it.prompt)])
        ids = enc["input_ids"]
        is_image = ids[0] == model.config.image_token_id
        if not bool(is_image.any()):
            raise ConfigError("compress='image' needs an image in every prompt")
        ctx = int(is_image.nonzero().max()) + 1
        pix = enc["pixel_values"]
        digest = hashlib.sha256(pix.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()
        heads[(tuple(ids[0, :ctx].tolist()), tuple(pix.shape), digest)].append(i)
        encoded.append((enc, ctx))
    out: list[tuple[str, int] | None] = [None] * len(items)
    for members in heads.values():
        enc, ctx = encoded[members[0]]
        head = {
            "input_ids": enc["input_ids"][:, :ctx],
            "attention_mask": torch.ones_like(enc["input_ids"][:, :ctx]),
            "pixel_values": enc["pixel_values"],
        }
        with torch.inference_mode():
            if wrapped:
                cache = prefill(model, **head)
            else:
                cache = DynamicCache(config=model.config.get_text_config())
                model(**head, cache=cache, use_cache=True)
            for k, i in enumerate(members):
                ids = encoded[i][0]["input_ids"]
                own = cache if k == len(members) - 1 else _copy_cache(cache)
                seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=own, **kw)
                out[i] = decode_answers(tok, seq[:, ids.shape[1] :])[0]
                stats = kv_stats(model) if kv_rows is not None else None
                if stats:  # the head's KV and this question's decode steps; its prefill time counted once
                    kv_rows.append(stats if k == 0 else {**stats, "prefill_s": 0.0})
    return out  # type: ignore[return-value]


def _copy_cache(cache: Any) -> Any:
    """An independent copy of a prefilled cache: mm-oval's own `copy()`, else a deep copy (DynamicCache)."""
    return cache.copy() if hasattr(cache, "copy") else copy.deepcopy(cache)


def generate_conversation(
    model: Any, processor: Any, items: list[Item], max_new_tokens: int, reuse_cache: bool = True
) -> list[tuple[str, int]]:
    """Multi-turn: one image, the items' questions asked in turn in one conversation. The first turn
    prefills image + question (a wrapped model compresses its cache there, once); each later turn feeds
    only the new tokens (end of turn, next question) on top of the same cache. The conversation is kept
    as token ids: each answer enters the next turn exactly as generated. `reuse_cache=False` re-prefills
    the whole conversation every turn instead (the reference the cached path must equal)."""
    tok = processor.tokenizer
    kw = gen_kwargs(processor, max_new_tokens)
    if is_wrapped(model):
        cache = new_cache(model)
    else:
        cache = DynamicCache(config=model.config.get_text_config())
    marker = "\u2063MMOVAL-ANSWER\u2063"
    history: list[tuple[str, str]] = []
    seq: torch.Tensor | None = None
    out = []
    for t, it in enumerate(items):
        if t == 0:
            inputs = model_inputs(processor, model, [it.image()], [chat_prompt(processor, it.prompt)])
            pixel_values = inputs["pixel_values"]
        else:
            # the template's text after the previous answer: end of turn, the next question, the assistant tag
            rendered = chat_prompt(processor, it.prompt, history[:-1] + [(history[-1][0], marker)])
            if marker not in rendered:
                raise ConfigError(
                    "multi-turn: the chat template drops assistant turns; cannot continue the conversation"
                )
            tail = rendered.split(marker, 1)[1]
            tail_ids = tok(tail, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
            prev = seq
            if prev[0, -1].item() == tok.eos_token_id:
                prev = prev[:, :-1]  # the template closes the turn itself
            ids = torch.cat([prev, tail_ids], dim=1)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if not reuse_cache:
                inputs["pixel_values"] = pixel_values
        with torch.inference_mode():
            if reuse_cache:
                seq = model.generate(**inputs, **kw, cache=cache)
            else:
                seq = model.generate(**inputs, **kw)
        new = seq[:, inputs["input_ids"].shape[1] :]
        text = tok.decode(new[0], skip_special_tokens=True).strip()
        n = int(new.shape[1])
        out.append((text, n))
        history.append((it.prompt, text))
    return out


# ---------------------------------------------------------------- the run


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("mm-oval", "torch", "transformers", "accelerate"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


_NESTED = ("weights", "files", "resolved", "method_options", "retrieval_options")
# knobs added to OvalConfig after runs were recorded, with the default that does what every run did before
# them: a run.json whose resolved method lacks one ran at that default, so it still resumes
_ADDED_KNOBS = {"read_head_budget": "uniform", "read_chunks": "retrieval", "dense_layers": 0,
                "read_layer_budget": "uniform", "unread_pages": "skip"}  # fmt: skip


def _differences(old: dict, new: dict, keys: Iterable[str], prefix: str = "") -> list[str]:
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if a == b or (prefix == "resolved." and k not in old and _ADDED_KNOBS.get(k, a) == b):
            continue
        if isinstance(a, dict) and isinstance(b, dict) and k in _NESTED:
            out += _differences(a, b, list(dict.fromkeys([*a, *b])), f"{prefix}{k}.")
        elif k == "resolved" and a is None:  # a run of format 2 or older
            out.append(f"{prefix}{k}: not recorded there (an older run format)")
        else:
            out.append(f"{prefix}{k}: {a!r} there, {b!r} now")
    return out


def _check_identity(out_dir: Path, run: RunConfig) -> None:
    """Refuse a folder that holds another run (listing every difference); record the identity of a new one."""
    ident = run.identity()
    path = out_dir / "run.json"
    if path.exists():
        old = read_json(path, "run file").get("identity", {})
        diff = _differences(old, ident, IDENTITY_KEYS)
        if diff:
            raise ResultsError(
                f"{out_dir} holds results of another configuration ({'; '.join(diff)}); "
                "use another --out, or delete that directory to start over"
            )
    elif any(out_dir.glob("predictions.rank*.jsonl")):
        raise ResultsError(f"{out_dir} holds predictions but no run.json; use another --out or delete them")
    else:
        atomic_write_json(path, {"identity": ident})


def claim_folder(out_dir: Path, state: Any, check: Callable[[], None] | None = None) -> FolderLock | None:
    """Rank 0 locks an output folder, removes the temporary files an interrupted write left there, and
    runs `check` (the identity check) under the lock; every rank of the launch gets its verdict, so a
    refused launch stops on all ranks, and the ranks of one launch share rank 0's lock. Returns the lock
    on rank 0 (None elsewhere) for the caller to release."""
    lock, error = None, None
    if state.is_main_process:
        try:
            lock = FolderLock(out_dir).acquire()
            remove_stale_tmp(out_dir)
            if check is not None:
                check()
        except Exception as e:
            if lock is not None:
                lock.release()
                lock = None
            error = e
    if state.num_processes > 1:
        error = broadcast_object_list([error], from_process=0)[0]
    if error is not None:
        raise error
    return lock


def _read_done(out_dir: Path, valid_ids: set[str]) -> dict[str, dict]:
    done: dict[str, dict] = {}
    for f in sorted(out_dir.glob("predictions.rank*.jsonl")):
        for rec in iter_records(f):
            if rec.get("id") in valid_ids and "prediction" in rec:
                done[rec["id"]] = rec
    return done


def _units(items: list[Item], multi_turn: int | None) -> list[list[Item]]:
    """Work units: single items, or conversations of up to K questions about the same image."""
    if not multi_turn:
        return [[it] for it in items]
    if multi_turn < 1:
        raise ConfigError(f"--multi-turn must be >= 1, got {multi_turn}")
    groups: dict[str, list[Item]] = {}
    for it in items:
        if it.group is None:
            raise ConfigError("this task has no image groups; --multi-turn needs a task like vqav2")
        groups.setdefault(it.group, []).append(it)
    units = []
    for members in groups.values():
        units += [members[i : i + multi_turn] for i in range(0, len(members), multi_turn)]
    return units


def _batches(units: list[list[Item]], batch_size: int, multi_turn: int | None) -> list[list[list[Item]]]:
    """A rank's generate calls: `batch_size` single items, or one conversation. The batches are cut from
    all the rank's units, done or not, so a resumed run batches (pads, groups) exactly as an uninterrupted
    one, and its KV figures are the same."""
    step = 1 if multi_turn else batch_size
    return [units[i : i + step] for i in range(0, len(units), step)]


def _check_count(name: str, value: Any, required: bool = False) -> None:
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")


@dataclass
class EvalOptions:
    """How `evaluate` runs a task: the method and its budget, which items, how they are generated, where
    the predictions go. (What defines the run, the resumable identity, is the `RunConfig` built from it.)"""

    method: str = "full"  # "full" (the plain model) or a method spec for `mm_oval.wrap`
    budget: float | int | str | None = None  # a fraction like 0.25 or a token count like 64
    limit: int | None = None  # the first N items
    batch_size: int = 1
    max_new_tokens: int | None = None  # default: the task's
    out_dir: str | Path | None = None  # per-rank predictions (resumable), run.json, results.json
    multi_turn: int | None = None  # ask up to K questions about one image in one conversation
    compress: str = "prompt"  # COMPRESS_AT
    model_name: str | None = None  # recorded instead of config._name_or_path
    progress: bool = True
    data_options: dict[str, Any] | None = None  # the task loader's options (e.g. a POPE split)
    extra_timings: dict[str, float] | None = None  # e.g. the model's load time, added to the timings
    rules: str | None = None  # the scoring rule; default: the task's


def evaluate(
    model: Any,
    processor: Any,
    task: str | Task,
    data: str | Path,
    *args: Any,
    **kwargs: Any,
) -> dict[str, Any]:
    """Evaluate `model` on a task and return the results dict (on every rank). The options are one
    `EvalOptions` (positional or `options=`) or its fields, in its order or as keywords (`method=`,
    `budget=`, `out_dir=`, ...). With `out_dir`, predictions are appended per rank as they come (a rerun
    resumes) and rank 0 writes results.json atomically."""
    options = kwargs.pop("options", None)
    if options is None and len(args) == 1 and isinstance(args[0], EvalOptions):
        options, args = args[0], ()
    if options is None:
        options = EvalOptions(*args, **kwargs)
    elif args or kwargs:
        raise TypeError("evaluate takes an EvalOptions or its fields, not both")
    return Evaluation(model, processor, task, data, options).run()


@dataclass
class _Generated:
    """One rank's part of a run: its records (resumed and new) and how long generating the new ones took."""

    records: dict[str, dict]
    new_items: int
    generate_s: float


@dataclass
class _Gathered:
    """Every rank's records by id, and per rank its counts and generate time."""

    records: dict[str, dict]
    per_rank: dict[str, dict]

    @property
    def predictions(self) -> dict[str, str]:
        return {i: rec["prediction"] for i, rec in self.records.items()}


class Evaluation:
    """One evaluation, in the order it happens: `load` (check every argument, read the items: nothing is
    written before this passes), `plan` (this rank's work units and batches), `generate` (the batches not
    done yet, appended to the rank's predictions file), `gather` (every rank's records), `score` (the
    results dict), `write` (official predictions and results.json, rank 0). `run` does them all, with the
    model wrapped for the method and the output folder locked in between."""

    def __init__(self, model: Any, processor: Any, task: str | Task, data: str | Path, options: EvalOptions):
        self.model, self.processor, self.options = model, processor, options
        self.task_arg, self.data_arg = task, data
        self.state = process_state()
        self.rank, self.world = self.state.process_index, self.state.num_processes
        self.out = Path(options.out_dir) if options.out_dir is not None else None

    def run(self) -> dict[str, Any]:
        t_start = time.perf_counter()
        self.load()
        self.plan()
        o = self.options
        # wrapping checks what the spec alone cannot (agents trained for another model) before the folder is
        # claimed and run.json written
        wrapped = apply_method(self.model, o.method, self.budget)
        lock: FolderLock | None = None
        try:
            done: dict[str, dict] = {}
            if self.out is not None:
                lock = claim_folder(self.out, self.state, lambda: _check_identity(self.out, self.run_config))
                done = _read_done(self.out, {it.id for it in self.items})
            gathered = self.gather(self.generate(done))
            results = self.score(gathered, t_start)
            self.write(results, gathered)
            self.state.wait_for_everyone()
            return results
        finally:
            if wrapped:
                remove_method(self.model)
            if lock is not None:
                lock.release()

    # ---- load: every argument is checked before anything is written (a typo must not leave a run.json
    # behind that refuses the corrected command)
    def load(self) -> None:
        o, model = self.options, self.model
        task = get_task(self.task_arg) if isinstance(self.task_arg, str) else self.task_arg
        text_task = task.modality == "text"  # a long-context text task (eval/longtext.py)
        check_model(model, text_task)
        task.rule(o.rules)  # the scoring rule (recorded in scores["rules"]); an unknown name fails here
        budget = parse_budget(o.budget)
        _check_count("--batch-size", o.batch_size, required=True)
        _check_count("--limit", o.limit)
        _check_count("--max-new-tokens", o.max_new_tokens)
        _check_count("--multi-turn", o.multi_turn)
        if o.compress not in COMPRESS_AT:
            raise ConfigError(f"compress must be one of {COMPRESS_AT}, got {o.compress!r}")
        if o.compress in ("image", "context") and o.multi_turn:
            raise ConfigError(
                f"compress={o.compress!r} is for single questions; multi-turn already asks after compression"
            )
        if (o.compress == "context") != text_task and o.compress != "prompt":
            raise ConfigError(
                f"compress={o.compress!r} does not apply to {task.name}: compress 'image' is for image tasks, "
                "'context' for the long-context text tasks (both compress before the question is read)"
            )
        method_config = check_method(o.method, budget)
        data_options = {k: v for k, v in (o.data_options or {}).items() if v is not None}
        data_path = resolve_data(self.data_arg, task)
        self.task, self.budget = task, budget
        self.max_new = o.max_new_tokens or task.max_new_tokens
        self.run_config = RunConfig(
            task=task.name,
            data=str(data_path.resolve()) if str(self.data_arg) != "bundled" else "bundled",
            model=o.model_name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
            method=o.method,
            resolved=resolved_method(method_config),
            budget=budget,
            limit=o.limit,
            max_new_tokens=self.max_new,
            multi_turn=o.multi_turn,
            compress=o.compress,
            data_options={k: str(v) for k, v in data_options.items()},
            dtype=_dtype_name(model.dtype),
            device=model.device.type,
            weights=weights_fingerprint(model),
            batch_size=o.batch_size,
        )
        items = task.load(data_path, limit=o.limit, **data_options)
        if not items:
            raise DataError(f"{data_path}: no {task.name} items found")
        if len({it.id for it in items}) != len(items):
            raise DataError(f"{data_path}: item ids repeat; each question needs a unique id")
        self.items = items

    # ---- plan: this rank's stride of the work units, cut into generate calls
    def plan(self) -> None:
        o = self.options
        if o.multi_turn and o.batch_size > 1:
            log.warning(
                "--multi-turn runs one conversation at a time; --batch-size %d is ignored", o.batch_size
            )
        self.mine = _units(self.items, o.multi_turn)[self.rank :: self.world]
        self.batches = _batches(self.mine, o.batch_size, o.multi_turn)

    # ---- generate: the batches with an item not done yet
    def generate(self, done: dict[str, dict]) -> _Generated:
        o = self.options
        records: dict[str, dict] = {it.id: done[it.id] for u in self.mine for it in u if it.id in done}
        # a batch cut short by a crash is generated again whole (only its missing records are written)
        todo = [b for b in self.batches if any(it.id not in records for u in b for it in u)]
        n_new = sum(1 for b in todo for u in b for it in u if it.id not in records)
        if done:
            total = sum(map(len, self.mine))
            log.info(
                "rank %d: %d of its %d items already done; %d to go", self.rank, len(records), total, n_new
            )
        path = self.out / f"predictions.rank{self.rank}.jsonl" if self.out is not None else None
        appender = JsonlAppender(path) if path is not None else None
        t_gen = time.perf_counter()
        try:
            bar = tqdm(
                total=n_new,
                desc=f"{self.task.name} [{o.method}]",
                unit="q",
                disable=not (o.progress and self.state.is_main_process),
            )
            for batch in todo:
                new = self._generate_batch([it for u in batch for it in u], records)
                for rec in new:
                    records[rec["id"]] = rec
                    if appender is not None:
                        appender.write(rec)
                bar.update(len(new))
            bar.close()
        finally:
            if appender is not None:
                appender.close()
        return _Generated(records, n_new, time.perf_counter() - t_gen)

    def _generate_batch(self, flat: list[Item], records: dict[str, dict]) -> list[dict]:
        """One generate call; the records of its items not recorded yet."""
        o, model, processor = self.options, self.model, self.processor
        kv_rows: list[dict] = []
        if flat and flat[0].context is not None:  # a long-context text task

            def record() -> None:
                stats = kv_stats(model)
                if stats:
                    kv_rows.append(stats)

            if o.multi_turn:
                answers = generate_text_conversation(model, processor, flat, self.max_new)
            else:
                answers = generate_text(model, processor, flat, self.max_new, o.compress, on_request=record)
        elif o.multi_turn:
            answers = generate_conversation(model, processor, flat, self.max_new)
        elif o.compress == "image":
            answers = generate_image_first(model, processor, flat, self.max_new, kv_rows=kv_rows)
        else:
            answers = generate_batch(model, processor, flat, self.max_new)
        if not kv_rows:
            stats = kv_stats(model)
            kv_rows = [stats] if stats else []
        new = [(t, it, a) for t, (it, a) in enumerate(zip(flat, answers)) if it.id not in records]
        out = []
        for k, (turn, it, (text, ntok)) in enumerate(new):
            rec: dict[str, Any] = {"id": it.id, "prediction": text, "rank": self.rank, "new_tokens": ntok}
            if o.multi_turn:
                rec["turn"] = turn
            if kv_rows and k == len(new) - 1:
                # the batch's KV figures (one row per request) travel with its last record: the batch
                # counts once it is written, and a batch cut short is generated again whole
                rec["kv"] = kv_rows
            out.append(rec)
        return out

    # ---- gather: every rank contributes its stride; all_gather so every rank returns the same results
    def gather(self, mine: _Generated) -> _Gathered:
        gathered = gather_object([(self.rank, list(mine.records.values()), mine.generate_s, mine.new_items)])
        all_records: dict[str, dict] = {}
        per_rank = {}
        for r, recs, gs, nn in gathered:
            for rec in recs:
                all_records[rec["id"]] = rec
            per_rank[str(r)] = {"items": len(recs), "new_items": nn, "generate_s": gs}
        return _Gathered(all_records, per_rank)

    # ---- score: the results dict
    def score(self, gathered: _Gathered, t_start: float) -> dict[str, Any]:
        all_records, per_rank, predictions = gathered.records, gathered.per_rank, gathered.predictions
        o, task, items = self.options, self.task, self.items
        # one row per request, in item order (a batch's rows ride on its last record)
        all_kv = [row for it in items for row in all_records.get(it.id, {}).get("kv", [])]
        t_score = time.perf_counter()
        scores = task.score(items, predictions, o.rules)
        score_s = time.perf_counter() - t_score
        total_new = sum(v["new_items"] for v in per_rank.values())
        gen_wall = max(v["generate_s"] for v in per_rank.values())
        extra = o.extra_timings or {}
        results: dict[str, Any] = {
            "task": task.name,
            "primary_metric": task.primary_metric,
            "primary": task.primary(scores),
            "config": asdict(self.run_config),
            "versions": _versions(),
            "counts": {
                "items": len(items),
                "predictions": sum(1 for it in items if it.id in predictions),
                "missing": sum(1 for it in items if it.id not in predictions),
                "new_tokens": sum(int(rec.get("new_tokens", 0)) for rec in all_records.values()),
            },
            "scores": scores,
            "kv": summarize_kv(all_kv),
            "timings": {
                **extra,
                "generate_s": gen_wall,
                **{f"kv_{k}": sum(r.get(k) or 0.0 for r in all_kv) for k in KV_TIME_KEYS if all_kv},
                "score_s": score_s,
                "total_s": time.perf_counter() - t_start + sum(extra.values()),
                "items_per_s": total_new / gen_wall if gen_wall > 0 and total_new else None,
            },
            "run": {
                "world_size": self.world,
                "device": str(self.model.device),
                "new_items": total_new,
                "per_rank": per_rank,
            },
        }
        if o.multi_turn:
            # the primary score of the questions asked at each turn: does a cache compressed once hold up?
            turns: dict[int, list[Item]] = {}
            for it in items:
                t = all_records.get(it.id, {}).get("turn")
                if t is not None:
                    turns.setdefault(int(t), []).append(it)
            results["scores_by_turn"] = {
                str(t): {"primary": task.primary(task.score(its, predictions, o.rules)), "items": len(its)}
                for t, its in sorted(turns.items())
            }
        return results

    # ---- write: rank 0 writes the official predictions and results.json
    def write(self, results: dict[str, Any], gathered: _Gathered) -> None:
        if self.out is None or not self.state.is_main_process:
            return
        official = self.task.write_predictions(
            self.out / "predictions_official", self.items, gathered.predictions
        )
        results["official_predictions"] = official.name
        atomic_write_json(self.out / "results.json", results)


def score_file(task: str, data: str | Path, predictions_file: str | Path, out: str | Path | None = None,
               limit: int | None = None, data_options: dict[str, Any] | None = None,
               rules: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Score another toolkit's predictions file with our rules (no model)."""
    _check_count("--limit", limit)
    task_obj = get_task(task)
    task_obj.rule(rules)  # an unknown scoring rule fails before the data are read
    data_path = resolve_data(data, task_obj)
    data_options = {k: v for k, v in (data_options or {}).items() if v is not None}
    items = task_obj.load(data_path, limit=limit, **data_options)
    preds = task_obj.read_predictions(Path(predictions_file), items)
    unknown = len(set(preds) - {it.id for it in items})
    scores = task_obj.score(items, preds, rules)
    results = {
        "task": task_obj.name,
        "primary_metric": task_obj.primary_metric,
        "primary": task_obj.primary(scores),
        "config": {
            "task": task_obj.name,
            "data": str(data_path),
            "predictions": str(predictions_file),
            "limit": limit,
            "data_options": {k: str(v) for k, v in data_options.items()},
        },  # fmt: skip
        "versions": _versions(),
        "counts": {
            "items": len(items),
            "predictions": sum(1 for it in items if it.id in preds),
            "missing": sum(1 for it in items if it.id not in preds),
            "unknown_ids": unknown,
        },
        "scores": scores,
    }
    if out is not None:
        p = Path(out)
        atomic_write_json(p / "results.json" if p.suffix != ".json" else p, results)
    return results
