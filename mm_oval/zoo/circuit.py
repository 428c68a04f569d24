"""A closed-form initialisation of the tiny LLaVA's projector and language model.

Writes the weights of a plain `LlavaForConditionalGeneration`, after its trained vision tower, so that its
attention carries out the retrieval the bundled benchmark asks for, from what the generator knows about its
own language: which words are colours, shapes, digits and option letters, and where in a question its key
words sit. Training may continue from it (`mm-oval zoo train --circuit --steps N`).

The residual stream (128 dimensions) is laid out in named fields (`LAYOUT`) beside a constant field that
dominates every token's norm, so RMSNorm leaves the fields' ratios intact; content scores use the RoPE
pairs that barely turn over a prompt, positional scores the fast pairs.

- Layer 0: four positional heads gather the words 1 to 5 tokens back (at a question's `?`: its key words;
  at an option word: its letter; at the answer position: the multiple-choice suffix); its MLP marks the
  `.` that ends a hint `... row R column C .`.
- Layer 1: the answer position copies the keys of the latest question's `?` (or of a marked hint `.`).
- Layer 2: retrieval from the image: head 0 matches colour and shape, head 2 row and column, each against
  a BOS sink, so a patch wins only when it matches every key; counting reads the sink's share of the
  attention, 1 / (n + 1), and the MLP turns it into a digit.
- Layer 3: in a multiple-choice prompt, the answer position copies the letter of the option equal to the
  answer.
- The LM head gates each answer class by the question's type and puts `</s>` after the answer word.

The circuit in full, why the bundled checkpoint is written rather than learned, and what it reaches:
docs/zoo.md, "The recipe of the bundled checkpoint".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import ModelError
from .generate import COLORS, GRID, LETTERS, SHAPES

CONST = 8.0  # the constant field's value in every token
COUNT_MAX = 8

_FIELDS = [
    ("CONST", 1),
    ("W_COL", len(COLORS)),
    ("W_SHP", len(SHAPES)),
    ("W_DIG", COUNT_MAX + 1),
    ("W_LET", len(LETTERS)),
    ("W_YES", 1),
    ("W_NO", 1),
    ("IS_Q", 1),
    ("IS_DOT", 1),
    ("IS_BOS", 1),
    ("PAD", 1),
    ("W_THERE", 1),
    ("W_IMAGE", 1),
    ("W_DIRECTLY", 1),
    ("W_ASSIST", 1),
    ("I_COL", len(COLORS)),
    ("I_SHP", len(SHAPES)),
    ("I_ROW", GRID),
    ("I_CLM", GRID),
    ("K_COL", len(COLORS)),
    ("K_SHP", len(SHAPES)),
    ("K_ROW", GRID),
    ("K_CLM", GRID),
    ("T_THERE", 1),
    ("T_IMAGE", 1),
    ("T_MMB", 1),
    ("T_ASSIST", 1),
    ("HINT", 1),
    ("L", len(LETTERS)),
    ("SINKX", 1),
]


def _layout() -> dict[str, slice]:
    out, at = {}, 0
    for name, n in _FIELDS:
        out[name] = slice(at, at + n)
        at += n
    return out


LAYOUT = _layout()
HIDDEN = 128  # the text model width the layout is written for
# an image token holding an object: the constant plus four unit fields (colour, shape, row, column)
OBJECT_NORM = math.sqrt(CONST**2 + 4)


def _idx(name: str, i: int = 0) -> int:
    s = LAYOUT[name]
    if not 0 <= i < s.stop - s.start:
        raise IndexError(f"{name}[{i}]")
    return s.start + i


# the RoPE pairs used for content scores (slow) and for offsets (fast); head_dim 64 -> pair j is (j, j + 32)
HEAD_DIM = 64
HALF = HEAD_DIM // 2
OFFSET_PAIRS = range(6)


def _unit_scale(hidden: int, norm: float) -> float:
    """What a unit field becomes after RMSNorm (weight 1) in a token of the given norm."""
    return math.sqrt(hidden) / norm


def check_model(model) -> None:
    cfg = model.config.text_config
    need = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
    }
    bad = {k: getattr(cfg, k, None) for k, v in need.items() if getattr(cfg, k, None) != v}
    if bad:
        raise ModelError(
            f"the circuit is written for the tiny LLaVA's text shape {need}; this model has {bad}"
        )
    theta = (cfg.rope_parameters or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta != 1e6:
        raise ModelError(f"the circuit needs RoPE theta 1e6 (slow pairs for content scores), got {theta}")
    if model.config.text_config.attention_bias or model.config.text_config.mlp_bias:
        raise ModelError("the circuit assumes bias-free attention and MLP projections")


def _inv_freq(theta: float = 1e6) -> torch.Tensor:
    return theta ** (-torch.arange(HALF, dtype=torch.float64) / HALF)


# ------------------------------------------------------------------------------------------------
# embeddings and the projector


def word_features(tokenizer) -> dict[int, dict[int, float]]:
    """Token id -> {dimension index: value} beyond the constant field."""
    ids = tokenizer.convert_tokens_to_ids
    feats: dict[int, dict[int, float]] = {}

    def put(word: str, name: str, i: int = 0, v: float = 1.0) -> None:
        tid = ids(word)
        if tid == tokenizer.unk_token_id:
            raise ModelError(f"the tokenizer has no token {word!r}")
        feats.setdefault(tid, {})[_idx(name, i)] = v

    for i, c in enumerate(COLORS):
        put(c, "W_COL", i)
    for i, s in enumerate(SHAPES):
        put(s, "W_SHP", i)
    for n in range(COUNT_MAX + 1):
        put(str(n), "W_DIG", n)
    for i, letter in enumerate(LETTERS):
        put(letter, "W_LET", i)
    put("yes", "W_YES")
    put("no", "W_NO")
    put("?", "IS_Q")
    put(".", "IS_DOT")
    put("there", "W_THERE")
    put("image", "W_IMAGE")
    put("directly", "W_DIRECTLY")
    put("ASSISTANT", "W_ASSIST")
    feats.setdefault(tokenizer.bos_token_id, {})[_idx("IS_BOS")] = 1.0
    return feats


@torch.no_grad()
def set_embeddings(model, tokenizer) -> None:
    emb = model.model.language_model.embed_tokens.weight
    emb.zero_()
    emb[:, _idx("CONST")] = CONST
    for tid, f in word_features(tokenizer).items():
        for d, v in f.items():
            emb[tid, d] = v
    # every token gets an object patch's norm: RMSNorm then scales all tokens alike, so positional scores
    # do not depend on which word sits at an offset, and the BOS sink scores exactly like a matching patch
    # (counting reads the sink's share)
    emb[:, _idx("PAD")] = (OBJECT_NORM**2 - emb.pow(2).sum(1)).clamp_min(0).sqrt()


@torch.no_grad()
def set_projector(model, code: torch.Tensor, sharpness: float = 40.0) -> None:
    """`code` (D + 1, 28): least-squares one-hot regressions of a patch feature (bias last) onto its colour
    (8), shape (4), row (8) and column (8). linear_1 turns each regression into a saturated 0/1 unit as a
    difference of two GELUs; linear_2 writes the units into the image fields, plus the constant."""
    proj = model.model.multi_modal_projector
    w1, b1, w2, b2 = proj.linear_1.weight, proj.linear_1.bias, proj.linear_2.weight, proj.linear_2.bias
    n = code.shape[1]
    if 2 * n > w1.shape[0]:
        raise ModelError(f"projector too narrow: {w1.shape[0]} units for {n} classes")
    for t in (w1, b1, w2, b2):
        t.zero_()
    a_w = sharpness * code[:-1].T  # (n, D)
    a_b = sharpness * (code[-1] - 0.5) + 0.5
    w1[:n], b1[:n] = a_w, a_b
    w1[n : 2 * n], b1[n : 2 * n] = a_w, a_b - 1.0
    fields = [("I_COL", len(COLORS)), ("I_SHP", len(SHAPES)), ("I_ROW", GRID), ("I_CLM", GRID)]
    j = 0
    for name, k in fields:
        for i in range(k):
            w2[_idx(name, i), j] = 1.0
            w2[_idx(name, i), n + j] = -1.0
            j += 1
    b2[_idx("CONST")] = CONST
    # an empty cell (no colour unit on) is padded to an object's norm, like every word
    b2[_idx("PAD")] = math.sqrt(2.0)
    w2[_idx("PAD"), : len(COLORS)] = -math.sqrt(2.0)
    w2[_idx("PAD"), n : n + len(COLORS)] = math.sqrt(2.0)


CODE_SIZE = len(COLORS) + len(SHAPES) + 2 * GRID


def code_targets(labels: torch.Tensor) -> torch.Tensor:
    """(..., 4) patch labels (as `train.patch_labels`: colour / shape 0 = empty, row, column) -> (...,
    CODE_SIZE) one-hot code: colour 1..8, shape 1..4, row, column (an empty cell has no colour or shape bit)."""
    return torch.cat(
        [
            F.one_hot(labels[..., 0], len(COLORS) + 1)[..., 1:],
            F.one_hot(labels[..., 1], len(SHAPES) + 1)[..., 1:],
            F.one_hot(labels[..., 2], GRID),
            F.one_hot(labels[..., 3], GRID),
        ],
        -1,
    ).float()


def projector_code(feats: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Least-squares regressions of patch features (..., D) onto their one-hot code (`code_targets`).
    Returns (code (D + 1, CODE_SIZE), bias last; fit report)."""
    x = feats.reshape(-1, feats.shape[-1]).double()
    target = code_targets(labels.reshape(-1, 4)).double()
    xb = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    code = torch.linalg.lstsq(xb, target).solution
    err = (xb @ code - target).abs().max(1).values
    report = {
        "patches": int(x.shape[0]),
        "max_err": float(err.max()),
        "frac_err_below_0.3": float((err < 0.3).float().mean()),
    }
    return code.float(), report


