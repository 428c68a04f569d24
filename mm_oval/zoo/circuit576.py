"""A closed-form language model for the 576-token tiny LLaVA (scenes of `scenes.py`, questions of
`generate576.py`).

The vision tower is trained (`vision576.py`): a linear read-out of each patch feature gives the colour and
shape of the object the patch belongs to, the object's centre and the patch's own position. The projector
and the language model are written here, from what the generator knows about its own language: which words
are colours, shapes, digits, option letters and markers, and where in each question template its key words
sit. The result is a plain `LlavaForConditionalGeneration` (config checked by `check_model`).

The residual stream is laid out in named fields (`LAYOUT`); a large constant field dominates every token's
norm, so RMSNorm scales all tokens alike (to within a few per cent). Content scores use the RoPE pairs that
barely turn over a prompt (theta 1e16, head_dim 64: pair j turns by 10^(-j/2) rad per token; pairs 13..31
turn < 3e-4 rad over 1000 tokens, so the two halves of a pair, which carry different terms, do not mix),
positional scores the fast pairs 0..5.

- Projector: the colour as pairwise votes between the tower's own colour logits (8 votes: the argmax),
  saturated 0/1 units for the shape, the centre's coarse region (6 + 6), the patch's own position (ox, oy
  in [0, 1]) and its squared norm (piecewise linear). (The tower also reads out the object's centre; only
  the regions use it.)
- Layer 0: seven positional heads gather the words 1..7 tokens back (at a question's `?` they hold its key
  words: see `GATHER`). The MLP gives image tokens their colour (all 8 votes) and member flag, marks a
  hint's closing `.` (a digit before it) and forms the colour-shape conjunction of a word pair (`red
  circle` in an answer list).
- Layer 1: every token copies the keys and type flags of the latest `?` or marked hint `.` (a recency term
  makes the latest question win in a conversation); a second head sums the conjunctions named so far
  (`LISTED`: which objects an answer list has named); four more gather the colours of the patches to the
  left, upper right, above and upper left (offsets 1, 23, 24, 25 in the raster order of the image
  tokens). The MLP forms each image token's colour-shape conjunction, marks each object's first patch (a patch of its colour with none of that
  colour to its left, upper left, above or upper right: one per object of every shape and size) and forms
  the output context (what kind of word comes next).
- Layer 2: retrieval from the image, spread over the member patches of an object: colour/shape matching
  with a sink (colour of shape, shape of colour, exists, the second object of a relation; its value, the
  mean own position, is the object's centre), the first object of a relation, the region, the first
  patches of a colour (the sink's share 1/(n+1) counts them), and the list head (leftmost or topmost
  patches of an object not yet named; the sink when none is left). The MLP turns the count into a digit
  and compares the two objects' centres (left of, above).
- Layer 3: the object nearest to the named one (score -|o - c0|^2 over patch positions, patches of the
  named object's colour or shape set aside); the MLP gates each head's evidence by the question's type.
- Layer 4: in a multiple-choice prompt, the option word that equals the answer, whose letter is copied.
- LM head: each answer class (colour, shape, digit, yes/no, letter, `,`, `</s>`) gated by the context.
"""

from __future__ import annotations

import math

import torch

from ..errors import ModelError
from .scenes import GRID, REGION_PATCHES, REGIONS
from .vocab import COLORS, SHAPES

CONST = 300.0  # large: the fields a layer adds move a token's norm by < 0.01%
HIDDEN = 360  # the layout needs 357
LAYERS = 5
HEADS = 8
KV_HEADS = 4
HEAD_DIM = 64
HALF = HEAD_DIM // 2
INTERMEDIATE = 128  # the widest MLP uses 98 units
ROPE_THETA = (
    1e16  # content pairs 13..31 turn < 3e-4 rad over 1000 tokens: no cross-talk between a pair's halves
)
LETTERS = "ABCD"
DIGITS = 7  # words 0..6: region numbers 1..6, counts 0..5
COUNT_MAX = 5
NC, NS = len(COLORS), len(SHAPES)

MARKERS = [
    "IS_Q", "IS_DOT", "IS_COMMA", "IS_BOS", "W_THERE", "W_IMAGE", "W_DIRECTLY", "W_ASSIST", "W_OBJECT",
    "W_COLUMN", "W_COLORW", "W_LEFT", "W_ABOVE", "W_NEAREST", "W_RIGHT", "W_BOTTOM",
]  # fmt: skip
MARKER_WORDS = {
    "IS_Q": "?", "IS_DOT": ".", "IS_COMMA": ",", "W_THERE": "there", "W_IMAGE": "image",
    "W_DIRECTLY": "directly", "W_ASSIST": "ASSISTANT", "W_OBJECT": "object", "W_COLUMN": "column",
    "W_COLORW": "color", "W_LEFT": "left", "W_ABOVE": "above", "W_NEAREST": "nearest", "W_RIGHT": "right",
    "W_BOTTOM": "bottom",
}  # fmt: skip
# what a question's `?` must know, copied to the answer by layer 1
TYPE_FLAGS = [
    "T_COLORW",
    "T_OBJ",
    "T_THERE",
    "T_COLUMN",
    "T_IMAGE",
    "T_LEFT",
    "T_ABOVE",
    "T_NEAR",
    "T_LR",
    "T_TB",
]
KEY_FIELDS = [
    ("K_COL", NC),
    ("K_SHP", NS),
    ("K2_COL", NC),
    ("K2_SHP", NS),
    ("K_ROW", REGIONS),
    ("K_CLM", REGIONS),
]
CONTEXTS = ["C_COL", "C_SHP", "C_DIG", "C_YN", "C_LET", "C_EOS", "C_CE"]

