"""KVP agent scoring (Triton): the per-head MLP of every KV head of a layer in one launch.

One program per (batch * head, block of BLOCK_N tokens). The key, value and position branches are
projected and LayerNorm'd, concatenated and sent through Linear -> LayerNorm -> SiLU -> Linear. To keep
registers bounded at the reference widths (E = F = 256), the E-wide projections are never held whole:
a first pass over E-chunks accumulates each row's LayerNorm statistics, a second pass recomputes each
chunk, normalises it and immediately multiplies it into the first MLP layer (split along its input
rows). Agents with extra per-token features (modality, image grid, relative position) add one more
small branch, LN_e(x @ we + be) @ w1x, from the (B, N, X) features shared by the heads. The F-wide
hidden row is held whole (BLOCK_N x F fp32). With the agents' precomputed position table
(`KVPWeights.pos_term`) the position branch is one F-wide row load per token. Reference: naive.py;
weight layout: docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from mm_oval.kernels.common.triton_utils import last_contiguous, program_block

from .naive import LN_EPS, KVPWeights


@triton.jit
def _proj_chunk(x, W, Bias, e0, E, D, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """x (BLOCK_N, BLOCK_D) fp32 @ W[:, e0:e0+BLOCK_E] + bias -> (BLOCK_N, BLOCK_E); W row-major (D, E)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = e0 + tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    w = tl.load(
        W + offs_d[:, None] * E + offs_e[None, :], mask=(offs_d[:, None] < D) & e_mask[None, :], other=0.0
    )
    bias = tl.load(Bias + offs_e, mask=e_mask, other=0.0)
    y = tl.dot(x, w.to(tl.float32)) + bias[None, :]
    return tl.where(e_mask[None, :], y, 0.0)


