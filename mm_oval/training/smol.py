"""Training bundled-smol's projector and LoRA adapter on the 576-token scenes (`mm-oval train-smol`).

Recipe (from a CPU probe of SmolLM2 as a LLaVA language model):
- the language model is frozen (cast to bfloat16 on CUDA; float32 on a CPU without bf16 instructions, where
  bf16 matmuls are several times slower); the LoRA adapter (r 16 on every linear layer, float32) and the
  projector (float32) are trained, the vision tower is frozen;
- one image per sequence with several questions packed after it: every question sees only the shared prefix
  (system prompt + user turn start + the image) and its own earlier tokens (a block mask), its positions
  restarting right after the image, so a question never reads another question's answer;
- the loss is on the answer tokens and the `<|im_end|>` that closes the answer, located by construction
  (SmolLM2's pad token is `<|im_end|>` too: labels are never found by searching for it);
- the projector starts scaled to the text embeddings' RMS (`zoo.smol.scale_projector`).

Data: `TrainSampler576` on its own seeds (the bundled 576 dev sets are drawn from other seeds and stay held
out); a quick held-out check every `eval_every` steps asks one question of each VQA type about fresh scenes
(`heldout_items`) and the same questions about a blank grey image (the answer prior), then all of it again with
the questions in MMBench form (`heldout_mmbench`: options, a letter to answer). A question counts as right when
the greedy answer is exactly the reference followed by `<|im_end|>` (teacher-forced argmax at every answer
position: the same as greedy decoding's first tokens).

Checkpoints (OUT/checkpoint/): the trained weights and the optimiser state as safetensors and `state.json`
(step, seed, data cursor, optimiser groups, the config), each written atomically (a temporary file, then
os.replace), the JSON last: it names the weight files, so a crash leaves the previous checkpoint whole.
A run resumes from it exactly (the data is a pure function of seed and index). OUT/log.jsonl holds the
learning curve; OUT/parts/ the committable trained parts (projector, adapter, token, log).
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save

from ..errors import ConfigError, DataError, ModelError
from ..files import atomic_write_bytes, atomic_write_text
from ..prompts import chat_prompt
from ..zoo import smol
from ..zoo.generate576 import VQA_TYPES, TrainSampler576, make_questions576, to_mmbench
from ..zoo.model import pixel_values
from ..zoo.scenes import IMAGE_SIZE, MAX_OBJECTS, make_scene
from ..zoo.vision576 import patch_features

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint"
STATE = "state.json"
LOG = "log.jsonl"
PARTS = "parts"
# in a run's parts: the learning curves of the parts it started from and of theirs, oldest first (each one's
# steps count from 0)
INIT_LOG = "init_train_log.jsonl"
BLANK_GREY = (128, 128, 128)
HELDOUT_SEED_OFFSET = 1_000_003  # the held-out scenes' stream: heldout_items(seed + this, n)


@dataclass
class SmolTrainConfig:
    seed: int = 0
    questions_per_image: int = 10
    images_per_step: int = 2
    lr_projector: float = 1e-3
    lr_lora: float = 2e-4
    warmup_steps: int = 50
    # learning rates decayed linearly to 0 over the `cooldown_steps` steps that end at step `cooldown_end`
    # (the run's --steps); 0: constant after the warmup. Not part of the checkpoint's identity: a copy of a
    # run cooled down for release while the original goes on at the constant rate
    cooldown_steps: int = 0
    cooldown_end: int | None = None
    grad_clip: float = 1.0
    lora: bool = True
    lm_dtype: str = "auto"  # bfloat16 on CUDA, float32 on the CPU (see resolve_lm_dtype)
    mmbench_fraction: float = 0.3
    # of the MMBench-form questions (hint lookups aside), the share whose hint states the answer
    # (`generate576.answer_hint`): teaches the option letters apart from reading the image
    answer_hint_fraction: float = 0.0
    checkpoint_every: int = 10
    eval_every: int = 50
    eval_images: int = 6
    images_per_forward: int = 1  # images in one padded forward (a GPU wants many; the loss is the same)
    workers: int = 0  # data worker processes preparing the next steps' images (0: in the training process)
    min_objects: int = 4
    max_objects: int = MAX_OBJECTS
    # a run that starts from trained parts (a train-smol OUT/parts folder): its projector and adapter are
    # the starting weights, trained on (one adapter, exported as one); None: from scratch
    init_parts: str | None = None
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        for name in (
            "questions_per_image",
            "images_per_step",
            "checkpoint_every",
            "eval_images",
            "images_per_forward",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_every < 0 or self.warmup_steps < 0 or self.workers < 0:
            raise ConfigError("eval_every, warmup_steps and workers must be >= 0")
        if self.cooldown_steps < 0:
            raise ConfigError(f"cooldown_steps must be >= 0, got {self.cooldown_steps}")
        if self.cooldown_steps and self.cooldown_end is None:
            raise ConfigError(
                "a cooldown ends at the run's last step: pass --steps (the total) with --cooldown"
            )
        if self.lm_dtype not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"lm_dtype must be auto, bfloat16 or float32, got {self.lm_dtype!r}")
        for name in ("mmbench_fraction", "answer_hint_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1], got {getattr(self, name)}")

    # what must match between a checkpoint and a resumed run (the rest may change, e.g. eval frequency)
    def identity(self) -> dict:
        keys = ("seed", "questions_per_image", "images_per_step", "lora", "lm_dtype", "mmbench_fraction")
        out = {k: getattr(self, k) for k in keys}
        # absent when unused: the identity of every checkpoint made before these options existed
        if self.init_parts is not None:
            out["init_parts"] = self.init_parts
        if self.answer_hint_fraction:
            out["answer_hint_fraction"] = self.answer_hint_fraction
        return out


# ------------------------------------------------------------------------------------------------
# packing one image's questions


@dataclass
class Packed:
    ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    segment: torch.Tensor  # (T,) -1 for the shared prefix, else the question's index
    image_at: torch.Tensor  # (576,) positions of the image tokens
    label_at: torch.Tensor  # (N,) positions whose next token is an answer token
    labels: torch.Tensor  # (N,) those answer tokens
    question_of: torch.Tensor  # (N,) which question each label belongs to
    qtypes: list[str]

    @property
    def mask(self) -> torch.Tensor:
        """(T, T) bool, True = may attend: causal, to the shared prefix and within the own question. Built
        on demand (a data worker hands over O(T), not O(T^2))."""
        s = self.segment
        causal = torch.ones(len(s), len(s), dtype=torch.bool, device=s.device).tril()
        return causal & ((s[None, :] == -1) | (s[None, :] == s[:, None]))

    def to(self, device: torch.device) -> Packed:
        if self.ids.device == device:
            return self
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return Packed(**moved, qtypes=self.qtypes)


def prompt_of(q: Any) -> str:
    return q.mmbench_prompt() if q.options else q.vqa_prompt()


class Packer:
    """Token layout of one image + its questions (see the module docstring)."""

    def __init__(self, processor: Any, image_tokens: int = 576):
        self.processor = processor
        self.tok = processor.tokenizer
        self.image_id = self.tok.convert_tokens_to_ids(smol.IMAGE_TOKEN)
        self.end_id = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.image_tokens = image_tokens

    def prompt_ids(self, text: str) -> list[int]:
        ids = self.tok(chat_prompt(self.processor, text), add_special_tokens=False)["input_ids"]
        out: list[int] = []
        for t in ids:
            out.extend([t] * self.image_tokens if t == self.image_id else [t])
        return out

    def pack(self, questions: list[Any]) -> Packed:
        if not questions:
            raise DataError("an image without questions cannot be packed")
        prompts = [self.prompt_ids(prompt_of(q)) for q in questions]
        first = prompts[0]
        cut = max(i for i, t in enumerate(first) if t == self.image_id) + 1
        prefix = first[:cut]
        ids, pos, seg = list(prefix), list(range(cut)), [-1] * cut
        label_at, labels, question_of = [], [], []
        for k, (p, q) in enumerate(zip(prompts, questions)):
            if p[:cut] != prefix:
                raise DataError("questions about one image do not share the image prefix")
            answer = self.tok(q.answer, add_special_tokens=False)["input_ids"] + [self.end_id]
            body = p[cut:] + answer
            start = len(ids)
            first_answer = start + len(p) - cut
            ids.extend(body)
            pos.extend(range(cut, cut + len(body)))
            seg.extend([k] * len(body))
            label_at.extend(range(first_answer - 1, first_answer - 1 + len(answer)))
            labels.extend(answer)
            question_of.extend([k] * len(answer))
        ids_t = torch.tensor(ids)
        return Packed(
            ids_t,
            torch.tensor(pos),
            torch.tensor(seg),
            (ids_t == self.image_id).nonzero().flatten(),
            torch.tensor(label_at),
            torch.tensor(labels),
            torch.tensor(question_of),
            [q.qtype for q in questions],
        )


def forward_packs(model: Any, packs: list[Packed], pixel: torch.Tensor) -> torch.Tensor:
    """Logits (sum of N, vocab, float32) at the label positions of several packed images in one forward,
    image by image in order. The images are right-padded to the longest; a pad position attends only to
    itself and nothing attends to it, so each image's logits are those of its own forward."""
    inner = model.model
    dev = model.lm_head.weight.device
    packs = [p.to(dev) for p in packs]
    n = max(int(p.ids.numel()) for p in packs)
    b = len(packs)
    ids = torch.full((b, n), int(packs[0].ids[0]), dtype=torch.long, device=dev)
    pos = torch.zeros((b, n), dtype=torch.long, device=dev)
    mask = torch.eye(n, dtype=torch.bool, device=dev).repeat(b, 1, 1)
    for i, p in enumerate(packs):
        t = int(p.ids.numel())
        ids[i, :t], pos[i, :t], mask[i, :t, :t] = p.ids, p.positions, p.mask
    w = inner.multi_modal_projector.linear_1.weight
    with torch.no_grad():
        feats = patch_features(model, pixel.to(device=w.device, dtype=w.dtype))
    img = inner.multi_modal_projector(feats)  # (B, 576, hidden)
    emb = inner.language_model.get_input_embeddings()(ids)
    rows = torch.cat([torch.full_like(p.image_at, i) for i, p in enumerate(packs)])
    cols = torch.cat([p.image_at for p in packs])
    emb = emb.index_put((rows, cols), img.reshape(-1, img.shape[-1]).to(emb.dtype))
    out = inner.language_model(
        inputs_embeds=emb, attention_mask=mask[:, None], position_ids=pos, use_cache=False
    )
    at_rows = torch.cat([torch.full_like(p.label_at, i) for i, p in enumerate(packs)])
    h = out.last_hidden_state[at_rows, torch.cat([p.label_at for p in packs])]
    return model.lm_head(h).float()