# ------------------------------------------------------------------------------------------------
# the language model


def _rope_vec(offsets: list[int], pairs, amp: float) -> torch.Tensor:
    """A query (head_dim,) that, against a key with `amp` in the first component of each pair, scores
    highest at the keys `offsets` tokens back (q' . k' = |q||k| cos((n - m) theta + d theta))."""
    inv = _inv_freq()
    q = torch.zeros(HEAD_DIM, dtype=torch.float64)
    for d in offsets:
        for j in pairs:
            q[j] += amp * math.cos(d * inv[j])
            q[j + HALF] += -amp * math.sin(d * inv[j])
    return q.float()


COMMON_KEY_PAIR = 18  # layer 2, KV head 0: a pair no query of that head uses
RECENCY_PAIR = 12  # turns by 1e6^(-12/32) = 0.0056 rad per token: -sin(d theta) falls for d < ~280


def _recency(attn, q_rows: list[int], kv: int, slope: float, c: float) -> None:
    """Add -slope / theta * sin(d theta) (about -slope per token of distance d) to the scores of the given
    query heads: with RoPE, a key (1, 0) and a query (0, 1) in one pair score cos(d theta + pi / 2)."""
    theta = float(_inv_freq()[RECENCY_PAIR])
    amp = math.sqrt(slope * math.sqrt(HEAD_DIM) / theta)
    attn.k_proj.weight[kv * HEAD_DIM + RECENCY_PAIR, _idx("CONST")] = amp / c
    for h in q_rows:
        attn.q_proj.weight[h * HEAD_DIM + RECENCY_PAIR + HALF, _idx("CONST")] = amp / c


