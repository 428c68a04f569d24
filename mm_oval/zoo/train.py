"""Train the bundled tiny LLaVA from scratch on the synthetic train split (CPU or GPU, seeded, resumable).

Two recipes. `--circuit` (the bundled checkpoint's): the vision stage learns a linearly readable patch
code (`vision_code_stage`), then the projector and the language model are written in closed form
(`circuit.py`). The default, learned recipe trains the language model by gradient descent:

1. Vision stage: the CLIP tower alone learns, per patch, the colour, shape, row and column of its cell
   (linear probes on the patch features).
2. Language stage, with the whole LlavaForConditionalGeneration training:
   - dense, single-turn questions: each image is followed by many questions, each in exactly the
     evaluation prompt, arranged as a tree (a 4-D attention mask lets every question see the image
     prefix and itself only, with position ids restarting after the prefix), so one forward pass trains
     ~16 independent single-turn examples that share the image tokens;
   - an attention teacher: the generator knows which question words are the keys and which patches
     hold the answer, so a few heads are told where to look from the answer position (layer 0: the key
     words; layer 1: the target patches; layer 2: the right option's text for multiple-choice items).
     The model stays a plain LLaVA.

The recipes' settings, the runs behind the bundled checkpoint and what each recipe reached: docs/zoo.md.
"""

from __future__ import annotations

import io
import json
import logging
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, DataError
from ..files import atomic_write_bytes, load_checkpoint
from . import circuit
from .generate import COLORS, GRID, LETTERS, MMB_SUFFIX, SHAPES, VQA_SUFFIX, Question, TrainSampler
from .model import TinyLlavaSizes, build_tiny_llava, pixel_values

log = logging.getLogger(__name__)


@dataclass
class TinyLlavaTrainConfig:
    steps: int = 3000
    seed: int = 0
    images_per_batch: int = 8
    questions_per_image: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    vision_steps: int = 300
    vision_batch: int = 32
    vision_lr: float = 2e-3
    projector_steps: int = 300  # fit the projector so image tokens live in the word-embedding space
    attn_weight: float = 1.0  # weight of the attention teacher's loss
    attn_until: float = 1.0  # fraction of steps after which the teacher is off
    exit_weight: float = (
        0.0  # deep supervision: the answer read out (final norm + LM head) after layers 2..L-1
    )
    mmbench_fraction: float = 0.3
    eval_every: int = 250
    eval_items: int = 40  # held-out images (x questions_per_image questions)
    checkpoint_minutes: float = 3.0
    threads: int = 0  # 0: torch default
    # the text model's attention: wide heads with a slow RoPE leave many dimensions nearly position-free
    # over the ~100 tokens between an answer and the image, which content matching (colour, shape) needs
    head_dim: int = 64
    rope_theta: float = 1e6
    # once the keyword heads have formed, set layer 1's content-matching query/key maps by least squares
    # from the model's own hidden states (see fit_retrieval_heads; mixed results so far, off by default); -1: never
    retrieval_fit_step: int = -1
    # teach layer 0 head 2 to copy each option's letter onto the option's text (the multiple-choice hop)
    letter_teacher: bool = False
    # start from another run's train_state.ckpt.pt (weights and optimiser moments; new schedule, no
    # vision/projector stage): continue a finished run with a new schedule or objective
    init_from: str = ""
    # the multiple-choice read-out: layer 2 head 0 (taught to attend to the right option) must itself carry
    # the option's letter to the output; weight of the cross-entropy of its contribution alone read out
    # through the final norm and LM head, on multiple-choice answers (0: off)
    readout_weight: float = 0.0
    # oversample question types in training: "type=weight,..." relative to 1 (e.g. "color of shape=3")
    type_weights: str = ""
    # the closed-form recipe (mm_oval/zoo/circuit.py): the vision stage regresses each patch's one-hot
    # colour / shape / row / column code (position embeddings start from a row / column code), then the
    # projector and the language model are written in closed form; `steps` more steps of the language
    # loss may follow (0: none; the attention teacher and the other auxiliary losses must be off)
    circuit: bool = False

    def validate(self) -> None:
        min_steps = 0 if self.circuit else 1
        if self.steps < min_steps or self.images_per_batch < 1 or self.questions_per_image < 1:
            raise ConfigError(f"steps must be >= {min_steps}, images_per_batch and questions_per_image >= 1")
        if self.circuit and self.steps > 0:
            on = [n for n, v in (("--attn-weight", self.attn_weight), ("--exit-weight", self.exit_weight),
                                 ("--readout-weight", self.readout_weight)) if v > 0]  # fmt: skip
            on += ["--letter-teacher"] * self.letter_teacher + ["--init-from"] * bool(self.init_from)
            on += ["--retrieval-fit-step"] * (self.retrieval_fit_step >= 0)
            if on:
                raise ConfigError(
                    f"--circuit writes its own attention roles; training after it takes the language loss "
                    f"only: turn off {', '.join(on)} (e.g. --attn-weight 0)"
                )
        if not 0 < self.lr < 1:
            raise ConfigError(f"lr must be in (0, 1), got {self.lr}")
        if self.vision_steps < 0 or self.warmup < 0:
            raise ConfigError("vision_steps and warmup must be >= 0")