def forward_packed(model: Any, packed: Packed, pixel: torch.Tensor) -> torch.Tensor:
    """Logits (N, vocab, float32) at the label positions of one packed image."""
    return forward_packs(model, [packed], pixel)


class TrainItems(torch.utils.data.Dataset):
    """Item `i` of the sampler, packed, with its pixels: what a data worker prepares for a step."""

    def __init__(self, sampler: TrainSampler576, packer: Packer, questions: int):
        self.sampler, self.packer, self.questions = sampler, packer, questions

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> tuple[Packed, torch.Tensor]:
        """(packed questions, the image as uint8 RGB (H, W, 3): a quarter of its float pixels' bytes in the
        shared memory a worker hands it over through)."""
        item = self.sampler.item(index, self.questions)
        return self.packer.pack(item.questions), torch.from_numpy(np.array(item.image.convert("RGB")))


def _as_list(batch: list) -> list:
    return batch


# ------------------------------------------------------------------------------------------------
# held-out check


def heldout_items(seed: int, n: int) -> list[tuple[Any, list[Any]]]:
    """`n` fresh scenes (their own seed stream, neither the train sampler's nor the dev sets') with one
    question of each VQA type the scene allows."""
    out = []
    for i in range(n):
        rng = random.Random(f"mm-oval-smol-heldout-{seed}-{i}")
        scene = make_scene(rng, 4, MAX_OBJECTS)
        qs = make_questions576(scene, rng)
        out.append((scene, [qs[t] for t in VQA_TYPES if t in qs]))
    return out


