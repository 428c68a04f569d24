"""Kernel benchmark, one entry per op (BENCHES; `--ops` picks some): the sparse paged decode kernel
against dense decode over the whole cache, then page scoring, KVP scoring and compaction.

    python -m mm_oval.kernels.bench                       # CUDA: LLaVA-1.5-7B shapes; CPU: references, small
    python -m mm_oval.kernels.bench --ops kvp compact     # only those ops
    python -m mm_oval.kernels.bench --json out.json       # also write the rows

On CUDA it times, in one run, at LLaVA-1.5-7B's attention shape (32 query = 32 KV heads, head dim 128,
fp16), contexts 1k/4k/16k/32k, batch 1 and 16, reading a fraction 1/16 .. 1 of the pages (16-token
pages, a random choice per head that always includes the open page):
- the Triton sparse paged decode kernel (mm_oval.kernels.sparse_paged_decode);
- dense decode with torch SDPA over the full cache (the baseline the sparse read must beat);
- flash-attn's flash_attn_with_kvcache over the full cache, when flash-attn is installed.
Each row: median time (triton.testing.do_bench, L2 flushed between runs), the bytes that call must read
(K and V of the tokens read, the page table entries, q and out), GB/s and the fraction of the H200's
4.8 TB/s, and the time relative to dense SDPA and to the same kernel reading every page.
A second table times page scoring (LOCKS/OVAL, Quest), KVP scoring (with the bundled agents' extra
features) and compaction at the same shapes. Before timing, on CUDA, every kernel is checked against its
naive.py reference on the device (VERIFY; sparse decode in fp16 and bf16, ragged pages, GQA groups
1/4/8, split and unsplit); the exit status is 1 when one disagrees.

On CPU there is no Triton kernel to time (the interpreter measures Python): it times the PyTorch
references at small shapes in fp32, says so, and leaves the H200 column empty.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from mm_oval.kernels.lowrank_score.record import compact_page_bases

from mm_oval.files import atomic_write_json

H200_BYTES_PER_S = 4.8e12


@dataclass
class Row:
    table: str
    impl: str
    batch: int
    context: int
    fraction: float
    time_us: float
    bytes_read: int
    gbps: float
    of_h200: float | None
    vs_dense: float | None = None
    vs_all_pages: float | None = None


def _time_cuda(fn: Callable[[], object], reps: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")) * 1e-3


def _time_cpu(fn: Callable[[], object], reps: int) -> float:
    """Best of several runs: on a shared CPU the median measures the neighbours as much as the code."""
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _timing(device: torch.device, dtype: torch.dtype) -> tuple[bool, Callable[..., float], int]:
    """(on CUDA, the timer for this device, bytes per element of dtype)."""
    cuda = device.type == "cuda"
    return cuda, _time_cuda if cuda else _time_cpu, torch.finfo(dtype).bits // 8


def _row(table, impl, b, n, f, seconds, nbytes, cuda) -> Row:
    gbps = nbytes / seconds / 1e9
    return Row(
        table,
        impl,
        b,
        n,
        f,
        seconds * 1e6,
        int(nbytes),
        gbps,
        (nbytes / seconds) / H200_BYTES_PER_S if cuda else None,
    )


def random_selection(B, H, num_pages, fraction, device, generator) -> torch.Tensor:
    """(B, H, S) distinct page indices per head: the open (last) page plus random others."""
    S = max(1, round(num_pages * fraction))
    keys = torch.rand(B, H, num_pages - 1, generator=generator).argsort(-1)[..., : S - 1]
    last = torch.full((B, H, 1), num_pages - 1, dtype=keys.dtype)
    return torch.cat([keys, last], -1).to(torch.int32).to(device)


def bench_sparse_decode(args, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """Decode attention, one token per sequence, reading a fraction of the pages."""
    from mm_oval import kernels as K

    cuda, timer, esize = _timing(device, dtype)
    H, Hkv, D, ps = args.heads, args.kv_heads, args.head_dim, args.page_size
    g = torch.Generator().manual_seed(0)
    try:
        from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
    except ImportError:
        flash_attn_with_kvcache = None
    rows: list[Row] = []
    for B in args.batches:
        for N in args.contexts:
            q = torch.randn(B, H, D, generator=g).to(device, dtype)
            k = torch.randn(B, Hkv, N, D, dtype=dtype, device=device)
            v = torch.randn(B, Hkv, N, D, dtype=dtype, device=device)
            start, length = K.paginate(torch.full((B, Hkv), N, device=device), ps)
            P = start.shape[-1]
            qkv_bytes = 2 * B * H * D * esize  # q in, out back
            # dense baselines
            G = H // Hkv
            q4 = q[:, :, None, :]

            def sdpa(q4=q4, k=k, v=v, G=G):
                return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=G > 1)

            dense_bytes = 2 * B * Hkv * N * D * esize + qkv_bytes
            t_dense = timer(sdpa, args.reps)
            dense = _row("decode", "dense SDPA", B, N, 1.0, t_dense, dense_bytes, cuda)
            dense.vs_dense = 1.0
            rows.append(dense)
            if flash_attn_with_kvcache is not None and cuda:
                kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                qf = q[:, None]
                seqlens = torch.full((B,), N, dtype=torch.int32, device=device)

                def flash(qf=qf, kf=kf, vf=vf, seqlens=seqlens):
                    return flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=seqlens)

                t = timer(flash, args.reps)
                r = _row("decode", "flash-attn kvcache", B, N, 1.0, t, dense_bytes, cuda)
                r.vs_dense = t / t_dense
                rows.append(r)
                del kf, vf
            t_all = None
            for f in sorted(args.fractions, reverse=True):
                idx = random_selection(B, Hkv, P, f, device, g)
                tokens = int(K.selected_token_count(length, idx).sum())
                table_bytes = idx.numel() * 4 + 2 * 4 * (idx >= 0).sum().item()
                nbytes = 2 * tokens * D * esize + table_bytes + qkv_bytes

                def sparse(q=q, k=k, v=v, start=start, length=length, idx=idx):
                    return K.sparse_paged_decode(q, k, v, start, length, idx, max_page_len=ps)

                t = timer(sparse, args.reps)
                t_all = t if t_all is None else t_all
                r = _row(
                    "decode",
                    "sparse paged (triton)" if cuda else "sparse paged (torch ref)",
                    B,
                    N,
                    f,
                    t,
                    nbytes,
                    cuda,
                )
                r.vs_dense, r.vs_all_pages = t / t_dense, t / t_all
                rows.append(r)
            del k, v
            if cuda:
                torch.cuda.empty_cache()
    return rows


def _other_shapes(args):
    """(B, N) of the page-scoring, KVP and compaction rows."""
    return [(B, N) for B in args.batches for N in args.other_contexts]


def bench_lowrank_score(args, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """LOCKS / OVAL page scoring of every page (rank 8)."""
    from mm_oval import kernels as K

    cuda, timer, esize = _timing(device, dtype)
    H, Hkv, D, ps, R = args.heads, args.kv_heads, args.head_dim, args.page_size, 8
    rows = []
    for B, N in _other_shapes(args):
        P = N // ps
        q = torch.randn(B, H, D, device=device, dtype=dtype)
        mu = torch.randn(B, Hkv, P, D, device=device, dtype=dtype)
        basis = torch.randn(B, Hkv, P, D, R, device=device, dtype=dtype)
        coef = torch.randn(B, Hkv, P, ps, R, device=device, dtype=dtype)
        plen = torch.full((B, Hkv, P), ps, dtype=torch.int32, device=device)
        n = (mu.numel() + basis.numel() + coef.numel()) * esize + plen.numel() * 4
        t = timer(partial(K.page_score_lowrank, q, mu, basis, coef, plen), args.reps)
        rows.append(_row("pages", f"page score LOCKS/OVAL r={R}", B, N, 1.0, t, n, cuda))
        # the compact record (int4 basis, int8 centroid / coefficients, fp16 scales): the bytes it stores
        rec = compact_page_bases(mu.float(), basis.float(), coef.float())
        n = sum(v.numel() * v.element_size() for v in rec.values()) + plen.numel() * 4
        t = timer(partial(K.page_score_lowrank_compact, q, rec, plen), args.reps)
        rows.append(_row("pages", f"page score LOCKS/OVAL r={R} compact", B, N, 1.0, t, n, cuda))
    return rows


def bench_quest_score(args, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """Quest page scoring of every page."""
    from mm_oval import kernels as K

    cuda, timer, esize = _timing(device, dtype)
    H, Hkv, D, ps = args.heads, args.kv_heads, args.head_dim, args.page_size
    rows = []
    for B, N in _other_shapes(args):
        P = N // ps
        q = torch.randn(B, H, D, device=device, dtype=dtype)
        kmin = torch.randn(B, Hkv, P, D, device=device, dtype=dtype)
        kmax = kmin + 1
        plen = torch.full((B, Hkv, P), ps, dtype=torch.int32, device=device)
        n = 2 * kmin.numel() * esize + plen.numel() * 4
        t = timer(partial(K.page_score_quest, q, kmin, kmax, plen), args.reps)
        rows.append(_row("pages", "page score Quest", B, N, 1.0, t, n, cuda))
    return rows


def bench_compact(args, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """Compaction of a quarter of the tokens after eviction."""
    from mm_oval import kernels as K

    cuda, timer, esize = _timing(device, dtype)
    Hkv, D = args.kv_heads, args.head_dim
    rows = []
    for B, N in _other_shapes(args):
        k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
        v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
        keep_n = N // 4
        index = torch.rand(B, Hkv, N, device=device).argsort(-1)[..., :keep_n].sort(-1).values.to(torch.int32)
        n = 4 * B * Hkv * keep_n * D * esize + index.numel() * 4  # read and write K and V of the kept tokens
        t = timer(partial(K.compact_kv, k, v, index), args.reps)
        rows.append(_row("pages", "compact 1/4 of the tokens", B, N, 0.25, t, n, cuda))
    return rows


def bench_kvp(args, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """KVP scoring of every prompt token, once per layer and request (batch 1), with the paper's agent
    widths and the bundled agents' 24 extra features."""
    from mm_oval import kernels as K

    cuda, timer, esize = _timing(device, dtype)
    Hkv, D = args.kv_heads, args.head_dim
    rows = []
    for B, N in _other_shapes(args):
        if B != 1:
            continue
        k = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
        v = torch.randn(B, Hkv, N, D, device=device, dtype=dtype)
        pos = torch.arange(N, device=device)[None].expand(B, N).contiguous()
        for X in (0, 24):
            w = K.KVPWeights.random(Hkv, D, device=device, extra=X)
            extra = torch.randn(B, N, X, device=device) if X else None
            n = 2 * k.numel() * esize + (B * N * X * 4 if X else 0)
            t = timer(partial(K.kvp_score, k, v, pos, w, extra), args.reps)
            label = f"KVP agents (E=F=256{', 24 extras' if X else ''})"
            rows.append(_row("pages", label, B, N, 1.0, t, n, cuda))
    return rows