_FIELDS = (
    [("CONST", 1), ("W_COL", NC), ("W_SHP", NS), ("W_DIG", DIGITS), ("W_LET", 4), ("W_YES", 1), ("W_NO", 1)]
    + [(m, 1) for m in MARKERS]
    # image tokens (the projector)
    + [
        ("I_CW", NC),
        ("I_COL", NC),
        ("I_SHP", NS),
        ("I_CONJ", NC * NS),
        ("I_RROW", REGIONS),
        ("I_RCOL", REGIONS),
    ]
    + [("I_CX", 1), ("I_CY", 1), ("I_R2", 1), ("I_OX", 1), ("I_OY", 1), ("I_MEM", 1)]
    # layer 0
    + KEY_FIELDS
    + [("P_COL", NC), ("L", 4), ("T_MMB", 1), ("T_START", 1), ("T_AFTER1", 1)]
    + [(t, 1) for t in TYPE_FLAGS]
    + [("HINT", 1), ("W_CONJ", NC * NS), ("N_L", NC), ("N_A", NC)]
    # layer 1
    + [("N_AR", NC), ("N_AL", NC), ("LISTED", NC * NS), ("I_ACOL", NC)]
    + [(c, 1) for c in CONTEXTS]
    # layer 2
    + [("E1_COL", NC), ("E1_SHP", NS), ("O2X", 1), ("O2Y", 1), ("SINK1", 1), ("O1X", 1), ("O1Y", 1)]
    + [("E3_COL", NC), ("SINK4", 1), ("EL_COL", NC), ("EL_SHP", NS), ("LEND", 1)]
    + [("EV_DIG", DIGITS), ("YSTEP", 1)]
    # layer 3
    + [("EN_COL", NC), ("EV_COL", NC), ("EV_SHP", NS)]
    # layer 4
    + [("EV_LET", 4)]
)


def _layout() -> dict[str, slice]:
    out, at = {}, 0
    for name, n in _FIELDS:
        if name in out:
            raise ModelError(f"field {name} twice in the layout")
        out[name] = slice(at, at + n)
        at += n
    if at > HIDDEN:
        raise ModelError(f"the layout needs {at} dimensions, the model has {HIDDEN}")
    return out


LAYOUT = _layout()


def f(name: str, i: int = 0) -> int:
    s = LAYOUT[name]
    if not 0 <= i < s.stop - s.start:
        raise IndexError(f"{name}[{i}]")
    return s.start + i


def conj(c: int, s: int) -> int:
    return c * NS + s


U = math.sqrt(HIDDEN) / CONST  # a unit field after RMSNorm (the constant dominates the norm)
C = CONST * U  # the constant field after RMSNorm
SCALE = math.sqrt(HEAD_DIM)  # attention divides q.k by this
SLOW = list(range(13, HALF))  # RoPE pairs that do not turn over a prompt
SLOW_DIMS = SLOW + [j + HALF for j in SLOW]  # 38 dimensions per head for content scores
FAST = range(6)
RECENCY_PAIR = 8  # turns 0.0032 rad per token: -sin(d theta) falls for d < ~500 and stays < 0 to ~990


def _inv_freq() -> torch.Tensor:
    return ROPE_THETA ** (-torch.arange(HALF, dtype=torch.float64) / HALF)