def heldout_mmbench(seed: int, items: list[tuple[Any, list[Any]]]) -> list[tuple[Any, list[Any]]]:
    """The same questions in MMBench form, as training asks a share of them (`to_mmbench`: the options in a
    random order, 2 for yes/no, 3 for counts, 4 for colours and shapes; the answer is the option's letter)."""
    out = []
    for i, (scene, qs) in enumerate(items):
        rng = random.Random(f"mm-oval-smol-heldout-mmbench-{seed}-{i}")
        out.append((scene, [to_mmbench(scene, q, rng) for q in qs]))
    return out


@torch.no_grad()
def _accuracy_by_type(model: Any, packer: Packer, items: list[tuple[Any, list[Any]]]) -> dict:
    blank = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BLANK_GREY)
    res: dict[str, dict[str, list[tuple[int, float]]]] = {"image": {}, "blank": {}}
    for scene, qs in items:
        packed = packer.pack(qs)
        for which, img in (("image", scene.render()), ("blank", blank)):
            logits = forward_packed(model, packed, pixel_values([img]))
            labels = packed.labels.to(logits.device)
            hit = (logits.argmax(-1) == labels).cpu()
            nll = F.cross_entropy(logits, labels, reduction="none").cpu()
            for k, qtype in enumerate(packed.qtypes):
                mine = packed.question_of == k
                res[which].setdefault(qtype, []).append((int(hit[mine].all()), float(nll[mine].sum())))
    out: dict[str, Any] = {}
    for which, by_type in res.items():
        allq = [r for rs in by_type.values() for r in rs]
        n = max(1, len(allq))
        out[which] = {
            "all": round(100 * sum(h for h, _ in allq) / n, 2),
            "n": len(allq),
            "by_type": {t: round(100 * sum(h for h, _ in rs) / len(rs), 2) for t, rs in by_type.items()},
            "nll_all": round(sum(x for _, x in allq) / n, 4),
            "nll": {t: round(sum(x for _, x in rs) / len(rs), 4) for t, rs in by_type.items()},
            "count": {t: len(rs) for t, rs in by_type.items()},
        }
    return out