# ------------------------------------------------------------------------------------------------
# batches


def init_position_code(tower) -> None:
    """Start the tower's position embeddings from a row / column code (dimensions 0-7: row, 8-15: column,
    which the patch embedding then leaves free), so the patch feature knows its cell from the first step."""
    emb = tower.embeddings
    with torch.no_grad():
        pe = emb.position_embedding.weight
        pe.zero_()
        for p in range(GRID * GRID):
            pe[1 + p, p // GRID] = 3.0
            pe[1 + p, GRID + p % GRID] = 3.0
        emb.patch_embedding.weight[: 2 * GRID] = 0.0


def patch_labels(scene) -> torch.Tensor:
    """(64, 4) labels per patch: colour (0 = empty, 1..8), shape (0 = empty, 1..4), row, column."""
    lab = torch.zeros(GRID * GRID, 4, dtype=torch.long)
    for p in range(GRID * GRID):
        lab[p, 2], lab[p, 3] = p // GRID, p % GRID
    for o in scene.objects:
        p = o.row * GRID + o.col
        lab[p, 0] = COLORS.index(o.color) + 1
        lab[p, 1] = SHAPES.index(o.shape) + 1
    return lab


class Encoder:
    """Word ids of question pieces, cached (the tokenizer is word-level: pieces concatenate exactly)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[str, list[int]] = {}
        self.image_id = tokenizer.convert_tokens_to_ids("<image>")
        self.prefix = [tokenizer.bos_token_id, *self.ids("USER:")]
        self.assistant = self.ids("ASSISTANT:")
        self.eos = tokenizer.eos_token_id

    def ids(self, text: str) -> list[int]:
        if text not in self.cache:
            self.cache[text] = self.tok(text, add_special_tokens=False)["input_ids"]
        return self.cache[text]

    def block(self, q: Question) -> tuple[list[int], dict]:
        """Token ids of one question turn after the image ("{text} ASSISTANT: {answer} </s>") and where
        the answer position, the key words and the right option's text are within it."""
        ids: list[int] = []
        seg_start = {}
        if q.hint:
            seg_start["hint"] = len(ids)
            ids += self.ids(q.hint)
        seg_start["q"] = len(ids)
        ids += self.ids(q.text)
        option_pos = None
        letter_links = []  # (position of an option's text word, position of its letter)
        if q.options:
            right = LETTERS.index(q.answer)
            for i, opt in enumerate(q.options):
                letter = len(ids)
                ids += self.ids(f"{LETTERS[i]}.")
                text = list(range(len(ids), len(ids) + len(self.ids(opt))))
                if i == right:
                    option_pos = text
                letter_links += [(p, letter) for p in text]
                ids += self.ids(opt)
            ids += self.ids(MMB_SUFFIX)
        else:
            ids += self.ids(VQA_SUFFIX)
        ids += self.assistant
        answer_pos = len(ids) - 1  # the ":" of "ASSISTANT:" predicts the answer
        ans = self.ids(q.answer)
        if len(ans) != 1:
            raise ConfigError(f"answer {q.answer!r} is not one word of the vocabulary")
        ids += [ans[0], self.eos]
        keys = [seg_start[seg] + i for seg, i in q.keys]
        return ids, {
            "answer_pos": answer_pos,
            "keys": keys,
            "option_pos": option_pos,
            "letter_links": letter_links,
        }


@dataclass
class TinyLlavaBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor  # (B, 1, L, L) additive float: 0 where a row may attend, -inf-ish elsewhere
    position_ids: torch.Tensor
    pixel_values: torch.Tensor
    labels: torch.Tensor
    answer_rows: torch.Tensor  # (N, 2): (batch index, answer position) of every question
    qtypes: list[str]
    mmbench: list[bool]
    # attention teacher: (layer, head) -> (batch index, query position, key mask over L)
    teach: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    patch_labels: torch.Tensor  # (B, 64, 4)


def make_batch(
    items, enc: Encoder, n_image_tokens: int = GRID * GRID, letter_teacher: bool = False
) -> TinyLlavaBatch:
    prefix = enc.prefix + [enc.image_id] * n_image_tokens
    P = len(prefix)
    seqs, metas = [], []
    for it in items:
        ids, meta = list(prefix), []
        for q in it.questions:
            b_ids, m = enc.block(q)
            meta.append((len(ids), len(b_ids), m, q))
            ids += b_ids
        seqs.append(ids)
        metas.append(meta)
    B, L = len(items), max(len(s) for s in seqs)
    input_ids = torch.full((B, L), enc.tok.pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, 1, L, L), dtype=torch.bool)
    labels = torch.full((B, L), -100, dtype=torch.long)
    causal_p = torch.tril(torch.ones(P, P, dtype=torch.bool))
    rows, qtypes, mmb = [], [], []
    teach_rows: dict[tuple[int, int], list] = {}
    for b, (ids, meta) in enumerate(zip(seqs, metas)):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        position_ids[b, :P] = torch.arange(P)
        mask[b, 0, :P, :P] = causal_p
        for start, n, m, q in meta:
            end = start + n
            position_ids[b, start:end] = torch.arange(P, P + n)
            mask[b, 0, start:end, :P] = True
            mask[b, 0, start:end, start:end] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            a = start + m["answer_pos"]
            labels[b, a] = ids[a + 1]  # the answer word
            labels[b, a + 1] = ids[a + 2]  # then </s>
            rows.append((b, a))
            qtypes.append(q.qtype)
            mmb.append(bool(q.options))
            # layer 0, heads 0 and 1: the two key words
            for h, k in enumerate(m["keys"][:2]):
                teach_rows.setdefault((0, h), []).append((b, a, [start + k]))
            # layer 1, heads 0 and 1: the patches holding the answer (none for absent objects)
            if q.targets:
                cells = [enc_prefix_pos(P, n_image_tokens, r, c) for r, c in q.targets]
                for h in (0, 1):
                    teach_rows.setdefault((1, h), []).append((b, a, cells))
            # layer 2, head 0: the text of the right option (multiple choice)
            if m["option_pos"]:
                teach_rows.setdefault((2, 0), []).append((b, a, [start + p for p in m["option_pos"]]))
            # layer 0, head 2: each option's text looks back at its letter, so the option the answer
            # position finds in layer 2 carries the letter to answer with
            if letter_teacher:
                for p, letter in m["letter_links"]:
                    teach_rows.setdefault((0, 2), []).append((b, start + p, [start + letter]))
        # rows past the end attend to themselves (padding; no loss there)
        for i in range(len(ids), L):
            mask[b, 0, i, i] = True
    teach = {}
    for key, lst in teach_rows.items():
        bi = torch.tensor([x[0] for x in lst])
        qi = torch.tensor([x[1] for x in lst])
        km = torch.zeros(len(lst), L, dtype=torch.bool)
        for j, x in enumerate(lst):
            km[j, x[2]] = True
        teach[key] = (bi, qi, km)
    additive = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(
        ~mask, torch.finfo(torch.float32).min
    )
    return TinyLlavaBatch(
        input_ids=input_ids,
        attention_mask=additive,
        position_ids=position_ids,
        pixel_values=pixel_values([it.image for it in items]),
        labels=labels,
        answer_rows=torch.tensor(rows),
        qtypes=qtypes,
        mmbench=mmb,
        teach=teach,
        patch_labels=torch.stack([patch_labels(it.scene) for it in items]),
    )