def check_model(model) -> None:
    cfg = model.config.text_config
    need = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
    }
    bad = {k: getattr(cfg, k, None) for k, v in need.items() if getattr(cfg, k, None) != v}
    if bad:
        raise ModelError(f"the 576-token circuit is written for the text shape {need}; this model has {bad}")
    theta = (cfg.rope_parameters or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta != ROPE_THETA:
        raise ModelError(f"the 576-token circuit needs RoPE theta {ROPE_THETA:g}, got {theta}")
    vc = model.config.vision_config
    if vc.image_size // vc.patch_size != GRID:
        raise ModelError(f"the 576-token circuit needs a {GRID}x{GRID} patch grid")


# ------------------------------------------------------------------------------------------------
# building blocks


class Attn:
    """Write one attention layer: q/k/v/o projections by head."""

    def __init__(self, layer):
        a = layer.self_attn
        self.q, self.k, self.v, self.o = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight
        self.group = HEADS // KV_HEADS

    def qrow(self, head: int, d: int) -> torch.Tensor:
        return self.q[head * HEAD_DIM + d]

    def krow(self, kv: int, d: int) -> torch.Tensor:
        return self.k[kv * HEAD_DIM + d]

    def content(self, head: int, pairs: list[tuple[dict, dict]], dims: list[int] | None = None) -> None:
        """Bilinear score terms: for each (query terms, key terms), one slow dimension gets the query's
        {field index: weight} and the key's {field index: weight}; scores are in logits (SCALE folded)."""
        dims = dims or SLOW_DIMS
        kv = head // self.group
        if len(pairs) > len(dims):
            raise ModelError(f"head {head}: {len(pairs)} score terms for {len(dims)} slow dimensions")
        for (qt, kt), d in zip(pairs, dims, strict=False):
            for i, w in qt.items():
                self.qrow(head, d)[i] += w * SCALE
            for i, w in kt.items():
                self.krow(kv, d)[i] += w

    def values(self, kv: int, fields: list[int], gain: float = 1.0 / U) -> dict[int, int]:
        """Value dims of KV head `kv` carrying the given residual fields at their raw size."""
        out = {}
        for k, i in enumerate(fields):
            self.v[kv * HEAD_DIM + k, i] = gain
            out[i] = k
        return out

    def route(self, head: int, vdim: int, dst: int, gain: float = 1.0) -> None:
        self.o[dst, head * HEAD_DIM + vdim] += gain

    def recency(self, heads: list[int], slope: float) -> None:
        """Add about -slope logits per token of distance (-sin(d theta) / theta of one slow-ish pair)."""
        theta = float(_inv_freq()[RECENCY_PAIR])
        amp = math.sqrt(slope * SCALE / theta)
        for h in heads:
            self.krow(h // self.group, RECENCY_PAIR)[f("CONST")] = amp / C
            self.qrow(h, RECENCY_PAIR + HALF)[f("CONST")] = amp / C


class MLP:
    """Write step units into one MLP: step(sum w_i x_i > t) = (silu(K a + h) - silu(K a - h)) / 2h."""

    def __init__(self, layer, half: float = 4.0):
        m = layer.mlp
        self.g, self.up, self.down = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
        self.n = 0
        self.h = half

    def step(self, terms: dict[int, float], t: float, out: dict[int, float], steep: float,
             up: int | None = None) -> None:  # fmt: skip
        """out += w * step(sum terms > t) [* x_up]. `terms` are raw field values (fields, not CONST)."""
        k = self.n
        if k + 2 > self.g.shape[0]:
            raise ModelError("MLP out of units")
        self.n += 2
        for kk, off in ((k, self.h), (k + 1, -self.h)):
            for i, w in terms.items():
                self.g[kk, i] += steep * w / U
            self.g[kk, f("CONST")] += (-steep * t + off) / C
            if up is None:
                self.up[kk, f("CONST")] = 1.0 / C
            else:
                self.up[kk, up] = 1.0 / U
        for i, w in out.items():
            self.down[i, k] += w / (2 * self.h)
            self.down[i, k + 1] -= w / (2 * self.h)


def _rope_query(offset: int, amp: float) -> torch.Tensor:
    """A query that, against a key with `amp` in the first component of each fast pair, scores highest at
    the key `offset` tokens back."""
    inv = _inv_freq()
    q = torch.zeros(HEAD_DIM, dtype=torch.float64)
    for j in FAST:
        q[j] += amp * math.cos(offset * inv[j])
        q[j + HALF] += -amp * math.sin(offset * inv[j])
    return q.float()


# ------------------------------------------------------------------------------------------------
# embeddings and the projector


def word_features(tokenizer) -> dict[int, dict[int, float]]:
    ids = tokenizer.convert_tokens_to_ids
    feats: dict[int, dict[int, float]] = {}

    def put(word: str, name: str, i: int = 0) -> None:
        tid = ids(word)
        if tid == tokenizer.unk_token_id:
            raise ModelError(f"the tokenizer has no token {word!r}")
        feats.setdefault(tid, {})[f(name, i)] = 1.0

    for i, c in enumerate(COLORS):
        put(c, "W_COL", i)
    for i, s in enumerate(SHAPES):
        put(s, "W_SHP", i)
    for n in range(DIGITS):
        put(str(n), "W_DIG", n)
    for i, letter in enumerate(LETTERS):
        put(letter, "W_LET", i)
    put("yes", "W_YES")
    put("no", "W_NO")
    for name, word in MARKER_WORDS.items():
        put(word, name)
    feats.setdefault(tokenizer.bos_token_id, {})[f("IS_BOS")] = 1.0
    return feats


@torch.no_grad()
def set_embeddings(model, tokenizer) -> None:
    emb = model.model.language_model.embed_tokens.weight
    emb.zero_()
    emb[:, f("CONST")] = CONST
    for tid, feats in word_features(tokenizer).items():
        for d, v in feats.items():
            emb[tid, d] = v


# what the tower's linear read-out gives per patch (the least-squares code of `projector_code`)
CODE = ["col"] * NC + ["shp"] * NS + ["cx", "cy", "ox", "oy"]
CODE_SIZE = len(CODE)


def code_targets(t: torch.Tensor) -> torch.Tensor:
    """(..., 7) vision576.targets -> (..., CODE_SIZE): colour one-hot (none = all 0), shape one-hot, centre
    and own position normalised by the grid."""
    col = torch.nn.functional.one_hot(t[..., 0].long(), NC + 1)[..., 1:].float()
    shp = torch.nn.functional.one_hot(t[..., 1].long(), NS + 1)[..., 1:].float()
    return torch.cat([col, shp, t[..., 2:6] / GRID], -1)


def projector_code(feats: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Least squares from patch features (..., D) to `code_targets` (bias last): (D + 1, CODE_SIZE)."""
    x = feats.reshape(-1, feats.shape[-1]).double()
    y = code_targets(t.reshape(-1, t.shape[-1])).double()
    xb = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    code = torch.linalg.lstsq(xb, y).solution
    pred = xb @ code
    mem = y[:, :NC].sum(1) > 0
    cls_err = (pred[:, : NC + NS] - y[:, : NC + NS]).abs().max(1).values
    report = {
        "patches": int(x.shape[0]),
        "class_err_below_0.3": float((cls_err < 0.3).float().mean()),
        "centre_err_patches_members": float(
            ((pred[mem, NC + NS : NC + NS + 2] - y[mem, NC + NS : NC + NS + 2]).abs() * GRID).mean()
        ),
        "own_err_patches": float(((pred[:, -2:] - y[:, -2:]).abs() * GRID).mean()),
    }
    return code.float(), report


@torch.no_grad()
def set_projector(model, code: torch.Tensor, sharp: float = 30.0, colour_logits=None) -> None:
    """linear_1: GELU units over the tower's code; linear_2: the image fields (see the module docstring).
    `colour_logits`: (weight (NC + 1, D), bias (NC + 1,)) of the tower's trained colour read-out (none
    first), whose argmax the image tokens then carry; without it, the least-squares code's colours."""
    proj = model.model.multi_modal_projector
    w1, b1, w2, b2 = proj.linear_1.weight, proj.linear_1.bias, proj.linear_2.weight, proj.linear_2.bias
    for t in (w1, b1, w2, b2):
        t.zero_()
    cw, cb = code[:-1].T.double(), code[-1].double()  # (CODE_SIZE, D), (CODE_SIZE,)
    n = 0

    def unit(wrow: torch.Tensor, bias: float) -> int:
        nonlocal n
        if n >= w1.shape[0]:
            raise ModelError("projector out of units")
        w1[n], b1[n] = wrow.float(), float(bias)
        n += 1
        return n - 1

    def step(comb: dict[int, float], t: float, s: float, out: dict[int, float]) -> None:
        """out += w * step(sum c_i code_i > t): GELU(a) - GELU(a - 1), a = s (x - t) + 0.5."""
        wrow = sum(c * cw[i] for i, c in comb.items())
        brow = sum(c * cb[i] for i, c in comb.items())
        k1 = unit(s * wrow, s * (brow - t) + 0.5)
        k2 = unit(s * wrow, s * (brow - t) - 0.5)
        for d, w in out.items():
            w2[d, k1] += w
            w2[d, k2] -= w

    def linear(i: int, out: dict[int, float]) -> None:
        """out += w * code_i (GELU(x + 10) - 10 is x to 1e-20)."""
        k = unit(cw[i], cb[i] + 10.0)
        for d, w in out.items():
            w2[d, k] += w
            b2[d] -= 10.0 * w

    def relu(i: int, t: float, out: dict[int, float], s: float = 400.0) -> None:
        k = unit(s * cw[i], s * (cb[i] - t))
        for d, w in out.items():
            w2[d, k] += w / s

    # the colour: the tower's own colour logits (its trained read-out, none first), as pairwise votes:
    # I_CW_c = #{k != c: logit_c > logit_k} / 8, 1 for the argmax only (layer 0's MLP thresholds it)
    if colour_logits is None:  # no read-out given: the least-squares code, 8 votes above 0.5
        for c in range(NC):
            step({c: 1.0}, 0.5, sharp, {f("I_CW", c): 1.0})
    else:
        lw, lb = colour_logits[0].double(), colour_logits[1].double()
        for c in range(NC):
            for k in range(NC + 1):
                if k == c + 1:
                    continue
                wrow, brow = lw[c + 1] - lw[k], lb[c + 1] - lb[k]
                k1 = unit(40.0 * wrow, 40.0 * brow + 0.5)
                k2 = unit(40.0 * wrow, 40.0 * brow - 0.5)
                w2[f("I_CW", c), k1] += 1.0 / NC
                w2[f("I_CW", c), k2] -= 1.0 / NC
    for s_ in range(NS):
        step({NC + s_: 1.0}, 0.5, sharp, {f("I_SHP", s_): 1.0})
    icx, icy, iox, ioy = NC + NS, NC + NS + 1, NC + NS + 2, NC + NS + 3
    # regions: the centre's row / column band; boundaries at multiples of 4 patches, centres at k + 0.5
    for axis, name in ((icy, "I_RROW"), (icx, "I_RCOL")):
        for r in range(REGIONS + 1):
            out = {}
            if r < REGIONS:
                out[f(name, r)] = 1.0
            if r > 0:
                out[f(name, r - 1)] = -1.0
            step({axis: 1.0}, r * REGION_PATCHES / GRID, 150.0, out)
    linear(icx, {f("I_CX"): 1.0})
    linear(icy, {f("I_CY"): 1.0})
    linear(iox, {f("I_OX"): 1.0})
    linear(ioy, {f("I_OY"): 1.0})
    # |own position|^2, piecewise linear through knots k / GRID (exact at the knots; patch centres sit at
    # half-knots, error 1 / (4 GRID^2), the same for every patch)
    for axis in (iox, ioy):
        for k in range(GRID + 1):
            slope_inc = (1.0 if k == 0 else 2.0) / GRID
            relu(axis, k / GRID, {f("I_R2"): slope_inc})
    b2[f("CONST")] = CONST


# ------------------------------------------------------------------------------------------------
# the language model

# layer 0: which word classes each offset writes where (offset: [(source field, destination field)])
GATHER = {
    1: [("W_SHP", "K_SHP"), ("W_DIG+", "K_CLM"), ("W_COL", "P_COL"), ("W_THERE", "T_THERE"),
        ("W_IMAGE", "T_IMAGE"), ("W_OBJECT", "T_OBJ"), ("W_RIGHT", "T_LR"), ("W_BOTTOM", "T_TB"),
        ("W_ASSIST", "T_START")],
    2: [("W_COL", "K_COL"), ("W_COLUMN", "T_COLUMN"), ("W_LET", "L"), ("W_ASSIST", "T_AFTER1")],
    3: [("W_DIG+", "K_ROW"), ("W_DIRECTLY", "T_MMB")],
    4: [("W_COLORW", "T_COLORW"), ("W_COL", "K_COL"), ("W_SHP", "K_SHP"), ("W_ABOVE", "T_ABOVE")],
    5: [("W_COL", "K_COL"), ("W_SHP", "K2_SHP"), ("W_LEFT", "T_LEFT"), ("W_NEAREST", "T_NEAR")],
    6: [("W_COL", "K2_COL"), ("W_SHP", "K2_SHP")],
    7: [("W_COL", "K2_COL")],
}  # fmt: skip


def _fields_of(name: str) -> list[int]:
    if name == "W_DIG+":  # the digits 1..6 (region numbers)
        return [f("W_DIG", n) for n in range(1, DIGITS)]
    s = LAYOUT[name]
    return list(range(s.start, s.stop))


@torch.no_grad()
def set_language_model(model, tokenizer, gate: float = 20.0, word: float = 10.0) -> None:
    check_model(model)
    lm = model.model.language_model
    for p in lm.parameters():
        p.zero_()
    model.lm_head.weight.zero_()
    set_embeddings(model, tokenizer)
    for layer in lm.layers:
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    lm.norm.weight.fill_(1.0)
    L = lm.layers
    cst = f("CONST")

    # -- layer 0: positional gathering ------------------------------------------------------------
    a = Attn(L[0])
    amp = math.sqrt(260.0)
    vfields = sorted({i for offs in GATHER.values() for src, _ in offs for i in _fields_of(src)})
    for kv in range(KV_HEADS):
        for j in FAST:
            a.krow(kv, j)[cst] = amp / C
            a.krow(kv, j)[f("IS_BOS")] = -amp / U  # BOS has no positional key: it is only ever a sink
        vmap = a.values(kv, vfields, 1.0 / U)
    for off, routes in GATHER.items():
        h = off - 1
        a.q[h * HEAD_DIM : (h + 1) * HEAD_DIM, cst] = _rope_query(off, amp / C)
        for src, dst in routes:
            for si, di in zip(_fields_of(src), _fields_of(dst), strict=True):
                a.route(h, vmap[si], di)

    m = MLP(L[0])
    # image tokens: the colour is the argmax (all 8 votes); a member has one
    for c in range(NC):
        m.step({f("I_CW", c): 1.0}, 1.0 - 0.5 / NC, {f("I_COL", c): 1.0, f("I_MEM"): 1.0}, 20.0 * NC)
    # a hint's closing "." (a digit just before it): IS_DOT + K_CLM > 1.5
    m.step({f("IS_DOT"): 1.0, **{i: 1.0 for i in _fields_of("K_CLM")}}, 1.5, {f("HINT"): 1.0}, 20.0)
    # the conjunction of a colour word and the shape word after it
    for c in range(NC):
        for s in range(NS):
            m.step({f("P_COL", c): 1.0, f("W_SHP", s): 1.0}, 1.5, {f("W_CONJ", conj(c, s)): 1.0}, 20.0)

    # -- layer 1: copy the latest question's keys; sum the named conjunctions -----------------------
    a = Attn(L[1])
    beta1 = 20.0
    a.content(0, [({cst: beta1 / C}, {f("IS_Q"): 6.0 / U, f("HINT"): 8.0 / U})])
    a.recency([0], slope=1.4)
    copied = [i for name, _ in KEY_FIELDS for i in _fields_of(name)] + [f(t) for t in TYPE_FLAGS]
    vmap = a.values(0, copied)
    for i in copied:
        a.route(0, vmap[i], i)
    # LISTED: BOS scores ln(1000), a conjunction token 0, every other token -30; the value (x 1000) is then
    # ~1 per named object whatever their number (<= 12)
    a.content(
        2,
        [({cst: 1.0 / C}, {cst: -30.0 / C, f("IS_BOS"): (30.0 + math.log(1000.0)) / U,
                            **{i: 30.0 / U for i in _fields_of("W_CONJ")}})],
    )  # fmt: skip
    vmap = a.values(1, _fields_of("W_CONJ"), 1000.0 / U)
    for si, di in zip(_fields_of("W_CONJ"), _fields_of("LISTED"), strict=True):
        a.route(2, vmap[si], di)

    # image tokens: the colours of the patches to the left (offset 1), upper right (GRID - 1), above (GRID)
    # and upper left (GRID + 1) in the raster order of the image tokens. A patch of the first row has no
    # patch above: the BOS token (value 0, no positional key) scores between the right offset's peak (195
    # logits) and the next best (175), so it wins only when the offset is missing
    nbr_sink = 185.0
    for kv, heads in (
        (2, ((4, GRID - 1, "N_AR"), (5, GRID + 1, "N_AL"))),
        (3, ((6, 1, "N_L"), (7, GRID, "N_A"))),
    ):
        for j in FAST:
            a.krow(kv, j)[cst] = amp / C
            a.krow(kv, j)[f("IS_BOS")] = -amp / U
        first = True
        for h, off, _ in heads:
            a.q[h * HEAD_DIM : (h + 1) * HEAD_DIM, cst] = _rope_query(off, amp / C)
            a.content(h, [({cst: nbr_sink / C}, {f("IS_BOS"): 1.0 / U} if first else {})])
            first = False
        vmap = a.values(kv, _fields_of("I_COL"))
        for h, _, dst in heads:
            for si, di in zip(_fields_of("I_COL"), _fields_of(dst), strict=True):
                a.route(h, vmap[si], di)

    m = MLP(L[1])
    # an object's first patch (its anchor, one per object of every shape and size the scenes draw): a
    # patch of colour c whose left, upper-left, upper and upper-right neighbours are not
    # (weights -1 and threshold 0.5: a half-sure neighbour either is the first patch itself or lets this
    # one be, so an object at the edge of the read-out is counted once, not zero times)
    nbrs = ("N_L", "N_A", "N_AR", "N_AL")
    for c in range(NC):
        m.step({f("I_COL", c): 1.0, **{f(n, c): -1.0 for n in nbrs}}, 0.5, {f("I_ACOL", c): 1.0}, 20.0)
    # image tokens: the colour-shape conjunction (the list head's key)
    for c in range(NC):
        for s in range(NS):
            m.step({f("I_COL", c): 1.0, f("I_SHP", s): 1.0}, 1.5, {f("I_CONJ", conj(c, s)): 1.0}, 20.0)
    lst = {f("T_LR"): 1.0, f("T_TB"): 1.0}
    mmb = -2.0
    start = f("T_START")
    m.step({start: 1.0, f("T_COLORW"): 1.0, f("T_COLUMN"): 1.0, f("T_NEAR"): 1.0, **lst, f("T_MMB"): mmb},
           1.5, {f("C_COL"): 1.0}, 20.0)  # fmt: skip
    m.step({f("IS_COMMA"): 1.0, **lst}, 1.5, {f("C_COL"): 1.0}, 20.0)
    m.step({start: 1.0, f("T_OBJ"): 1.0, f("T_MMB"): mmb}, 1.5, {f("C_SHP"): 1.0}, 20.0)
    m.step({**{i: 1.0 for i in _fields_of("W_COL")}, **lst, start: -2.0}, 1.5, {f("C_SHP"): 1.0}, 20.0)
    m.step({start: 1.0, f("T_THERE"): 1.0, f("T_MMB"): mmb}, 1.5, {f("C_DIG"): 1.0}, 20.0)
    m.step({start: 1.0, f("T_IMAGE"): 1.0, f("T_LEFT"): 1.0, f("T_ABOVE"): 1.0, f("T_MMB"): mmb},
           1.5, {f("C_YN"): 1.0}, 20.0)  # fmt: skip
    m.step({start: 1.0, f("T_MMB"): 1.0}, 1.5, {f("C_LET"): 1.0}, 20.0)
    m.step({f("T_AFTER1"): 1.0, f("T_LR"): -1.0, f("T_TB"): -1.0}, 0.5, {f("C_EOS"): 1.0}, 20.0)
    m.step({**{i: 1.0 for i in _fields_of("W_SHP")}, **lst}, 1.5, {f("C_CE"): 1.0}, 20.0)

    # -- layer 2: retrieval ------------------------------------------------------------------------
    a = Attn(L[2])
    b = 24.0  # logits of one unit key match
    bos = f("IS_BOS")
    col_match = [({f("K_COL", c): b / U}, {f("I_COL", c): 1.0 / U}) for c in range(NC)]
    shp_match = [({f("K_SHP", s): b / U}, {f("I_SHP", s): 1.0 / U}) for s in range(NS)]
    # the sink: 0.75 of a match per key, so one key needs one match and two keys both; ln 1.5 more, so that
    # "is there" needs two matching patches (one mislabelled patch does not make an object)
    sink1 = (
        {**{i: 0.75 * b / U for i in _fields_of("K_COL") + _fields_of("K_SHP")}, cst: math.log(1.5) / C},
        {bos: 1.0 / U},
    )
    common = ({}, {cst: 0.5 / C})  # a key direction every token shares (no query reads it)
    a.content(0, [*col_match, *shp_match, sink1, common])
    col2 = [({f("K2_COL", c): b / U}, {}) for c in range(NC)]
    shp2 = [({f("K2_SHP", s): b / U}, {}) for s in range(NS)]
    sink2 = ({**{i: 0.75 * b / U for i in _fields_of("K2_COL") + _fields_of("K2_SHP")}}, {})
    a.content(1, [*col2, *shp2, sink2])  # the same key dimensions as head 0 (KV head 0)
    vmap = a.values(0, [*_fields_of("I_COL"), *_fields_of("I_SHP"), f("I_OX"), f("I_OY"), bos])
    for si, di in zip(_fields_of("I_COL"), _fields_of("E1_COL"), strict=True):
        a.route(0, vmap[si], di)
    for si, di in zip(_fields_of("I_SHP"), _fields_of("E1_SHP"), strict=True):
        a.route(0, vmap[si], di)
    a.route(0, vmap[f("I_OX")], f("O2X"))
    a.route(0, vmap[f("I_OY")], f("O2Y"))
    a.route(0, vmap[bos], f("SINK1"))
    a.route(1, vmap[f("I_OX")], f("O1X"))
    a.route(1, vmap[f("I_OY")], f("O1Y"))
    # KV head 1: the region (head 2) and the anchors' colours (head 3)
    reg = [({f("K_ROW", r): b / U}, {f("I_RROW", r): 1.0 / U}) for r in range(REGIONS)]
    reg += [({f("K_CLM", r): b / U}, {f("I_RCOL", r): 1.0 / U}) for r in range(REGIONS)]
    sink3 = ({cst: 1.5 * b / C}, {bos: 1.0 / U})
    a.content(2, [*reg, sink3, ({}, {cst: 0.5 / C})])
    anc = [({f("K_COL", c): b / U}, {f("I_ACOL", c): 1.0 / U}) for c in range(NC)]
    sink4 = ({i: b / U for i in _fields_of("K_COL")}, {})  # the sink scores like one match
    used = 2 * REGIONS + 2
    a.content(3, [*anc], dims=SLOW_DIMS[used:])
    a.content(3, [sink4], dims=[SLOW_DIMS[2 * REGIONS]])  # shares head 2's sink key dimension
    vmap = a.values(1, [*_fields_of("I_COL"), bos])
    for si, di in zip(_fields_of("I_COL"), _fields_of("E3_COL"), strict=True):
        a.route(2, vmap[si], di)
    a.route(3, vmap[bos], f("SINK4"))
    # KV head 2, head 4: the list. score = 400 [member] - 288 ox (or oy) - 3000 [its colour and shape named
    # already]; the sink 82. A patch whose shape read-out is unsure keeps enough of its object's
    # conjunction to be excluded with it
    lam, big, bmem, s0 = 288.0, 3000.0, 400.0, 82.0
    terms = [
        ({i: -big / U}, {j: 1.0 / U}) for i, j in zip(_fields_of("LISTED"), _fields_of("I_CONJ"), strict=True)
    ]
    terms += [({f("T_LR"): -lam / U}, {f("I_OX"): 1.0 / U}), ({f("T_TB"): -lam / U}, {f("I_OY"): 1.0 / U})]
    terms += [({cst: bmem / C}, {f("I_MEM"): 1.0 / U}), ({cst: s0 / C}, {bos: 1.0 / U})]
    a.content(4, terms)
    vmap = a.values(2, [*_fields_of("I_COL"), *_fields_of("I_SHP"), bos])
    for si, di in zip(_fields_of("I_COL"), _fields_of("EL_COL"), strict=True):
        a.route(4, vmap[si], di)
    for si, di in zip(_fields_of("I_SHP"), _fields_of("EL_SHP"), strict=True):
        a.route(4, vmap[si], di)
    a.route(4, vmap[bos], f("LEND"))

    m = MLP(L[2])
    # the sink's share 1 / (n + 1) -> one-hot digit n (for counting questions: x T_THERE)
    shares = [1.0 / (n + 1) for n in range(COUNT_MAX + 2)]
    mids = [(shares[n] + shares[n + 1]) / 2 for n in range(COUNT_MAX + 1)]
    # step_n = [share > mid_n] = [count <= n]; one-hot(n) = step_n - step_{n-1}
    for n, mid in enumerate(mids[:COUNT_MAX]):
        out = {f("EV_DIG", n): 1.0}
        if n + 1 <= COUNT_MAX:
            out[f("EV_DIG", n + 1)] = -1.0
        m.step({f("SINK4"): 1.0}, mid, out, 2000.0, up=f("T_THERE"))
    m.step({}, -1.0, {f("EV_DIG", COUNT_MAX): 1.0}, 20.0, up=f("T_THERE"))  # the 1 of one-hot(5)
    # yes/no: YSTEP = [left of] T_LEFT + [above] T_ABOVE + [exists] T_IMAGE; answer sign 2 YSTEP - flag
    m.step({f("O2X"): 1.0, f("O1X"): -1.0}, 0.0, {f("YSTEP"): 1.0}, 150.0, up=f("T_LEFT"))
    m.step({f("O2Y"): 1.0, f("O1Y"): -1.0}, 0.0, {f("YSTEP"): 1.0}, 150.0, up=f("T_ABOVE"))
    m.step({f("SINK1"): -1.0}, -0.5, {f("YSTEP"): 1.0}, 40.0, up=f("T_IMAGE"))

    # -- layer 3: the nearest object ----------------------------------------------------------------
    a = Attn(L[3])
    lam_n, big_n = 1000.0, 3000.0
    terms = [
        ({f("O2X"): 2 * lam_n / U}, {f("I_OX"): 1.0 / U}),
        ({f("O2Y"): 2 * lam_n / U}, {f("I_OY"): 1.0 / U}),
    ]
    terms += [({cst: -lam_n / C}, {f("I_R2"): 1.0 / U}), ({cst: 2500.0 / C}, {f("I_MEM"): 1.0 / U})]
    # the named object set aside by its colour and by its shape (a patch whose read-out got one wrong is
    # still set aside; the generator asks only when the answer differs from it in both)
    terms += [
        ({i: -big_n / U}, {j: 1.0 / U}) for i, j in zip(_fields_of("K_COL"), _fields_of("I_COL"), strict=True)
    ]
    terms += [
        ({i: -big_n / U}, {j: 1.0 / U}) for i, j in zip(_fields_of("K_SHP"), _fields_of("I_SHP"), strict=True)
    ]
    a.content(0, terms)
    vmap = a.values(0, _fields_of("I_COL"))
    for si, di in zip(_fields_of("I_COL"), _fields_of("EN_COL"), strict=True):
        a.route(0, vmap[si], di)

    m = MLP(L[3])
    # evidence gated by the question's type: step(flag > 0.5) x evidence
    for src, flags, dst in (
        ("E1_COL", ["T_COLORW"], "EV_COL"),
        ("E3_COL", ["T_COLUMN"], "EV_COL"),
        ("EN_COL", ["T_NEAR"], "EV_COL"),
        ("EL_COL", ["T_LR", "T_TB"], "EV_COL"),
        ("E1_SHP", ["T_OBJ"], "EV_SHP"),
        ("EL_SHP", ["T_LR", "T_TB"], "EV_SHP"),
    ):
        for si, di in zip(_fields_of(src), _fields_of(dst), strict=True):
            m.step({f(x): 1.0 for x in flags}, 0.5, {di: 1.0}, 20.0, up=si)

    # -- layer 4: the option holding the answer (multiple choice) -----------------------------------
    a = Attn(L[4])
    g4 = 16.0
    match = [({f("EV_COL", c): g4 / U}, {f("W_COL", c): 1.0 / U}) for c in range(NC)]
    match += [({f("EV_SHP", s): g4 / U}, {f("W_SHP", s): 1.0 / U}) for s in range(NS)]
    match += [({f("EV_DIG", n): g4 / U}, {f("W_DIG", n): 1.0 / U}) for n in range(DIGITS)]
    yn = {f("YSTEP"): 2 * g4 / U, f("T_IMAGE"): -g4 / U, f("T_LEFT"): -g4 / U, f("T_ABOVE"): -g4 / U}
    match += [(yn, {f("W_YES"): 1.0 / U, f("W_NO"): -1.0 / U})]
    match += [({cst: g4 / C}, {i: 1.0 / U for i in _fields_of("L")})]  # an option word
    a.content(0, match)
    a.recency([0], slope=0.8)
    vmap = a.values(0, _fields_of("L"))
    for si, di in zip(_fields_of("L"), _fields_of("EV_LET"), strict=True):
        a.route(0, vmap[si], di)

    # -- LM head ------------------------------------------------------------------------------------
    W = model.lm_head.weight
    W[:, cst] = -2 * gate / C
    ids = tokenizer.convert_tokens_to_ids

    def row(w: str, ctx: str, evidence: dict[int, float]) -> None:
        r = W[ids(w)]
        r[cst] = -gate / C
        r[f(ctx)] = gate / U
        for i, v in evidence.items():
            r[i] = v / U

    for c, name in enumerate(COLORS):
        row(name, "C_COL", {f("EV_COL", c): word})
    for s, name in enumerate(SHAPES):
        row(name, "C_SHP", {f("EV_SHP", s): word})
    for n in range(COUNT_MAX + 1):
        row(str(n), "C_DIG", {f("EV_DIG", n): word})
    sign = {f("YSTEP"): 2.0, f("T_IMAGE"): -1.0, f("T_LEFT"): -1.0, f("T_ABOVE"): -1.0}
    row("yes", "C_YN", {i: word * v for i, v in sign.items()})
    row("no", "C_YN", {i: -word * v for i, v in sign.items()})
    for i, letter in enumerate(LETTERS):
        row(letter, "C_LET", {f("EV_LET", i): word})
    # "," or "</s>" after an item of a list: by the list head's sink share (none left -> "</s>")
    row(",", "C_CE", {f("LEND"): -2 * word})
    W[ids(","), cst] += word / C
    eos = W[tokenizer.eos_token_id]
    eos[cst] = -gate / C - word / C
    eos[f("C_EOS")] = (gate + word) / U
    eos[f("C_CE")] = gate / U
    eos[f("LEND")] = 2 * word / U


def image_embeddings(t: torch.Tensor) -> torch.Tensor:
    """(B, 576, 7) vision576.targets -> (B, 576, HIDDEN): the image tokens the projector writes when the
    tower's read-out is exact (tests and checks of the language model alone)."""
    code = code_targets(t)
    out = torch.zeros(*t.shape[:-1], HIDDEN)
    out[..., f("CONST")] = CONST
    col, shp = code[..., :NC], code[..., NC : NC + NS]
    out[..., LAYOUT["I_CW"]] = col  # the projector's votes: all for the colour, none for the others
    out[..., LAYOUT["I_SHP"]] = shp
    cx, cy = code[..., NC + NS], code[..., NC + NS + 1]
    for r in range(REGIONS):
        lo, hi = r * REGION_PATCHES / GRID, (r + 1) * REGION_PATCHES / GRID
        out[..., f("I_RROW", r)] = ((cy > lo) & (cy < hi)).float()
        out[..., f("I_RCOL", r)] = ((cx > lo) & (cx < hi)).float()
    out[..., f("I_CX")] = cx
    out[..., f("I_CY")] = cy

    # the projector's piecewise-linear square, exactly
    def sq(x):
        k = torch.clamp(torch.floor(x * GRID), 0, GRID - 1)
        lo, hi = k / GRID, (k + 1) / GRID
        y = lo**2 + (x - lo) * (lo + hi)
        return torch.where(x > 1.0, 1.0 + (x - 1.0) * 2.0, y)

    ox, oy = code[..., NC + NS + 2], code[..., NC + NS + 3]
    out[..., f("I_R2")] = sq(ox) + sq(oy)
    out[..., f("I_OX")] = ox
    out[..., f("I_OY")] = oy
    return out