def heldout_accuracy(model: Any, packer: Packer, items: list[tuple[Any, list[Any]]], seed: int = 0) -> dict:
    """Exact greedy accuracy by question type on `items`, with the real images and with a blank one, and
    each question's answer loss (the negative log-likelihood of its answer tokens and `<|im_end|>`, summed;
    its mean by type is `nll`). The loss moves before the accuracy does: an image that lowers it below the
    blank image's is read, even while the greedy answers are still the prior's. Under `mmbench`, the same
    for the same questions in MMBench form (`heldout_mmbench(seed, items)`): a model can read the image
    (right in VQA form) and still not map the answer to its option's letter."""
    return {
        **_accuracy_by_type(model, packer, items),
        "mmbench": _accuracy_by_type(model, packer, heldout_mmbench(seed, items)),
    }


def format_check(res: dict) -> str:
    """A held-out check as a table: per type, % right and mean answer loss with the image and the blank."""
    img, blank = res["image"], res["blank"]
    rows = [
        "| type | questions | % right: image / blank | answer loss: image / blank |",
        "|---|---:|---:|---:|",
    ]
    for t in img["by_type"]:
        rows.append(
            f"| {t} | {img['count'][t]} | {img['by_type'][t]:.1f} / {blank['by_type'][t]:.1f} | "
            f"{img['nll'][t]:.3f} / {blank['nll'][t]:.3f} |"
        )
    rows.append(
        f"| all | {img['n']} | {img['all']:.1f} / {blank['all']:.1f} | {img['nll_all']:.3f} / {blank['nll_all']:.3f} |"
    )
    if "mmbench" in res:
        rows += [
            "",
            "The same questions in MMBench form (options in a random order, the answer is a letter):",
            "",
        ]
        rows.append(format_check(res["mmbench"]))
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------
# the trainer