BENCHES: dict[str, Callable[..., list[Row]]] = {
    "sparse_decode": bench_sparse_decode,
    "lowrank_score": bench_lowrank_score,
    "quest_score": bench_quest_score,
    "kvp": bench_kvp,
    "compact": bench_compact,
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    f = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), f):
        return float("inf")
    return float((a[f] - b[f]).norm() / b[f].norm().clamp_min(1e-12))


Check = tuple[str, float, float]  # name, relative error, bound


def verify_sparse_decode(device: torch.device, g: torch.Generator) -> list[Check]:
    from mm_oval.kernels.sparse_decode.kernel import sparse_paged_decode_triton
    from mm_oval.kernels.sparse_decode.naive import sparse_paged_decode_naive

    from mm_oval import kernels as K

    checks = []
    for dtype in (torch.float16, torch.bfloat16):
        for B, Hkv, G, N, ps in [
            (2, 32, 1, 4096, 16),
            (3, 8, 4, 1000, 16),
            (1, 4, 8, 300, 1),
            (2, 4, 4, 777, 70),
        ]:
            D = 128
            q = torch.randn(B, Hkv * G, D, generator=g).to(device, dtype)
            k = torch.randn(B, Hkv, N, D, generator=g).to(device, dtype)
            v = torch.randn(B, Hkv, N, D, generator=g).to(device, dtype)
            lengths = torch.randint(N // 2, N + 1, (B, Hkv), generator=g).to(device)
            start, length = K.paginate(lengths, ps)
            idx = random_selection(B, Hkv, start.shape[-1], 1 / 4, device, g)
            idx = torch.where(idx < (length > 0).sum(-1, keepdim=True), idx, -1)
            want = sparse_paged_decode_naive(q, k, v, start, length, idx)
            for splits in (None, 1, 5):
                got = sparse_paged_decode_triton(q, k, v, start, length, idx, num_splits=splits)
                err = max(_rel(got[0], want[0]), _rel(got[1], want[1]))
                checks.append(
                    (f"sparse decode {dtype} B{B} Hkv{Hkv} G{G} N{N} page{ps} splits {splits}", err, 2e-2)
                )
    return checks


def _page_case(device: torch.device, g: torch.Generator):
    B, Hkv, G, D, P, T, R = 2, 32, 1, 128, 256, 16, 8
    q = torch.randn(B, Hkv * G, D, generator=g).to(device, torch.float16)
    mu = torch.randn(B, Hkv, P, D, generator=g).to(device, torch.float16)
    basis = (torch.randn(B, Hkv, P, D, R, generator=g) / 10).to(device, torch.float16)
    coef = torch.randn(B, Hkv, P, T, R, generator=g).to(device, torch.float16)
    plen = torch.randint(0, T + 1, (B, Hkv, P), generator=g).to(device, torch.int32)
    return q, mu, basis, coef, plen


def verify_lowrank_score(device: torch.device, g: torch.Generator) -> list[Check]:
    from mm_oval.kernels.lowrank_score.kernel import (
        page_score_lowrank_compact_triton,
        page_score_lowrank_triton,
    )
    from mm_oval.kernels.lowrank_score.naive import page_score_lowrank_compact_naive, page_score_lowrank_naive

    case = _page_case(device, g)
    q, mu, basis, coef, plen = case
    rec = compact_page_bases(mu.float(), basis.float(), coef.float())
    compact = _rel(
        page_score_lowrank_compact_triton(q, rec, plen), page_score_lowrank_compact_naive(q, rec, plen)
    )
    return [
        (
            "page score LOCKS/OVAL",
            _rel(page_score_lowrank_triton(*case), page_score_lowrank_naive(*case)),
            1e-3,
        ),
        ("page score LOCKS/OVAL compact", compact, 1e-3),
    ]


def verify_quest_score(device: torch.device, g: torch.Generator) -> list[Check]:
    from mm_oval.kernels.quest_score.kernel import page_score_quest_triton
    from mm_oval.kernels.quest_score.naive import page_score_quest_naive

    q, mu, _, _, plen = _page_case(device, g)
    got, want = page_score_quest_triton(q, mu, mu + 1, plen), page_score_quest_naive(q, mu, mu + 1, plen)
    return [("page score Quest", _rel(got, want), 1e-3)]


def verify_kvp(device: torch.device, g: torch.Generator) -> list[Check]:
    from mm_oval.kernels.kvp.kernel import kvp_score_triton
    from mm_oval.kernels.kvp.naive import kvp_score_naive

    from mm_oval import kernels as K

    kk = torch.randn(2, 8, 500, 128, generator=g).to(device, torch.float16)
    vv = torch.randn(2, 8, 500, 128, generator=g).to(device, torch.float16)
    pos = torch.arange(500, device=device)[None].expand(2, 500).contiguous()
    checks = []
    for X in (0, 24):
        w = K.KVPWeights.random(8, 128, generator=g, device=device, extra=X)
        extra = torch.randn(2, 500, X, generator=g).to(device) if X else None
        # tf32 matmuls on the GPU against fp32 ones in the reference
        err = _rel(kvp_score_triton(kk, vv, pos, w, extra), kvp_score_naive(kk, vv, pos, w, extra))
        checks.append((f"KVP scores, {X} extra features", err, 2e-2))
    return checks


def verify_compact(device: torch.device, g: torch.Generator) -> list[Check]:
    from mm_oval.kernels.compact.kernel import compact_kv_triton
    from mm_oval.kernels.compact.naive import compact_kv_naive

    kk = torch.randn(2, 8, 500, 128, generator=g).to(device, torch.float16)
    vv = torch.randn(2, 8, 500, 128, generator=g).to(device, torch.float16)
    index = torch.rand(2, 8, 500, generator=g).argsort(-1)[..., :200].sort(-1).values.to(device, torch.int32)
    got, want = compact_kv_triton(kk, vv, index, 256), compact_kv_naive(kk, vv, index, 256)
    return [("compaction", 0.0 if all(torch.equal(a, b) for a, b in zip(got, want)) else float("inf"), 0.0)]


VERIFY: dict[str, Callable[[torch.device, torch.Generator], list[Check]]] = {
    "sparse_decode": verify_sparse_decode,
    "lowrank_score": verify_lowrank_score,
    "quest_score": verify_quest_score,
    "kvp": verify_kvp,
    "compact": verify_compact,
}


def verify(device: torch.device, ops: list[str]) -> bool:
    """The Triton kernels of `ops` against their references on this device, before timing (CUDA only: on
    CPU the tests do this under the interpreter). Prints one line per check; False when one fails."""
    g = torch.Generator().manual_seed(0)
    checks = [c for op in ops for c in VERIFY[op](device, g)]
    ok = True
    print("\nKernels against their references on this device (relative error, bound)")
    for name, err, bound in checks:
        passed = err <= bound
        ok &= passed
        print(f"  {'ok  ' if passed else 'FAIL'} {name:<70} {err:.2e}  <= {bound:.0e}")
    return ok


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row], title: str, out=sys.stdout) -> None:
    print(f"\n{title}", file=out)
    head = f"{'impl':<34} {'batch':>5} {'context':>7} {'read':>6} {'time us':>10} {'MB read':>9} {'GB/s':>8} {'of 4.8TB/s':>10} {'vs dense':>8} {'vs all pages':>12}"
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        frac = "1" if r.fraction == 1 else f"1/{round(1 / r.fraction)}"
        print(
            f"{r.impl:<34} {r.batch:>5} {r.context:>7} {frac:>6} {r.time_us:>10.1f} {r.bytes_read / 1e6:>9.2f} "
            f"{r.gbps:>8.1f} {_fmt(r.of_h200, '>10.1%')} {_fmt(r.vs_dense, '>8.3f')} {_fmt(r.vs_all_pages, '>12.3f')}",
            file=out,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--other-contexts", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--reps", type=int, default=100, help="CUDA: ms of timed runs per row (CPU: best of 5 runs)"
    )
    ap.add_argument(
        "--ops", nargs="+", choices=sorted(BENCHES), default=list(BENCHES), help="the ops to check and time"
    )
    ap.add_argument(
        "--no-verify", action="store_true", help="CUDA: skip checking the kernels against the references"
    )
    ap.add_argument("--json", type=Path, default=None, help="write every row here too")
    args = ap.parse_args(argv)

    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        dtype = torch.float16
        args.contexts = args.contexts or [1024, 4096, 16384, 32768]
        args.other_contexts = args.other_contexts or [4096, 32768]
        args.batches = args.batches or [1, 16]
        note = f"CUDA ({torch.cuda.get_device_name(device)}): Triton kernels, fp16"
    else:
        dtype = torch.float32
        args.contexts = args.contexts or [1024, 4096]
        args.other_contexts = args.other_contexts or [1024]
        args.batches = args.batches or [1]
        note = (
            "CPU: no GPU here, so this times the PyTorch REFERENCES (fp32, small shapes), not the Triton kernels; "
            "the H200 column is left empty"
        )
    print(f"mm-oval kernel benchmark - {note}")
    print(
        f"heads {args.heads} (KV {args.kv_heads}), head dim {args.head_dim}, pages of {args.page_size} tokens, "
        f"torch {torch.__version__}"
    )
    if use_cuda and not args.no_verify and not verify(device, args.ops):
        print(
            "a kernel disagrees with its reference on this device: timings follow anyway, do not trust them"
        )
        failed = True
    else:
        failed = False
    rows = bench_sparse_decode(args, device, dtype) if "sparse_decode" in args.ops else []
    if rows:
        print_table(
            rows,
            "Decode attention, one token per sequence "
            f"(time: {'median of do_bench' if use_cuda else 'best of 5 runs'}; read = fraction of pages read)",
        )
    others = [r for op in args.ops if op != "sparse_decode" for r in BENCHES[op](args, device, dtype)]
    if others:
        print_table(others, "Page scoring (every page), KVP scoring, compaction")
    if args.json:
        atomic_write_json(
            args.json,
            {
                "note": note,
                "args": {k: v for k, v in vars(args).items() if k != "json"},
                "rows": [asdict(r) for r in rows + others],
            },
        )
        print(f"\nrows written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