@triton.jit
def _branch_stats(x, W, Bias, E, D, eps, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    s1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        y = _proj_chunk(x, W, Bias, e0, E, D, BLOCK_D, BLOCK_E)
        s1 += tl.sum(y, 1)
        s2 += tl.sum(y * y, 1)
    mean = s1 / E
    var = tl.maximum(s2 / E - mean * mean, 0.0)
    return mean, 1.0 / tl.sqrt(var + eps)


@triton.jit
def _branch_into_hidden(
    z,
    x,
    W,
    Bias,
    LnW,
    LnB,
    W1,
    row0,
    mean,
    rstd,
    E,
    D,
    F,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    offs_f = tl.arange(0, BLOCK_F)
    f_mask = offs_f < F
    for e0 in range(0, E, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        e_mask = offs_e < E
        y = _proj_chunk(x, W, Bias, e0, E, D, BLOCK_D, BLOCK_E)
        lw = tl.load(LnW + offs_e, mask=e_mask, other=0.0)
        lb = tl.load(LnB + offs_e, mask=e_mask, other=0.0)
        y = (y - mean[:, None]) * rstd[:, None] * lw[None, :] + lb[None, :]
        y = tl.where(e_mask[None, :], y, 0.0)
        w1 = tl.load(
            W1 + (row0 + offs_e)[:, None] * F + offs_f[None, :],
            mask=e_mask[:, None] & f_mask[None, :],
            other=0.0,
        )
        z += tl.dot(y, w1.to(tl.float32))
    return z


@triton.jit
def _kvp_kernel(
    KEYS,
    VALS,
    POS,
    WK,
    BK,
    LNKW,
    LNKB,
    WV,
    BV,
    LNVW,
    LNVB,
    PEMB,
    LNPW,
    LNPB,
    W1,
    B1,
    LN1W,
    LN1B,
    W2,
    B2,
    EXTRA,
    WE,
    BE,
    LNEW,
    LNEB,
    W1X,
    PT,
    OUT,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_pb,
    stride_xb,
    stride_xn,
    H,
    N,
    D,
    E,
    EP,
    L,
    F,
    X,
    EX,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_EP: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_POS_TABLE: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_EX: tl.constexpr,
):
    pid_bh, b, h, offs_n = program_block(H, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_EP)
    offs_f = tl.arange(0, BLOCK_F)
    n_mask = offs_n < N
    nd_mask = n_mask[:, None] & (offs_d[None, :] < D)
    p_mask = offs_p < EP
    f_mask = offs_f < F

    x_k = tl.load(
        KEYS + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
        mask=nd_mask,
        other=0.0,
    ).to(tl.float32)
    x_v = tl.load(
        VALS + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
        mask=nd_mask,
        other=0.0,
    ).to(tl.float32)

    h64 = h.to(tl.int64)
    wk = WK + h64 * D * E
    wv = WV + h64 * D * E
    w1 = W1 + h64 * (2 * E + EP) * F

    mean_k, rstd_k = _branch_stats(x_k, wk, BK + h * E, E, D, eps, BLOCK_N, BLOCK_D, BLOCK_E)
    mean_v, rstd_v = _branch_stats(x_v, wv, BV + h * E, E, D, eps, BLOCK_N, BLOCK_D, BLOCK_E)

    z = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
    z = _branch_into_hidden(
        z,
        x_k,
        wk,
        BK + h * E,
        LNKW + h * E,
        LNKB + h * E,
        w1,
        0,
        mean_k,
        rstd_k,
        E,
        D,
        F,
        BLOCK_D,
        BLOCK_E,
        BLOCK_F,
    )
    z = _branch_into_hidden(
        z,
        x_v,
        wv,
        BV + h * E,
        LNVW + h * E,
        LNVB + h * E,
        w1,
        E,
        mean_v,
        rstd_v,
        E,
        D,
        F,
        BLOCK_D,
        BLOCK_E,
        BLOCK_F,
    )

    # position branch: embedding row clamp(p, 0, L - 1), LayerNorm over EP
    pos = tl.load(POS + b * stride_pb + offs_n, mask=n_mask, other=0)
    pos = tl.minimum(tl.maximum(pos, 0), L - 1).to(tl.int64)
    if HAS_POS_TABLE:  # the branch precomputed per table row: one F-wide row per token
        z += tl.load(
            PT + h64 * L * F + pos[:, None] * F + offs_f[None, :],
            mask=n_mask[:, None] & f_mask[None, :],
            other=0.0,
        ).to(tl.float32)
    else:
        ep = tl.load(
            PEMB + h64 * L * EP + pos[:, None] * EP + offs_p[None, :],
            mask=n_mask[:, None] & p_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        mean_p = tl.sum(ep, 1) / EP
        ep_c = tl.where(p_mask[None, :], ep - mean_p[:, None], 0.0)
        rstd_p = 1.0 / tl.sqrt(tl.sum(ep_c * ep_c, 1) / EP + eps)
        lpw = tl.load(LNPW + h * EP + offs_p, mask=p_mask, other=0.0)
        lpb = tl.load(LNPB + h * EP + offs_p, mask=p_mask, other=0.0)
        ep_n = tl.where(p_mask[None, :], ep_c * rstd_p[:, None] * lpw[None, :] + lpb[None, :], 0.0)
        w1p = tl.load(
            w1 + (2 * E + offs_p)[:, None] * F + offs_f[None, :],
            mask=p_mask[:, None] & f_mask[None, :],
            other=0.0,
        )
        z += tl.dot(ep_n, w1p.to(tl.float32))

    if HAS_EXTRA:  # extra features: (BLOCK_N, X) @ we -> LayerNorm over EX -> @ w1x
        offs_x = tl.arange(0, BLOCK_X)
        offs_ex = tl.arange(0, BLOCK_EX)
        x_mask = offs_x < X
        ex_mask = offs_ex < EX
        xe = tl.load(
            EXTRA + b * stride_xb + offs_n[:, None] * stride_xn + offs_x[None, :],
            mask=n_mask[:, None] & x_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        we = tl.load(
            WE + h64 * X * EX + offs_x[:, None] * EX + offs_ex[None, :],
            mask=x_mask[:, None] & ex_mask[None, :],
            other=0.0,
        )
        be = tl.load(BE + h * EX + offs_ex, mask=ex_mask, other=0.0)
        ye = tl.where(ex_mask[None, :], tl.dot(xe, we.to(tl.float32)) + be[None, :], 0.0)
        mean_e = tl.sum(ye, 1) / EX
        ye_c = tl.where(ex_mask[None, :], ye - mean_e[:, None], 0.0)
        rstd_e = 1.0 / tl.sqrt(tl.sum(ye_c * ye_c, 1) / EX + eps)
        lew = tl.load(LNEW + h * EX + offs_ex, mask=ex_mask, other=0.0)
        leb = tl.load(LNEB + h * EX + offs_ex, mask=ex_mask, other=0.0)
        ye_n = tl.where(ex_mask[None, :], ye_c * rstd_e[:, None] * lew[None, :] + leb[None, :], 0.0)
        w1x = tl.load(
            W1X + h64 * EX * F + offs_ex[:, None] * F + offs_f[None, :],
            mask=ex_mask[:, None] & f_mask[None, :],
            other=0.0,
        )
        z += tl.dot(ye_n, w1x.to(tl.float32))

    # Linear bias -> LayerNorm over F -> SiLU -> output layer
    b1 = tl.load(B1 + h * F + offs_f, mask=f_mask, other=0.0)
    z = tl.where(f_mask[None, :], z + b1[None, :], 0.0)
    mean_z = tl.sum(z, 1) / F
    z_c = tl.where(f_mask[None, :], z - mean_z[:, None], 0.0)
    rstd_z = 1.0 / tl.sqrt(tl.sum(z_c * z_c, 1) / F + eps)
    l1w = tl.load(LN1W + h * F + offs_f, mask=f_mask, other=0.0)
    l1b = tl.load(LN1B + h * F + offs_f, mask=f_mask, other=0.0)
    z = z_c * rstd_z[:, None] * l1w[None, :] + l1b[None, :]
    z = z * tl.sigmoid(z)
    w2 = tl.load(W2 + h * F + offs_f, mask=f_mask, other=0.0)
    score = tl.sum(tl.where(f_mask[None, :], z * w2[None, :], 0.0), 1)
    score += tl.load(B2 + h + tl.zeros([BLOCK_N], dtype=tl.int32))
    tl.store(OUT + pid_bh.to(tl.int64) * N + offs_n, score, mask=n_mask)


def kvp_score_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    weights: KVPWeights,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    B, H, N, D = keys.shape
    E, EP, L, F = weights.sizes
    X = weights.extra_width
    w = weights.to(device=keys.device, dtype=torch.float32).contiguous()
    keys = last_contiguous(keys)
    values = last_contiguous(values)
    positions = positions.to(torch.int32).contiguous()
    out = torch.empty((B, H, N), dtype=torch.float32, device=keys.device)
    if N == 0:
        return out
    if X:
        extra = extra.to(torch.float32).contiguous()
        branch = (extra, w.we, w.be, w.lne_w, w.lne_b, w.w1x)
        EX = w.we.shape[2]
    else:  # unused pointers: the branch is compiled out
        branch, EX = (out,) * 6, 0
    pos_table = out if w.pos_term is None else w.pos_term
    BLOCK_F = max(16, triton.next_power_of_2(F))
    BLOCK_N = 32 if BLOCK_F <= 256 else 16
    _kvp_kernel[(B * H, triton.cdiv(N, BLOCK_N))](
        keys,
        values,
        positions,
        w.wk,
        w.bk,
        w.lnk_w,
        w.lnk_b,
        w.wv,
        w.bv,
        w.lnv_w,
        w.lnv_b,
        w.pos_emb,
        w.lnp_w,
        w.lnp_b,
        w.w1,
        w.b1,
        w.ln1_w,
        w.ln1_b,
        w.w2,
        w.b2,
        *branch,
        pos_table,
        out,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        positions.stride(0),
        branch[0].stride(0) if X else 0,
        branch[0].stride(1) if X else 0,
        H,
        N,
        D,
        E,
        EP,
        L,
        F,
        X,
        EX,
        LN_EPS,
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_E=32,
        BLOCK_EP=max(16, triton.next_power_of_2(EP)),
        BLOCK_F=BLOCK_F,
        HAS_EXTRA=bool(X),
        HAS_POS_TABLE=w.pos_term is not None,
        BLOCK_X=max(16, triton.next_power_of_2(max(X, 1))),
        BLOCK_EX=max(16, triton.next_power_of_2(max(EX, 1))),
        num_warps=8,
    )
    return out