def resolve_lm_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA; float32 on the CPU. (A CPU without AVX512-BF16 / AMX runs bf16 matmuls
    through a slow path: measured 7x slower forward and ~30x slower backward than float32 on an AVX2 EPYC.)"""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def prepare(model: Any, cfg: SmolTrainConfig) -> list[dict]:
    """Freeze what is frozen, cast the language model, add the adapter; the optimiser's parameter groups."""
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.lora:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)  # the adapter's initial A matrices
            smol.add_lora(model)
    lm = model.model.language_model
    if resolve_lm_dtype(cfg.lm_dtype, lm.get_input_embeddings().weight.device) == torch.bfloat16:
        for n, p in lm.named_parameters():
            if "lora_" not in n:
                p.data = p.data.to(torch.bfloat16)
        model.lm_head.weight = lm.get_input_embeddings().weight
    proj = list(model.model.multi_modal_projector.parameters())
    for p in proj:
        p.requires_grad_(True)
    groups = [{"params": proj, "lr": cfg.lr_projector, "name": "projector"}]
    if cfg.lora:
        lora = [p for n, p in lm.named_parameters() if "lora_" in n]
        for p in lora:
            p.requires_grad_(True)
        groups.append({"params": lora, "lr": cfg.lr_lora, "name": "lora"})
    return groups


def trained_state(model: Any, cfg: SmolTrainConfig) -> dict[str, torch.Tensor]:
    out = {f"projector.{k}": v for k, v in smol.projector_state(model).items()}
    if cfg.lora:
        out.update({f"lora.{k}": v for k, v in smol.lora_state(model).items()})
    return out


def load_trained_state(model: Any, cfg: SmolTrainConfig, state: dict[str, torch.Tensor]) -> None:
    model.model.multi_modal_projector.load_state_dict(
        {k[len("projector.") :]: v for k, v in state.items() if k.startswith("projector.")}
    )
    if cfg.lora:
        smol.load_lora_state(model, {k[len("lora.") :]: v for k, v in state.items() if k.startswith("lora.")})


def load_init_parts(model: Any, cfg: SmolTrainConfig) -> Path:
    """The starting weights of a run from trained parts (`cfg.init_parts`): their projector and adapter
    loaded into the run's own (unmerged, trainable), so that step 0 answers as the parts do and the export is
    one adapter again ('bundled': bundled-smol's own parts). The adapter must have the run's shape (rank,
    alpha, target layers). Returns the learning curves of the parts' lineage, oldest first: the curves they
    started from themselves (their `INIT_LOG`), then their own ('' when they carry none)."""
    folder = smol.parts_folder(cfg.init_parts)
    if not smol.has_trained_parts(folder):
        raise ConfigError(f"--init {folder}: no trained projector there; give a train-smol OUT/parts folder")
    has_adapter = (folder / smol.ADAPTER_FILE).is_file()
    if has_adapter != cfg.lora:
        raise ConfigError(
            f"--init {folder}: the parts {'hold' if has_adapter else 'hold no'} LoRA adapter and this run "
            f"{'trains one' if cfg.lora else 'trains none (--no-lora)'}; start a run of the same kind"
        )
    try:
        made = json.loads((folder / smol.ADAPTER_CONFIG).read_text()) if has_adapter else None
        adapter = load_file(str(folder / smol.ADAPTER_FILE)) if has_adapter else None
        projector = load_file(str(folder / smol.PROJECTOR_FILE))
    except (OSError, ValueError) as e:
        raise ModelError(f"--init {folder}: the trained parts cannot be read ({e})") from e
    if made is not None:
        want = smol.lora_config()
        got = (made.get("r"), made.get("lora_alpha"), sorted(made.get("target_modules") or ()))
        if got != (want.r, want.lora_alpha, sorted(want.target_modules)):
            raise ConfigError(
                f"--init {folder}: its adapter (r, alpha, layers = {got}) is not the shape train-smol trains "
                f"({(want.r, want.lora_alpha, sorted(want.target_modules))})"
            )
    try:
        if adapter is not None:
            smol.load_lora_state(model, adapter)
        model.model.multi_modal_projector.load_state_dict(projector)
    except RuntimeError as e:
        raise ModelError(f"--init {folder}: the trained parts do not fit this model ({e})") from e
    log.info("starting from the trained parts in %s", folder)
    curves = (folder / INIT_LOG, folder / "train_log.jsonl")
    return "".join(_lines(f.read_text()) for f in curves if f.is_file())