def parse_type_weights(text: str) -> dict[str, float] | None:
    """ "color of shape=3,exists=0.5" -> {"color of shape": 3.0, "exists": 0.5}; "" -> None."""
    if not text.strip():
        return None
    out = {}
    for item in text.split(","):
        name, _, w = item.partition("=")
        try:
            out[name.strip()] = float(w)  # no "=": w is "" and fails here
        except ValueError:
            raise ConfigError(f"type_weights: write 'type=weight,...', got {item!r}") from None
    return out


def enc_prefix_pos(P: int, n_image_tokens: int, row: int, col: int) -> int:
    """Sequence position of the image token of cell (row, col): the image tokens end the prefix."""
    return P - n_image_tokens + row * GRID + col


# ------------------------------------------------------------------------------------------------
# the model pieces


class PatchProbe(nn.Module):
    """Linear read-outs of a patch feature: colour (9), shape (5), row (8), column (8). Training only."""

    def __init__(self, dim: int):
        super().__init__()
        self.heads = nn.ModuleList(
            [nn.Linear(dim, n) for n in (len(COLORS) + 1, len(SHAPES) + 1, GRID, GRID)]
        )

    def loss_and_acc(self, feats: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        loss, accs = feats.new_zeros(()), []
        for i, head in enumerate(self.heads):
            logits = head(feats)
            loss = loss + F.cross_entropy(logits.flatten(0, 1), labels[..., i].flatten())
            accs.append(float((logits.argmax(-1) == labels[..., i]).float().mean()))
        return loss, accs


def patch_features(model, pixel: torch.Tensor) -> torch.Tensor:
    """The vision tower's patch features as LLaVA selects them (layer -1, CLS dropped): (B, 64, D)."""
    out = model.model.vision_tower(pixel, output_hidden_states=True)
    layer = model.config.vision_feature_layer
    return out.hidden_states[layer][:, 1:]


def lr_at(step: int, cfg: TinyLlavaTrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def teacher_loss(attentions, teach) -> torch.Tensor:
    """-log of the attention mass each taught head puts on its targets, averaged over taught rows."""
    total, n = None, 0
    for (layer, head), (bi, qi, km) in teach.items():
        w = attentions[layer][bi, head, qi]  # (N, L)
        mass = (w * km.to(w.dtype)).sum(-1).clamp_min(1e-6)
        term = -mass.log().mean()
        total = term if total is None else total + term
        n += 1
    return total / n if total is not None else torch.zeros(())


def answer_accuracy(logits: torch.Tensor, batch: TinyLlavaBatch) -> tuple[np.ndarray, list[str], list[bool]]:
    b, a = batch.answer_rows[:, 0], batch.answer_rows[:, 1]
    pred = logits[b, a].argmax(-1)
    gold = batch.labels[b, a]
    return (pred == gold).numpy(), batch.qtypes, batch.mmbench


# ------------------------------------------------------------------------------------------------
# the loop


class Trainer:
    def __init__(self, out: str | Path, cfg: TinyLlavaTrainConfig, sizes: TinyLlavaSizes | None = None):
        cfg.validate()
        self.out, self.cfg = Path(out), cfg
        self.sizes = sizes or TinyLlavaSizes(text_head_dim=cfg.head_dim, rope_theta=cfg.rope_theta)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.model, self.processor = build_tiny_llava(
            seed=cfg.seed, sizes=self.sizes, attn_implementation="eager"
        )
        self.enc = Encoder(self.processor.tokenizer)
        self.probe = PatchProbe(self.model.config.vision_config.hidden_size)
        self.sampler = TrainSampler(
            cfg.seed, mmbench_fraction=cfg.mmbench_fraction, type_weights=parse_type_weights(cfg.type_weights)
        )
        self.heldout = TrainSampler(cfg.seed + 10_000, mmbench_fraction=0.5)
        self.ckpt_path = self.out / "train_state.ckpt.pt"
        self.retrieval_fitted = False
        self.log_path = self.out / "train_log.jsonl"

    # -- vision stage ----------------------------------------------------------------------------
    def vision_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s images of the vision stage: pixel values and (B, 64, 4) patch labels."""
        n = self.cfg.vision_batch
        items = [self.sampler.item(10_000_000 + step * n + i, 0) for i in range(n)]
        return pixel_values([it.image for it in items]), torch.stack([patch_labels(it.scene) for it in items])

    @torch.no_grad()
    def fit_patches(self, batches: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """Patch features and labels of fresh scenes (none the vision stage saw) that the projector is fit on."""
        feats, labels = [], []
        for i in range(batches):
            items = [self.sampler.item(20_000_000 + i * 1000 + j, 0) for j in range(self.cfg.vision_batch)]
            feats.append(patch_features(self.model, pixel_values([it.image for it in items])))
            labels.append(torch.stack([patch_labels(it.scene) for it in items]))
        return torch.cat(feats), torch.cat(labels)

    def vision_stage(self) -> dict:
        if self.cfg.circuit:
            return self.vision_code_stage()
        cfg, model = self.cfg, self.model
        params = list(model.model.vision_tower.parameters()) + list(self.probe.parameters())
        opt = torch.optim.AdamW(params, lr=cfg.vision_lr, weight_decay=0.0)
        model.train()
        accs = [0.0] * 4
        for step in range(cfg.vision_steps):
            pix, labels = self.vision_batch(step)
            loss, accs = self.probe.loss_and_acc(patch_features(model, pix), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 50 == 0 or step == cfg.vision_steps - 1:
                log.info("vision %d/%d loss %.3f acc colour/shape/row/col %s", step, cfg.vision_steps, loss.item(),
                         " ".join(f"{a:.3f}" for a in accs))  # fmt: skip
        return {"vision_loss": float(loss.detach()), "vision_acc": accs} if cfg.vision_steps else {}

    def vision_code_stage(self) -> dict:
        """The closed-form recipe's vision stage: the tower learns a patch feature from which a linear map
        gives the one-hot code of the cell's colour, shape, row and column (mean squared error, cosine lr);
        the projector then reads that code (circuit.set_projector)."""
        cfg, model = self.cfg, self.model
        init_position_code(model.model.vision_tower)
        dim = model.config.vision_config.hidden_size
        head = nn.Linear(dim, circuit.CODE_SIZE)
        params = list(model.model.vision_tower.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=cfg.vision_lr, weight_decay=0.0)
        model.train()
        loss = torch.zeros(())
        for step in range(cfg.vision_steps):
            for g in opt.param_groups:
                g["lr"] = cfg.vision_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.vision_steps))
            pix, labels = self.vision_batch(step)
            loss = (
                F.mse_loss(head(patch_features(model, pix)), circuit.code_targets(labels)) * circuit.CODE_SIZE
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 100 == 0 or step == cfg.vision_steps - 1:
                log.info("vision %d/%d code loss %.4f", step, cfg.vision_steps, loss.item())
        return {"vision_code_loss": float(loss.detach())}

    @torch.no_grad()
    def circuit_stage(self) -> dict:
        """Fit the code on fresh scenes by least squares, then write the projector and language model."""
        model = self.model
        model.eval()
        code, report = circuit.projector_code(*self.fit_patches())
        log.info("patch code fit: %s", report)
        circuit.set_projector(model, code)
        circuit.set_language_model(model, self.processor.tokenizer)
        return {"code_fit": report}

    # -- projector stage ---------------------------------------------------------------------------
    def projector_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Where each image token should land: the sum of the LM's word embeddings of its colour and shape
        (or a fixed 'empty' vector), at the word-embedding scale. A question word and the patch that holds
        it then share a direction, which is what retrieval matches (positions come from RoPE)."""
        emb = self.model.model.language_model.embed_tokens.weight.detach()
        tok = self.processor.tokenizer
        g = torch.Generator().manual_seed(self.cfg.seed + 1)
        std = float(emb.std())
        empty = torch.randn(1, emb.shape[1], generator=g) * std
        colour_vecs = torch.cat([empty, emb[tok.convert_tokens_to_ids(COLORS)]])
        shape_vecs = torch.cat([torch.zeros(1, emb.shape[1]), emb[tok.convert_tokens_to_ids(SHAPES)]])
        return colour_vecs[labels[..., 0]] + shape_vecs[labels[..., 1]]

    def projector_stage(self) -> dict:
        cfg, model = self.cfg, self.model
        proj = model.model.multi_modal_projector
        with torch.no_grad():
            feats, labels = self.fit_patches()
            targets = self.projector_targets(labels)
            # linear_1 holds least-squares one-hot regressions of the cell's colour, shape, row and column,
            # shifted and scaled so GELU turns them into a clean one-hot code; linear_2 is the least-squares
            # map from that code to the targets
            x = feats.reshape(-1, feats.shape[-1])
            y = labels.reshape(-1, 4)
            onehot = torch.cat(
                [
                    F.one_hot(y[:, i], n).float()
                    for i, n in enumerate((len(COLORS) + 1, len(SHAPES) + 1, GRID, GRID))
                ],
                1,
            )
            xb = torch.cat([x, torch.ones(x.shape[0], 1)], 1)
            code = torch.linalg.lstsq(xb, onehot).solution  # (D + 1, 30)
            k = 6.0
            w1 = proj.linear_1.weight
            w1.zero_()
            w1[: code.shape[1]] = k * code[:-1].T
            proj.linear_1.bias.zero_()
            proj.linear_1.bias[: code.shape[1]] = k * (code[-1] - 0.5)
            fit = (xb @ code).split([len(COLORS) + 1, len(SHAPES) + 1, GRID, GRID], 1)
            accs = [float((f.argmax(1) == y[:, i]).float().mean()) for i, f in enumerate(fit)]
            log.info(
                "projector code: least-squares accuracy colour/shape/row/col %s",
                " ".join(f"{a:.3f}" for a in accs),
            )
            h = proj.act(proj.linear_1(x))
            hb = torch.cat([h, torch.ones(h.shape[0], 1)], 1)
            sol = torch.linalg.lstsq(hb, targets.reshape(-1, targets.shape[-1])).solution
            proj.linear_2.weight.copy_(sol[:-1].T)
            proj.linear_2.bias.copy_(sol[-1])
        opt = torch.optim.Adam(proj.parameters(), lr=1e-3)
        scale = float(targets.pow(2).mean())
        loss = F.mse_loss(proj(feats), targets).detach() / scale
        log.info("projector least-squares fit: relative mse %.4f", loss.item())
        for step in range(cfg.projector_steps):
            idx = torch.randint(0, feats.shape[0], (32,))
            loss = F.mse_loss(proj(feats[idx]), targets[idx]) / scale
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 100 == 0 or step == cfg.projector_steps - 1:
                log.info("projector %d/%d relative mse %.4f", step, cfg.projector_steps, loss.item())
        return {"projector_rel_mse": float(loss.detach())} if cfg.projector_steps else {}

    # -- data-driven initialisation of content retrieval ---------------------------------------------
    @torch.no_grad()
    def fit_retrieval_heads(self, n_batches: int = 4) -> dict:
        """Layer 1, query heads 0 and 1 (KV head 0): write a content-matching score into the RoPE pairs that
        barely rotate over the prompt. From the model's own layer-1 inputs, least squares fits P_q (answer
        position -> which colour / shape words the question names) and P_k (image token -> its colour and
        shape); q.k then adds s * (P_q x_answer) . (P_k x_patch): high on the patches holding what the
        question names. Positional dimensions are left as trained (row/column questions use them)."""
        model, cfg = self.model, self.cfg
        lm = model.model.language_model
        layer = lm.layers[1]
        attrs = COLORS + SHAPES
        xq, yq, xk, yk = [], [], [], []
        for i in range(n_batches):
            items = [
                self.sampler.item(30_000_000 + i * 100 + j, cfg.questions_per_image)
                for j in range(cfg.images_per_batch)
            ]
            batch = make_batch(items, self.enc)
            out = self._forward(batch, want_attn=False, want_hidden=True)
            h = layer.input_layernorm(out.hidden_states[1])
            qs = [q for it in items for q in it.questions]
            for (b, a), q in zip(batch.answer_rows.tolist(), qs):
                words = {"q": q.text.split(), "hint": q.hint.split()}
                y = torch.zeros(len(attrs))
                for seg, k in q.keys:
                    if words[seg][k] in attrs:
                        y[attrs.index(words[seg][k])] = 1.0
                xq.append(h[b, a])
                yq.append(y)
            P = len(self.enc.prefix) + GRID * GRID
            img = h[:, P - GRID * GRID : P].reshape(-1, h.shape[-1])
            lab = batch.patch_labels.reshape(-1, 4)
            y = torch.zeros(img.shape[0], len(attrs))
            has = lab[:, 0] > 0
            y[has, lab[has, 0] - 1] = 1.0
            y[has, len(COLORS) + lab[has, 1] - 1] = 1.0
            xk.append(img)
            yk.append(y)
            # every text position is a key too, and must not match (the question's own words are there)
            text = torch.ones(batch.input_ids.shape, dtype=torch.bool)
            text[:, P - GRID * GRID : P] = False
            text &= batch.input_ids != self.enc.tok.pad_token_id
            xk.append(0.3 * h[text])  # weighted down: many rows, and they only need to stay below the patches
            yk.append(torch.zeros(int(text.sum()), len(attrs)))
        is_img = torch.cat([torch.full((len(y),), i % 2 == 0) for i, y in enumerate(yk)])
        xq, yq, xk, yk = torch.stack(xq), torch.stack(yq), torch.cat(xk), torch.cat(yk)
        pq = torch.linalg.lstsq(xq, yq).solution.T  # (12, D)
        pk = torch.linalg.lstsq(xk, yk).solution.T
        acc_q = float(((xq @ pq.T > 0.5) == (yq > 0.5)).all(1).float().mean())
        acc_k = float(((xk[is_img] @ pk.T > 0.5) == (yk[is_img] > 0.5)).all(1).float().mean())
        text_max = float((xk[~is_img] @ pk.T / 0.3).max(1).values.quantile(0.99))
        attn = layer.self_attn
        hd = attn.head_dim
        n = len(attrs)
        dims = list(range(hd // 2 - n, hd // 2))  # the slowest-rotating RoPE pairs (first halves)
        scale = math.sqrt(40.0 * math.sqrt(hd))  # a named attribute on the patch adds ~10-15 to the logit
        for head in (0, 1):
            rows = [head * hd + d for d in dims]
            attn.q_proj.weight[rows] = scale * pq
        attn.k_proj.weight[dims] = scale * pk  # KV head 0 (query heads 0 and 1)
        for d in dims:  # their rotation partners carry nothing
            attn.k_proj.weight[d + hd // 2] = 0.0
            for head in (0, 1):
                attn.q_proj.weight[head * hd + d + hd // 2] = 0.0
        info = {"retrieval_fit_query_exact": round(acc_q, 3), "retrieval_fit_patch_exact": round(acc_k, 3),
                "retrieval_fit_text_p99": round(text_max, 3)}  # fmt: skip
        log.info("fitted layer-1 content retrieval: %s", info)
        return info

    # -- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """First-answer-token accuracy on held-out scenes: each question is scored exactly as a single-turn
        greedy answer would be (the tree mask hides the other questions)."""
        self.model.eval()
        hits: dict[str, list[float]] = {}
        for start in range(0, self.cfg.eval_items, 8):
            items = [
                self.heldout.item(i, self.cfg.questions_per_image)
                for i in range(start, min(self.cfg.eval_items, start + 8))
            ]
            batch = make_batch(items, self.enc)
            logits = self._forward(batch, want_attn=False).logits
            ok, qtypes, mmb = answer_accuracy(logits, batch)
            for o, t, m in zip(ok, qtypes, mmb):
                hits.setdefault(("mmb " if m else "vqa ") + t, []).append(float(o))
                hits.setdefault("all", []).append(float(o))
        self.model.train()
        return {k: round(float(np.mean(v)), 3) for k, v in sorted(hits.items())}

    def _forward(self, batch: TinyLlavaBatch, want_attn: bool, want_hidden: bool = False):
        return self.model(
            input_ids=batch.input_ids,
            pixel_values=batch.pixel_values,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            output_attentions=want_attn,
            output_hidden_states=want_hidden,
            use_cache=False,
        )

    def exit_loss(self, hidden_states, batch: TinyLlavaBatch) -> torch.Tensor:
        """Cross-entropy of the answer read out early, after each layer from the second to the last but one."""
        lm = self.model.model.language_model
        b, a = batch.answer_rows[:, 0], batch.answer_rows[:, 1]
        gold = batch.labels[b, a]
        terms = []
        for h in hidden_states[2:-1]:
            logits = self.model.lm_head(lm.norm(h[b, a]))
            terms.append(F.cross_entropy(logits, gold))
        return torch.stack(terms).mean() if terms else torch.zeros(())

    def readout_loss(self, o_proj_input: torch.Tensor, batch: TinyLlavaBatch) -> torch.Tensor:
        """Cross-entropy of the letter read from layer 2 head 0's contribution alone (its slice of o_proj),
        through the final norm and the LM head, at the multiple-choice answer positions."""
        lm = self.model.model.language_model
        attn = lm.layers[2].self_attn
        hd = attn.head_dim
        rows = batch.answer_rows[torch.tensor(batch.mmbench)]
        b, a = rows[:, 0], rows[:, 1]
        contrib = o_proj_input[b, a, :hd] @ attn.o_proj.weight[:, :hd].T  # (N, hidden)
        logits = self.model.lm_head(lm.norm(contrib))
        return F.cross_entropy(logits, batch.labels[b, a])

    # -- main --------------------------------------------------------------------------------------
    def run(self) -> Path:
        cfg, model = self.cfg, self.model
        self.out.mkdir(parents=True, exist_ok=True)
        params = list(model.parameters()) + list(self.probe.parameters())
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.98),
        )  # fmt: skip
        step, elapsed = 0, 0.0
        if self.ckpt_path.exists():
            state = self._load_state(self.ckpt_path, opt)
            if state["config"] != asdict(cfg) | {"steps": state["config"]["steps"]}:
                log.warning("resuming with a changed config: %s -> %s", state["config"], asdict(cfg))
            step, elapsed = state["step"], state["elapsed"]
            self.retrieval_fitted = state.get("retrieval_fitted", False)
            log.info("resumed from %s at step %d", self.ckpt_path, step)
        elif cfg.init_from:
            # Adam's moments too: a fresh optimiser's first updates are full-size in every direction (held-out
            # 0.55 -> 0.45 after 250 steps at lr 1.5e-3 with fresh moments; 0.49 after 100 at lr 4e-4 with them)
            state = self._load_state(cfg.init_from, opt)
            self._log({"stage": "init", "from": str(cfg.init_from), "from_step": state["step"]})
            log.info("initialised from %s (its step %d: weights and optimiser moments); new schedule",
                     cfg.init_from, state["step"])  # fmt: skip
            self._save_state(opt, step, elapsed)
        else:
            torch.manual_seed(cfg.seed)
            t0 = time.time()
            info = self.vision_stage()
            info.update(self.circuit_stage() if cfg.circuit else self.projector_stage())
            elapsed = time.time() - t0
            self._log({"stage": "vision", "seconds": round(elapsed, 1), **info})
            self._save_state(opt, step, elapsed)
            if cfg.steps == 0:
                acc = self.evaluate()
                log.info("held-out accuracy %s", acc)
                self._log({"step": 0, "heldout": acc, "seconds": round(time.time() - t0, 1)})
        model.train()
        last_ckpt, t_start = time.time(), time.time() - elapsed
        run_loss = run_attn = 0.0
        n_run = 0
        while step < cfg.steps:
            if 0 <= cfg.retrieval_fit_step <= step and not self.retrieval_fitted:
                self._log({"step": step, **self.fit_retrieval_heads()})
                self.retrieval_fitted = True
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            items = [
                self.sampler.item(step * cfg.images_per_batch + i, cfg.questions_per_image)
                for i in range(cfg.images_per_batch)
            ]
            batch = make_batch(items, self.enc, letter_teacher=cfg.letter_teacher)
            teach_on = cfg.attn_weight > 0 and step < cfg.attn_until * cfg.steps
            head_in: dict = {}
            hook = None
            if cfg.readout_weight > 0 and any(batch.mmbench):
                o_proj = model.model.language_model.layers[2].self_attn.o_proj
                hook = o_proj.register_forward_pre_hook(lambda m, a, box=head_in: box.__setitem__("x", a[0]))
            out = self._forward(batch, want_attn=teach_on, want_hidden=cfg.exit_weight > 0)
            if hook is not None:
                hook.remove()
            logits = out.logits
            lm = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
            loss = lm
            if cfg.exit_weight > 0:
                loss = loss + cfg.exit_weight * self.exit_loss(out.hidden_states, batch)
            if "x" in head_in:
                loss = loss + cfg.readout_weight * self.readout_loss(head_in["x"], batch)
            if teach_on:
                att = teacher_loss(out.attentions, batch.teach)
                loss = loss + cfg.attn_weight * att
                run_attn += float(att.detach())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            run_loss += float(lm.detach())
            n_run += 1
            if step % 25 == 0:
                log.info("step %d/%d lm %.4f attn %.3f lr %.2e %.2fs/step", step, cfg.steps, run_loss / n_run,
                         run_attn / n_run, lr_at(step, cfg), (time.time() - t_start) / max(1, step))  # fmt: skip
                self._log({"step": step, "lm": round(run_loss / n_run, 4), "attn": round(run_attn / n_run, 4),
                           "seconds": round(time.time() - t_start, 1)})  # fmt: skip
                run_loss = run_attn = 0.0
                n_run = 0
            if step % cfg.eval_every == 0 or step == cfg.steps:
                acc = self.evaluate()
                log.info("step %d held-out accuracy %s", step, acc)
                self._log({"step": step, "heldout": acc, "seconds": round(time.time() - t_start, 1)})
            if time.time() - last_ckpt > 60 * cfg.checkpoint_minutes or step == cfg.steps:
                self._save_state(opt, step, time.time() - t_start)
                last_ckpt = time.time()
        return self.export(self.out / "model")

    def _load_state(self, path: str | Path, opt) -> dict:
        """Load a train_state.ckpt.pt's model, probe and optimiser state; return the whole state."""
        state = load_checkpoint(path, "training state")
        missing = {"model", "probe", "opt", "step", "elapsed", "config"} - set(state)
        if missing:
            raise DataError(f"{path} is not a zoo training state (it lacks {sorted(missing)})")
        try:
            self.model.load_state_dict(state["model"])
            self.probe.load_state_dict(state["probe"])
            opt.load_state_dict(state["opt"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path} was written for a model or optimiser of another shape ({e})") from e
        return state

    def _save_state(self, opt, step: int, elapsed: float) -> None:
        state = {
            "model": self.model.state_dict(),
            "probe": self.probe.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "elapsed": elapsed,
            "config": asdict(self.cfg),
            "retrieval_fitted": self.retrieval_fitted,
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(self.ckpt_path, buf.getvalue())

    def _log(self, record: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def export(self, path: Path) -> Path:
        """Save a plain LLaVA checkpoint (SDPA attention) and its processor with save_pretrained."""
        self.model.config._attn_implementation = "sdpa"
        self.model.config.mm_oval_training = asdict(self.cfg)
        self.model.eval()
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)
        self.model.config._attn_implementation = "eager"
        log.info("exported the tiny LLaVA to %s", path)
        return path


def train(out: str | Path, cfg: TinyLlavaTrainConfig) -> Path:
    random.seed(cfg.seed)
    return Trainer(out, cfg).run()


def __getattr__(name: str) -> Any:
    if name == "TrainConfig":  # the former name, shared with another module's training settings
        warnings.warn(
            f"{__name__}.TrainConfig is now TinyLlavaTrainConfig (the bundled tiny LLaVA's training settings)",
            FutureWarning,
            stacklevel=2,
        )
        return TinyLlavaTrainConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