@torch.no_grad()
def set_language_model(model, tokenizer, beta: float = 24.0, gate: float = 20.0, word: float = 10.0) -> None:
    """Write the language model's weights (embeddings, attention, MLPs, norms, LM head)."""
    check_model(model)
    lm = model.model.language_model
    hidden = model.config.text_config.hidden_size
    for p in lm.parameters():
        p.zero_()
    model.lm_head.weight.zero_()
    set_embeddings(model, tokenizer)
    for layer in lm.layers:
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    lm.norm.weight.fill_(1.0)

    # typical scales after RMSNorm: a unit field (u) and the constant field (c) in a token of ~2 features
    # every token enters with an object patch's norm (see set_embeddings); later layers add a few unit
    # fields, so u (a unit field after RMSNorm) and c (the constant field after RMSNorm) are near, not exact
    u_obj = _unit_scale(hidden, OBJECT_NORM)
    u = u_obj
    c = CONST * u
    scale = math.sqrt(HEAD_DIM)  # the attention divides q.k by this

    # -- layer 0: positional gathering ------------------------------------------------------------
    a0 = lm.layers[0].self_attn
    amp = math.sqrt(150.0)  # q.k amplitude per pair ~150 / 8: a margin of ~15 logits for one offset
    for kv in range(2):
        for j in OFFSET_PAIRS:
            a0.k_proj.weight[kv * HEAD_DIM + j, _idx("CONST")] = amp / c
    for h, offs in enumerate([[1], [3], [2], [4, 5]]):
        q = _rope_vec(offs, OFFSET_PAIRS, amp / c)
        a0.q_proj.weight[h * HEAD_DIM : (h + 1) * HEAD_DIM, _idx("CONST")] = q
    # values (both KV heads alike): the token's word fields, at unit size
    vsrc = [("W_COL", i) for i in range(len(COLORS))] + [("W_SHP", i) for i in range(len(SHAPES))]
    vsrc += [("W_DIG", i) for i in range(COUNT_MAX + 1)] + [("W_LET", i) for i in range(len(LETTERS))]
    vsrc += [("W_THERE", 0), ("W_IMAGE", 0), ("W_DIRECTLY", 0), ("W_ASSIST", 0)]
    vpos = {f: k for k, f in enumerate(vsrc)}
    for kv in range(2):
        for k, (name, i) in enumerate(vsrc):
            a0.v_proj.weight[kv * HEAD_DIM + k, _idx(name, i)] = 1.0 / u
    o0 = a0.o_proj.weight

    def route(head: int, src: tuple[str, int], dst: tuple[str, int], gain: float = 1.0) -> None:
        o0[_idx(*dst), head * HEAD_DIM + vpos[src]] = gain

    for i in range(len(SHAPES)):
        route(0, ("W_SHP", i), ("K_SHP", i))
        route(3, ("W_SHP", i), ("K_SHP", i), 2.0)
    for n in range(1, GRID + 1):
        route(0, ("W_DIG", n), ("K_CLM", n - 1))
        route(1, ("W_DIG", n), ("K_ROW", n - 1))
    for i in range(len(COLORS)):
        route(2, ("W_COL", i), ("K_COL", i))
        route(3, ("W_COL", i), ("K_COL", i), 2.0)
    for i in range(len(LETTERS)):
        route(2, ("W_LET", i), ("L", i))
    route(0, ("W_THERE", 0), ("T_THERE", 0))
    route(0, ("W_IMAGE", 0), ("T_IMAGE", 0))
    route(1, ("W_DIRECTLY", 0), ("T_MMB", 0))
    route(2, ("W_ASSIST", 0), ("T_ASSIST", 0))

    # -- layer 0 MLP: mark a "." that closes "row R column C" (a digit just before it) ------------------
    m0 = lm.layers[0].mlp
    steep0, half0 = 20.0, 4.0  # step(IS_DOT + K_CLM > 1.5), as two SiLUs
    for k, off in ((0, half0), (1, -half0)):
        m0.gate_proj.weight[k, _idx("IS_DOT")] = steep0 / u
        m0.gate_proj.weight[k, LAYOUT["K_CLM"]] = steep0 / u
        m0.gate_proj.weight[k, _idx("CONST")] = (-1.5 * steep0 + off) / c
        m0.up_proj.weight[k, _idx("CONST")] = 1.0 / c
    m0.down_proj.weight[_idx("HINT"), 0] = 1.0 / (2 * half0)
    m0.down_proj.weight[_idx("HINT"), 1] = -1.0 / (2 * half0)

    # -- layer 1: the answer position copies the question's keys --------------------------------------
    # score = beta1 * (6 [?] + 8 [hint "."]) minus a recency slope, so that in a conversation the latest
    # question wins (-a sin(d theta) falls linearly with the distance d over the first ~280 tokens)
    a1 = lm.layers[1].self_attn
    slow = HALF - 1  # a pair that does not turn over the prompt
    beta1 = 20.0
    a1.q_proj.weight[slow, _idx("CONST")] = beta1 * scale / (c * u)
    a1.k_proj.weight[slow, _idx("IS_Q")] = 6.0
    a1.k_proj.weight[slow, _idx("HINT")] = 8.0
    _recency(a1, q_rows=[0], kv=0, slope=1.4, c=c)
    copied = [
        (n, i) for n in ("K_COL", "K_SHP", "K_ROW", "K_CLM") for i in range(LAYOUT[n].stop - LAYOUT[n].start)
    ]
    copied += [("T_THERE", 0), ("T_IMAGE", 0)]
    for k, (name, i) in enumerate(copied):
        a1.v_proj.weight[k, _idx(name, i)] = 1.0 / u
        a1.o_proj.weight[_idx(name, i), k] = 1.0

    # -- layer 2: retrieval from the image ---------------------------------------------------------
    a2 = lm.layers[2].self_attn
    bq = beta * scale / (u * u_obj)  # query gain: a unit key match scores beta
    # head 0 (KV head 0): colour and shape, with the sink
    col_pairs = list(range(23, 31))
    shp_pairs = list(range(19, 23))
    sink = 31
    for i, j in enumerate(col_pairs):
        a2.k_proj.weight[j, _idx("I_COL", i)] = 1.0
        a2.q_proj.weight[j, _idx("K_COL", i)] = bq
    for i, j in enumerate(shp_pairs):
        a2.k_proj.weight[j, _idx("I_SHP", i)] = 1.0
        a2.q_proj.weight[j, _idx("K_SHP", i)] = bq
    a2.k_proj.weight[sink, _idx("IS_BOS")] = 1.0
    # a key direction every token shares (no query reads it: scores are unchanged), so an empty cell's key
    # is not exactly zero; trained models' keys share a common direction too, and key-geometry methods
    # (KeyDiff's cosine to the mean key) are undefined on a zero key
    a2.k_proj.weight[COMMON_KEY_PAIR, _idx("CONST")] = 0.5 / CONST
    a2.q_proj.weight[sink, LAYOUT["K_COL"]] = 0.75 * bq
    a2.q_proj.weight[sink, LAYOUT["K_SHP"]] = 0.75 * bq
    a2.q_proj.weight[sink, _idx("T_THERE")] = 0.25 * bq
    a2.q_proj.weight[sink, LAYOUT["K_ROW"]] = 1.0 * bq  # position questions: head 0 rests on the sink
    # head 2 (KV head 1): row and column, sink at 1.5 matches
    row_pairs = list(range(15, 23))
    clm_pairs = list(range(23, 31))
    q2 = 2 * HEAD_DIM
    for i, j in enumerate(row_pairs):
        a2.k_proj.weight[HEAD_DIM + j, _idx("I_ROW", i)] = 1.0
        a2.q_proj.weight[q2 + j, _idx("K_ROW", i)] = bq
    for i, j in enumerate(clm_pairs):
        a2.k_proj.weight[HEAD_DIM + j, _idx("I_CLM", i)] = 1.0
        a2.q_proj.weight[q2 + j, _idx("K_CLM", i)] = bq
    a2.k_proj.weight[HEAD_DIM + sink, _idx("IS_BOS")] = 1.0
    a2.q_proj.weight[q2 + sink, _idx("CONST")] = 1.5 * beta * scale / (c * u_obj)
    # values: the patch's colour and shape (both KV heads); the sink's mark (KV head 0)
    out_fields = [("I_COL", i) for i in range(len(COLORS))] + [("I_SHP", i) for i in range(len(SHAPES))]
    for kv, head in ((0, 0), (1, 2)):
        for k, (name, i) in enumerate(out_fields):
            a2.v_proj.weight[kv * HEAD_DIM + k, _idx(name, i)] = 1.0 / u_obj
            a2.o_proj.weight[_idx(name, i), head * HEAD_DIM + k] = 1.0
    ks = len(out_fields)
    a2.v_proj.weight[ks, _idx("IS_BOS")] = 1.0 / u_obj
    a2.o_proj.weight[_idx("SINKX"), ks] = 1.0

    # -- layer 2 MLP: the sink's share 1 / (n + 1) -> a one-hot count in W_DIG ---------------------------
    mlp = lm.layers[2].mlp
    shares = [1.0 / (n + 1) for n in range(COUNT_MAX + 1)]
    mids = [(shares[n] + shares[n + 1]) / 2 for n in range(COUNT_MAX)]
    steep, half = 2000.0, 4.0  # step(x > m) = (silu(K(x - m) + h) - silu(K(x - m) - h)) / 2h
    g, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight

    def unit(k: int, m: float, off: float) -> None:
        g[k, _idx("SINKX")] = steep / u
        g[k, _idx("CONST")] = (-steep * m + off) / c
        up[k, _idx("T_THERE")] = 1.0 / u  # only counting questions: the unit's output times T_THERE (~1 or 0)

    for n, m in enumerate(mids):
        unit(2 * n, m, half)
        unit(2 * n + 1, m, -half)
        # step_n = [x > m_n] = [count <= n]: one-hot(n) = step_n - step_{n-1}; one-hot(8) = 1 - step_7
        for sign, k in ((1.0, 2 * n), (-1.0, 2 * n + 1)):
            down[_idx("W_DIG", n), k] += sign / (2 * half)
            down[_idx("W_DIG", n + 1), k] -= sign / (2 * half)
    # the 1 of one-hot(8): silu(2h) - silu(0) = 2h * sigmoid(2h), times T_THERE
    k = 2 * COUNT_MAX
    g[k, _idx("CONST")] = 2 * half / c
    for kk in (k, k + 1):
        up[kk, _idx("T_THERE")] = 1.0 / u
    lift = 1.0 / (2 * half * torch.sigmoid(torch.tensor(2 * half)).item())
    down[_idx("W_DIG", COUNT_MAX), k] = lift
    down[_idx("W_DIG", COUNT_MAX), k + 1] = -lift

    # -- layer 3: the option that holds the answer -------------------------------------------------
    a3 = lm.layers[3].self_attn
    b3 = 16.0
    g3 = b3 * scale / (u * u)
    match = [("W_COL", "I_COL", i) for i in range(len(COLORS))]
    match += [("W_SHP", "I_SHP", i) for i in range(len(SHAPES))]
    match += [("W_DIG", "W_DIG", i) for i in range(COUNT_MAX + 1)]
    dims = [j for j in range(16, HALF)] + [j + HALF for j in range(16, HALF)]
    for (kname, qname, i), j in zip(match, dims, strict=False):
        a3.k_proj.weight[j, _idx(kname, i)] = 1.0
        a3.q_proj.weight[j, _idx(qname, i)] = g3
    j_yes, j_opt = dims[len(match)], dims[len(match) + 1]
    a3.k_proj.weight[j_yes, _idx("W_YES")] = 1.0
    a3.k_proj.weight[j_yes, _idx("W_NO")] = -1.0
    a3.q_proj.weight[j_yes, _idx("CONST")] = g3 * u / c
    a3.q_proj.weight[j_yes, _idx("SINKX")] = -2.0 * g3
    a3.k_proj.weight[j_opt, LAYOUT["L"]] = 1.0
    a3.q_proj.weight[j_opt, _idx("CONST")] = g3 * u / c
    _recency(a3, q_rows=[0], kv=0, slope=0.8, c=c)
    for i in range(len(LETTERS)):
        a3.v_proj.weight[i, _idx("L", i)] = 1.0 / u
        a3.o_proj.weight[_idx("W_LET", i), i] = 1.0

    # -- the LM head: per answer class, its evidence plus a gate on the question's type ----------------
    W = model.lm_head.weight
    W[:, _idx("CONST")] = -gate / c  # every other word
    ids = tokenizer.convert_tokens_to_ids

    def row(word: str) -> torch.Tensor:
        return W[ids(word)]

    for i, col in enumerate(COLORS):
        r = row(col)
        r[_idx("CONST")] = gate / c
        r[_idx("I_COL", i)] = word / u
        r[LAYOUT["K_COL"]] = -gate / u
        r[_idx("T_MMB")] = -gate / u
    for i, shp in enumerate(SHAPES):
        r = row(shp)
        r[_idx("CONST")] = 0.0
        r[_idx("I_SHP", i)] = word / u
        r[LAYOUT["K_COL"]] = gate / u
        for t in ("T_THERE", "T_IMAGE", "T_MMB"):
            r[_idx(t)] = -gate / u
    for n in range(COUNT_MAX + 1):
        r = row(str(n))
        r[_idx("CONST")] = 0.0
        r[_idx("W_DIG", n)] = word / u
        r[_idx("T_THERE")] = gate / u
        r[_idx("T_MMB")] = -gate / u
    for w_, sign in (("yes", 1.0), ("no", -1.0)):
        r = row(w_)
        r[_idx("CONST")] = sign * word / c
        r[_idx("SINKX")] = -2.0 * sign * word / u
        r[_idx("T_IMAGE")] = gate / u
        r[_idx("T_MMB")] = -gate / u
    for i, letter in enumerate(LETTERS):
        r = row(letter)
        r[_idx("CONST")] = 0.0
        r[_idx("W_LET", i)] = word / u
        r[_idx("T_MMB")] = gate / u
    eos = W[tokenizer.eos_token_id]
    eos[_idx("CONST")] = 0.0
    eos[_idx("T_ASSIST")] = 3.0 * gate / u


def image_embeddings(labels: torch.Tensor) -> torch.Tensor:
    """(B, 64, 4) patch labels -> (B, 64, HIDDEN): the image tokens the projector writes when the tower's code
    is exact (the constant, the one-hot colour / shape / row / column fields, the norm pad of empty cells)."""
    code = code_targets(labels)
    out = torch.zeros(*labels.shape[:-1], HIDDEN)
    out[..., _idx("CONST")] = CONST
    sizes = [len(COLORS), len(SHAPES), GRID, GRID]
    for name, part in zip(("I_COL", "I_SHP", "I_ROW", "I_CLM"), code.split(sizes, -1), strict=True):
        out[..., LAYOUT[name]] = part
    out[..., _idx("PAD")] = math.sqrt(2.0) * (1 - code[..., : len(COLORS)].sum(-1))
    return out