def _lines(text: str) -> str:
    """`text` ending in a newline (unless empty), so that learning curves concatenate line by line."""
    return text if not text or text.endswith("\n") else text + "\n"


def lr_factor(step: int, warmup: int, cooldown: int = 0, end: int | None = None) -> float:
    """The learning rates' factor for the step taken from `step` (0-based): a linear warmup over `warmup`
    steps, then 1, then (with a cooldown) a linear decay over the `cooldown` steps before `end`, reaching
    1/cooldown at the last one."""
    f = min(1.0, (step + 1) / warmup) if warmup else 1.0
    if cooldown and end is not None:
        f *= min(1.0, max(0.0, (end - step) / cooldown))
    return f


class Trainer:
    def __init__(self, model: Any, processor: Any, out: str | Path, cfg: SmolTrainConfig):
        cfg.validate()
        self.model, self.cfg, self.out = model, cfg, Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.packer = Packer(processor)
        self.groups = prepare(model, cfg)
        self.params = [p for g in self.groups for p in g["params"]]
        self.opt = torch.optim.AdamW(self.groups, lr=cfg.lr_projector, weight_decay=0.0)
        self.sampler = TrainSampler576(
            cfg.seed,
            cfg.min_objects,
            cfg.max_objects,
            mmbench_fraction=cfg.mmbench_fraction,
            answer_hint_fraction=cfg.answer_hint_fraction,
        )
        self.items = TrainItems(self.sampler, self.packer, cfg.questions_per_image)
        self._loader, self._loader_at = None, -1
        self.step = 0
        self.heldout = heldout_items(cfg.seed + HELDOUT_SEED_OFFSET, cfg.eval_images)
        if not self.resume() and cfg.init_parts is not None:
            before = load_init_parts(model, cfg)
            if before:  # kept in OUT at the start: an export may overwrite the parts folder's own
                atomic_write_text(self.out / INIT_LOG, before)

    # -- checkpoints
    @property
    def ckpt_dir(self) -> Path:
        return self.out / CHECKPOINT

    def save_checkpoint(self) -> None:
        d = self.ckpt_dir
        d.mkdir(parents=True, exist_ok=True)
        weights, optim = f"weights-{self.step:08d}.safetensors", f"optimizer-{self.step:08d}.safetensors"
        atomic_write_bytes(d / weights, save(trained_state(self.model, self.cfg)))
        sd = self.opt.state_dict()
        tensors = {f"{i}.{k}": v.contiguous() for i, st in sd["state"].items() for k, v in st.items()}
        atomic_write_bytes(d / optim, save(tensors))
        state = {
            "step": self.step,
            "seed": self.cfg.seed,
            "cursor": self.step * self.cfg.images_per_step,
            "weights": weights,
            "optimizer": optim,
            "param_groups": sd["param_groups"],
            "config": asdict(self.cfg),
            "identity": self.cfg.identity(),
            "time": time.time(),
        }
        atomic_write_text(d / STATE, json.dumps(state, indent=1) + "\n")
        for old in d.glob("*.safetensors"):
            if old.name not in (weights, optim):
                old.unlink(missing_ok=True)

    def resume(self) -> bool:
        """Continue from the checkpoint in OUT (True), or find none (False)."""
        path = self.ckpt_dir / STATE
        if not path.is_file():
            return False
        try:
            state = json.loads(path.read_text())
            if state["identity"] != self.cfg.identity():
                raise DataError(
                    f"the checkpoint in {self.ckpt_dir} was trained with {state['identity']}, not "
                    f"{self.cfg.identity()}; use the same options or another --out"
                )
            load_trained_state(self.model, self.cfg, load_file(str(self.ckpt_dir / state["weights"])))
            flat = load_file(str(self.ckpt_dir / state["optimizer"]))
        except (OSError, KeyError, json.JSONDecodeError, RuntimeError) as e:
            raise DataError(
                f"the checkpoint in {self.ckpt_dir} cannot be read ({e}); delete it to start over"
            ) from e
        opt_state: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in flat.items():
            i, name = key.split(".", 1)
            opt_state.setdefault(int(i), {})[name] = v
        self.opt.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
        self.step = int(state["step"])
        self._trim_log()
        log.info("resumed from step %d (%s)", self.step, self.ckpt_dir)
        return True

    def _trim_log(self) -> None:
        """Drop log lines of steps after the checkpoint (written before an interruption; redone now)."""
        path = self.out / LOG
        if not path.is_file():
            return
        keep = [
            ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step
        ]
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))

    def _log(self, rec: dict) -> None:
        with open(self.out / LOG, "a") as f:
            f.write(json.dumps(rec) + "\n")

    # -- steps
    def train_step(self) -> dict:
        cfg = self.cfg
        self.model.train()
        lr_scale = lr_factor(self.step, cfg.warmup_steps, cfg.cooldown_steps, cfg.cooldown_end)
        for g in self.opt.param_groups:
            base = cfg.lr_projector if g.get("name") == "projector" else cfg.lr_lora
            g["lr"] = base * lr_scale
        self.opt.zero_grad(set_to_none=True)
        items = self._next_items()
        losses, tokens = [], 0
        for k in range(0, len(items), cfg.images_per_forward):
            chunk = items[k : k + cfg.images_per_forward]
            packs = [p for p, _ in chunk]
            pixel = pixel_values([Image.fromarray(rgb.numpy()) for _, rgb in chunk])
            logits = forward_packs(self.model, packs, pixel)
            labels = torch.cat([p.labels for p in packs]).to(logits.device)
            each = F.cross_entropy(logits, labels, reduction="none").split([len(p.labels) for p in packs])
            loss = torch.stack([e.mean() for e in each])  # per image: the mean over its answer tokens
            (loss.sum() / cfg.images_per_step).backward()
            losses.extend(loss.tolist())
            tokens += sum(int(p.ids.numel()) for p in packs)
        gnorm = (
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip) if cfg.grad_clip else torch.tensor(0.0)
        )
        self.opt.step()
        self.step += 1
        return {
            "step": self.step,
            "loss": sum(losses) / len(losses),
            "tokens": tokens,
            "grad_norm": float(gnorm),
            "lr_scale": round(lr_scale, 6),
        }

    def _next_items(self) -> list[tuple[Packed, torch.Tensor]]:
        """This step's images (items step * images_per_step ...), from the workers when there are any."""
        cfg = self.cfg
        first = self.step * cfg.images_per_step
        if not cfg.workers:
            return [self.items[first + j] for j in range(cfg.images_per_step)]
        if self._loader is None or self._loader_at != first:
            loader = torch.utils.data.DataLoader(
                self.items,
                batch_size=cfg.images_per_step,
                sampler=range(first, 2**62),
                num_workers=cfg.workers,
                collate_fn=_as_list,
                prefetch_factor=2,
            )
            self._loader = iter(loader)
        self._loader_at = first + cfg.images_per_step
        return next(self._loader)

    def evaluate(self) -> dict:
        self.model.eval()
        return heldout_accuracy(self.model, self.packer, self.heldout, self.cfg.seed + HELDOUT_SEED_OFFSET)

    def check(self, scenes: int, tag: str | None = None) -> tuple[dict, Path]:
        """The held-out check on `scenes` scenes (the periodic check's stream: its first `eval_images` are
        the periodic check's own) at the checkpoint's step, written to OUT/check-TAG-SCENES.json (TAG: the
        step, 8 digits, unless given)."""
        if scenes < 1:
            raise ConfigError(f"--check takes a number of scenes >= 1, got {scenes}")
        self.model.eval()
        t0 = time.monotonic()
        seed = self.cfg.seed + HELDOUT_SEED_OFFSET
        res = heldout_accuracy(self.model, self.packer, heldout_items(seed, scenes), seed)
        res = {"step": self.step, "scenes": scenes, "sec": round(time.monotonic() - t0, 1), **res}
        path = self.out / f"check-{tag or f'{self.step:08d}'}-{scenes}.json"
        atomic_write_text(path, json.dumps(res, indent=1) + "\n")
        return res, path

    def export(self, folder: str | Path | None = None) -> Path:
        """The committable parts: projector, adapter (peft's names and config), token record, the log."""
        folder = Path(folder) if folder else self.out / PARTS
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / smol.PROJECTOR_FILE, save(smol.projector_state(self.model)))
        if self.cfg.lora:
            atomic_write_bytes(folder / smol.ADAPTER_FILE, save(smol.lora_state(self.model)))
            cfg = smol.lora_config().to_dict()
            cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
            atomic_write_text(folder / smol.ADAPTER_CONFIG, json.dumps(cfg, indent=1, default=str) + "\n")
        smol.write_token_record(folder, self.packer.image_id)
        if (self.out / LOG).is_file():
            shutil.copyfile(self.out / LOG, folder / "train_log.jsonl")
        if (self.out / INIT_LOG).is_file():  # the learning curves of the parts this run started from
            shutil.copyfile(self.out / INIT_LOG, folder / INIT_LOG)
        return folder

    def run(self, steps: int | None = None, minutes: float | None = None) -> dict:
        """Train until `steps` total steps (None: no limit) or `minutes` of this call have passed."""
        cfg, t_start = self.cfg, time.monotonic()
        last: dict = {}
        if self.step == 0 and cfg.eval_every:
            self._eval_and_log()
        while steps is None or self.step < steps:
            if minutes is not None and time.monotonic() - t_start > 60 * minutes:
                break
            t0 = time.monotonic()
            last = self.train_step()
            last["sec"] = round(time.monotonic() - t0, 3)
            last["loss"] = round(last["loss"], 5)
            self._log(last)
            log.info("step %d loss %.4f (%.1f s)", self.step, last["loss"], last["sec"])
            if self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                self._eval_and_log()
        self.save_checkpoint()
        return last

    def _eval_and_log(self) -> None:
        t0 = time.monotonic()
        res = self.evaluate()
        rec = {"step": self.step, "eval": res, "sec": round(time.monotonic() - t0, 1)}
        self._log(rec)
        log.info(
            "step %d held-out %.1f%% (blank image %.1f%%), answer loss %.3f (blank image %.3f) %s; "
            "MMBench form %.1f%% (blank image %.1f%%)",
            self.step,
            res["image"]["all"],
            res["blank"]["all"],
            res["image"]["nll_all"],
            res["blank"]["nll_all"],
            res["image"]["by_type"],
            res["mmbench"]["image"]["all"],
            res["mmbench"]["blank"]["all"],
        )
        self.export()


def lm_loss_is_finite(rec: dict) -> bool:
    return math.isfinite(rec.get("loss", 0.0))
