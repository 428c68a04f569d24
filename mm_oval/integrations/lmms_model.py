"""`mm_oval_llava`: an lmms-eval model that runs a LLaVA-style model under an mm-oval method.

    python -m lmms_eval --model mm_oval_llava \
        --model_args pretrained=llava-hf/llava-1.5-7b-hf,method=snapkv,budget=0.25,compress=prompt,kv_path=logs/kv.json \
        --tasks vqav2_val --batch_size 8 --output_path logs/

model_args:
    pretrained   local folder, Hub id, or `bundled` (the bundled tiny LLaVA); loaded by
                 `mm_oval.modelfiles.load_pretrained` (safetensors only unless allow_pickle_weights=true;
                 never trust_remote_code)
    method       an mm-oval method spec as `mm-oval eval --method` takes it ("full", "snapkv", "kvp",
                 "oval", ...). lmms-eval splits model_args on commas, so a spec with several options goes
                 in quotes: method="snapkv:window=8,kernel=5"
    budget       as `--budget`: a fraction (0.25) or a token count (64)
    compress     prompt (after image + question, as LLaVA evaluates) or image (right after the image)
    dtype        auto (float16 on CUDA, float32 otherwise), float32, float16, bfloat16
    device       defaults to the accelerate process's device
    kv_path      where the per-request KV figures and their summary are written (JSON; rank R of a
                 multi-process launch writes `<stem>.rank<R>.json`). Default: none written, summary logged.

Generation follows the harness (`mm_oval.eval.runner`): the model's chat template around `<image>` and the
task's prompt, left padding, greedy when temperature is 0; the task's `until` strings cut the answer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms

from ..errors import ConfigError, DataError
from ..eval import runner
from ..eval.files import atomic_write_json
from ..eval.tasks import Item
from ..modelfiles import load_model
from ..prompts import chat_prompt
from ..wrapper import is_wrapped

log = logging.getLogger(__name__)


def _as_int(name: str, value: Any) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"mm_oval_llava: {name} must be a whole number, got {value!r}") from None
    if out < 1:
        raise ConfigError(f"mm_oval_llava: {name} must be at least 1, got {out}")
    return out


class MmOvalLlava(lmms):
    is_simple = True

    def __init__(
        self,
        pretrained: str = "llava-hf/llava-1.5-7b-hf",
        method: str = "full",
        budget: Any = None,
        compress: str = "prompt",
        dtype: str = "auto",
        device: str | None = None,
        batch_size: Any = 1,
        attn_implementation: str | None = None,
        allow_pickle_weights: bool = False,
        kv_path: str | None = None,
        max_batch_size: Any = None,  # passed by lmms-eval's evaluator; unused
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"mm_oval_llava: unknown model_args {sorted(unknown)}; known: pretrained, method, budget, "
                "compress, dtype, device, batch_size, attn_implementation, allow_pickle_weights, kv_path "
                '(a method spec with options goes in quotes: method="snapkv:window=8,kernel=5")'
            )
        if compress not in runner.COMPRESS_AT:
            raise ConfigError(
                f"mm_oval_llava: compress must be one of {runner.COMPRESS_AT}, got {compress!r}"
            )
        method = str(method).strip()
        if len(method) >= 2 and method[0] == method[-1] and method[0] in "\"'":
            method = method[1:-1]  # lmms-eval keeps the quotes that protect a spec's commas
        budget = runner.parse_budget(None if budget is None else str(budget))
        runner.check_method(method, budget)  # a typo fails before the weights load
        state = runner.process_state()
        self._rank, self._world_size = state.process_index, state.num_processes
        self.batch_size_per_gpu = _as_int("batch_size", batch_size if batch_size not in (None, "") else 1)
        self._model, self._processor = load_model(
            str(pretrained),
            device=device,
            dtype=str(dtype),
            attn_implementation=attn_implementation,
            allow_pickle_weights=bool(allow_pickle_weights),
        )
        runner.check_llava(self._model)
        self._wrapped = runner.apply_method(self._model, method, budget)
        self.method, self.budget, self.compress = method, budget, compress
        self.pretrained = str(pretrained)
        self.kv_path = Path(kv_path) if kv_path else None
        self.kv_rows: list[dict[str, Any]] = []

    # ------------------------------------------------------------ lmms-eval's interface

    @property
    def model(self) -> Any:
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self._processor.tokenizer

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def device(self) -> torch.device:
        return self._model.device

    def _visual(self, req_args: tuple) -> Any:
        _, _, doc_to_visual, doc_id, task, split = req_args
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        if not isinstance(visuals, (list, tuple)) or len(visuals) != 1:
            n = len(visuals) if isinstance(visuals, (list, tuple)) else type(visuals).__name__
            raise DataError(
                f"mm_oval_llava: task {task!r} doc {doc_id} gives {n} visuals; mm-oval evaluates one image "
                "per question"
            )
        img = visuals[0]
        if not hasattr(img, "convert"):
            raise DataError(
                f"mm_oval_llava: task {task!r} doc {doc_id}: the visual is not an image ({type(img).__name__})"
            )
        return img.convert("RGB")

    def generate_until(self, requests: list[Instance]) -> list[str]:
        args = [r.args for r in requests]
        out: list[str | None] = [None] * len(args)
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(args):
            key = json.dumps(a[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            gen = dict(args[idx[0]][1] or {})
            until = gen.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            if not isinstance(until, list):
                raise ConfigError(
                    f"mm_oval_llava: generation_kwargs 'until' must be a string or a list, got {until!r}"
                )
            max_new = _as_int("max_new_tokens", gen.pop("max_new_tokens", 1024))
            temperature = float(gen.pop("temperature", 0) or 0)
            top_p = gen.pop("top_p", None)
            num_beams = int(gen.pop("num_beams", 1) or 1)
            gen.pop("do_sample", None)
            if num_beams != 1:
                raise ConfigError(
                    "mm_oval_llava: beam search is not supported by mm-oval's caches (num_beams=1)"
                )
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start : start + self.batch_size]
                texts = self._generate([args[i] for i in chunk], max_new, temperature, top_p)
                for i, t in zip(chunk, texts):
                    for stop in until:
                        if stop:
                            t = t.split(stop, 1)[0]
                    out[i] = t.strip()
                    self.cache_hook.add_partial("generate_until", (args[i][0], args[i][1]), out[i])
        self._write_kv()
        return out  # type: ignore[return-value]

    def _generate(self, chunk: list[tuple], max_new: int, temperature: float, top_p: Any) -> list[str]:
        items = []
        for a in chunk:
            img = self._visual(a)
            prompt = a[0].replace("<image>", "").strip() if "<image>" in a[0] else a[0]
            items.append(Item(id=str(a[3]), prompt=prompt, image=lambda img=img: img))
        docs = [(a[4], a[5], a[3]) for a in chunk]
        if self.compress == "image":
            if temperature > 0:
                raise ConfigError(
                    "mm_oval_llava: compress=image decodes greedily; the task asks temperature > 0"
                )
            rows: list[dict] = []
            answers = runner.generate_image_first(self._model, self._processor, items, max_new, rows)
            for r in rows:
                self.kv_rows.append({"docs": docs, **r})
            return [t for t, _ in answers]
        model, proc = self._model, self._processor
        inputs = runner.model_inputs(proc, model, [it.image() for it in items],
                                      [chat_prompt(proc, it.prompt) for it in items])  # fmt: skip
        kw = runner.gen_kwargs(proc, max_new)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature)
            if top_p is not None:
                kw["top_p"] = float(top_p)
        with torch.inference_mode():
            seq = model.generate(**inputs, **kw)
        stats = runner.kv_stats(model)
        if stats:
            self.kv_rows.append({"docs": docs, **stats})
        return [t for t, _ in runner.decode_answers(proc.tokenizer, seq[:, inputs["input_ids"].shape[1] :])]

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        """lmms-eval's llava_hf contract: per request (context, target, doc_to_visual, doc_id, task, split),
        the continuation's log-likelihood given the image and the context, and whether greedy decoding would
        produce it. The context is prefilled through the wrapped model, so its cache is compressed by the
        method (as in generation with compress=prompt); the first continuation token is scored on the
        prefill's last logits, the others on the compressed cache. Unlike llava_hf, which returns the mean
        token loss and compares argmaxes one position off, this returns the sum of the continuation's
        log-probabilities (lm-eval's definition) and compares each token with the argmax that predicts it."""
        if self.compress != "prompt":
            raise ConfigError("mm_oval_llava: loglikelihood compresses after the context (compress=prompt)")
        out = []
        for context, target, doc_to_visual, doc_id, task, split in [r.args for r in requests]:
            doc = self.task_dict[task][split][doc_id]
            continuation = target if isinstance(target, str) else target(doc)
            if isinstance(continuation, list):
                continuation = continuation[0]
            img = self._visual((context, target, doc_to_visual, doc_id, task, split))
            prompt = context.replace("<image>", "").strip() if "<image>" in context else context
            ll, greedy, stats = self._score(img, prompt, str(continuation))
            if stats:
                self.kv_rows.append({"docs": [(task, split, doc_id)], **stats})
            out.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), (ll, greedy))
        self._write_kv()
        return out

    def _score(self, image: Any, prompt: str, continuation: str) -> tuple[float, bool, dict | None]:
        model, proc = self._model, self._processor
        text = chat_prompt(proc, prompt)
        ctx = runner.model_inputs(proc, model, [image], [text])
        full = runner.model_inputs(proc, model, [image], [text + " " + continuation.lstrip()])
        n_ctx = ctx["input_ids"].shape[1]
        if not torch.equal(full["input_ids"][:, :n_ctx], ctx["input_ids"]):
            raise DataError(
                f"mm_oval_llava: the context's tokens change when the continuation {continuation!r} follows"
            )
        cont = full["input_ids"][:, n_ctx:]
        if cont.shape[1] == 0:
            raise DataError(f"mm_oval_llava: the continuation {continuation!r} has no tokens")
        wrapped = is_wrapped(model)
        with torch.inference_mode():
            cache = runner.prompt_cache(model, **ctx)  # a wrapped model's request begins here
            first = model(**ctx, cache=cache, use_cache=True).logits[:, -1:]
            logits = [first]
            if cont.shape[1] > 1:
                step = cont[:, :-1]
                mask = torch.ones(
                    1, n_ctx + step.shape[1], dtype=ctx["attention_mask"].dtype, device=step.device
                )
                logits.append(model(input_ids=step, attention_mask=mask, cache=cache, use_cache=True).logits)
        logp = torch.log_softmax(torch.cat(logits, 1).float(), dim=-1)[0]
        target = cont[0]
        ll = float(logp.gather(1, target[:, None]).sum())
        greedy = bool((logp.argmax(-1) == target).all())
        return ll, greedy, runner.kv_stats(model) if wrapped else None

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise ConfigError(
            "mm_oval_llava: multi-round generation is not supported; use mm-oval eval --multi-turn"
        )

    # ------------------------------------------------------------ KV figures

    def kv_summary(self) -> dict[str, Any]:
        return runner.summarize_kv([{k: v for k, v in r.items() if k != "docs"} for r in self.kv_rows])

    def _write_kv(self) -> None:
        summary = self.kv_summary()
        if summary:
            log.info("mm_oval_llava KV figures: %s", json.dumps(summary, default=str))
        if self.kv_path is None:
            return
        path = self.kv_path
        if self._world_size > 1:
            path = path.with_name(f"{path.stem}.rank{self._rank}{path.suffix or '.json'}")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {
            "model": self.pretrained, "method": self.method, "budget": self.budget, "compress": self.compress,
            "rank": self._rank, "world_size": self._world_size,
            "summary": summary, "requests": self.kv_rows,
        })  # fmt: skip
