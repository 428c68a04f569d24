"""What mm-oval's scoring adds to the model work it rides on, at LLaVA-1.5-7B's shapes, measured side by side.

    python benchmarks/bench_overhead.py                          # CPU, fp32, 1 thread
    python benchmarks/bench_overhead.py --device cuda --dtype bfloat16 --out overhead.json

One decoder layer of LLaVA-1.5-7B's language model (Vicuna-7B: hidden 4096, 32 heads = 32 KV heads of dim
128, MLP 11008, RoPE), random weights, a prompt of 576 image tokens (24 x 24 patches) + text. Every ratio is
per layer, so it holds for the 32-layer model (whose vision tower, embeddings and LM head only add to the
model's side).

- prefill: the layer's forward over the prompt vs KVP scoring of that layer's 32 KV heads (the committed
  agent shape, proj 64 / hidden 64 with the modality and 2-D features, and the paper's, proj 256 / hidden
  256 without them; and the committed shape followed by the redundancy-aware selection the bundled 576 agents
  use, redundancy 4 and sigma 3, `policies/kvp_select.py`), and vs Expected Attention's scoring of them (its defaults: covariance, value norms,
  512 future positions), from the layer's queries, keys and values as the cache hands them over; and vs
  SnapKV's scoring plus the cache's choice of the kept tokens at a 25% image budget, uniform and with
  PyramidKV's layer schedule or AdaKV's shared head budget (`choose_kept`, the layer taken as the first of 32);
- decode: the layer's forward for one new token over the cached prompt (transformers' DynamicCache) vs each
  retrieval method choosing the pages that layer reads (scoring + top-k at a 25% read budget), Quest, LOCKS
  and OVAL with float and with compact summaries (summary_format="compact", docs/oval.md). The router's
  text state is computed once per step for all layers: it is counted as 1/32 per layer.
- summaries: per method, the bytes of the candidate (image) pages' summaries that scoring reads
  (`summary_bytes`) against the keys and values of those pages, with the KV in --kv-dtype (fp16: LLaVA-1.5's).

Configurations alternate within each repeat (machine load hits them alike); medians are kept.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from mm_oval.files import atomic_write_json
from mm_oval.policies.base import (
    IMAGE,
    TEXT,
    DecodeContext,
    PageBatch,
    PrefillContext,
    RequestState,
    Rope,
    StepState,
    make_eviction,
    make_retrieval,
)
from mm_oval.policies.kvp import KVPAgentConfig, KVPAgents
from mm_oval.policies.kvp_select import RedundancySelection, pair_kernel, redundancy_scores
from mm_oval.policies.router import HybridRouter, RouterConfig, RouterRetrieval

SELECTED = "kvp + redundancy-aware selection (redundancy 4, sigma 3)"
SELECTED_25 = "kvp + selection stopped at a 25% image budget (144 picks)"
LLAVA7B = dict(hidden=4096, heads=32, kv_heads=32, head_dim=128, mlp=11008, layers=32, grid=24)


def build_layer(device, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    s = LLAVA7B
    cfg = LlamaConfig(
        hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        intermediate_size=s["mlp"], num_hidden_layers=1, max_position_embeddings=4096,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    for p in layer.parameters():  # the scale of a trained layer (N(0, 0.02)), not the default init
        torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
    return layer.to(device=device, dtype=dtype).eval(), LlamaRotaryEmbedding(cfg).to(device), cfg


def prompt_layout(n_text: int, device):
    """576 image tokens after a 5-token prefix, then text: positions, modality, (image, row, col)."""
    g = LLAVA7B["grid"]
    n = 5 + g * g + n_text
    mod = torch.full((1, n), TEXT, dtype=torch.long, device=device)
    mod[0, 5 : 5 + g * g] = IMAGE
    rc = torch.full((1, n, 3), -1, dtype=torch.long, device=device)
    idx = torch.arange(g * g, device=device)
    rc[0, 5 : 5 + g * g] = torch.stack([torch.zeros_like(idx), idx // g, idx % g], -1)
    return torch.arange(n, device=device)[None], mod, rc


def pages_of(keys, values, mod, rc, embeds, module, tile: int = 2):
    """Pages as the cache makes them: tile x tile image tiles (2: 144 pages of 4 tokens; 4: 36 of 16) and
    16-token text runs."""
    B, H, N, D = keys.shape
    g = LLAVA7B["grid"]
    label = torch.empty(N, dtype=torch.long)
    img = (mod[0] == IMAGE).cpu()
    r, c = rc[0, :, 1].cpu(), rc[0, :, 2].cpu()
    side = -(-g // tile)  # tiles per row
    n_tiles = side * side
    label[img] = (r[img] // tile) * side + c[img] // tile
    txt_idx = (~img).nonzero().flatten()
    label[txt_idx] = n_tiles + torch.arange(len(txt_idx)) // 16
    P = int(label.max()) + 1
    T = 16
    token_index = torch.full((B, H, P, T), -1, dtype=torch.long)
    fill = torch.zeros(P, dtype=torch.long)
    for i in range(N):
        p = int(label[i])
        token_index[:, :, p, fill[p]] = i
        fill[p] += 1
    token_index = token_index.to(keys.device)
    mask = token_index >= 0
    gi = token_index.clamp(min=0).reshape(B, H, P * T, 1).expand(B, H, P * T, D)
    k = keys.gather(2, gi).reshape(B, H, P, T, D) * mask[..., None]
    v = values.gather(2, gi).reshape(B, H, P, T, D) * mask[..., None]
    kind = torch.where(torch.arange(P) < n_tiles, IMAGE, TEXT).to(torch.int8)
    kind = kind.to(keys.device).expand(B, H, P).contiguous()
    batch = PageBatch(layer_idx=0, keys=k, values=v, mask=mask, kind=kind, first_page=0, module=module,
                      token_index=token_index, request=RequestState(inputs_embeds=embeds))  # fmt: skip
    page_len = mask.sum(-1)
    page_start = page_len.cumsum(-1) - page_len
    return batch, page_start, page_len, kind


KVZIP_REPEAT_TOKENS = 14  # "\n\nRepeat the previous context exactly." + " ASSISTANT:" (LLaVA-1.5's tokenizer)


def kvzip_jobs(layer, cfg, rope, x, pe, g):
    """KVzip's pre-pass for one layer, as `mm_oval.policies.kvzip` runs it: the prompt's forward (into a
    DynamicCache), then the reconstruction forward over [repeat prompt, prompt] on that cache through the Q/K
    capture (`mm_oval.measures.capture_qk`), whose queries and keys score the prompt's keys (SDPA for the
    layer's output). Also the scoring alone. Not counted here: the pre-pass's second run of the vision tower
    and embeddings (the model's side)."""
    from transformers import DynamicCache

    from mm_oval.measures import capture_qk
    from mm_oval.policies.kvzip import _ACTIVE, _Chunk, _score_layer, reconstruction_scores

    s, dev, N = LLAVA7B, x.device, x.shape[1]
    R = N + KVZIP_REPEAT_TOKENS
    xr = (torch.randn(1, R, s["hidden"], generator=g) * 0.5).to(device=dev, dtype=x.dtype)
    per = rope(xr, torch.arange(N, N + R, device=dev)[None])
    causal = torch.arange(N + R, device=dev).view(1, -1) <= (N + torch.arange(R, device=dev)).view(-1, 1)
    mask = causal.view(1, 1, R, N + R)
    every = lambda n: torch.ones(1, n, dtype=torch.bool, device=dev)  # noqa: E731
    chunk = _Chunk(N, every(N + R), every(R), every(N), 512, [torch.zeros(1, s["kv_heads"], N, device=dev)])

    def prepass():
        cache = DynamicCache()
        layer(x, position_embeddings=pe, cache=cache, use_cache=True)
        with capture_qk(cfg, on_layer=_score_layer):
            token = _ACTIVE.set(chunk)
            try:
                layer(xr, attention_mask=mask, position_embeddings=per, cache=cache, use_cache=True)
            finally:
                _ACTIVE.reset(token)

    q = torch.randn(1, s["heads"], R, s["head_dim"], generator=g).to(device=dev, dtype=x.dtype)
    k = torch.randn(1, s["kv_heads"], N + R, s["head_dim"], generator=g).to(device=dev, dtype=x.dtype)

    def scoring():
        reconstruction_scores(q, k, every(N + R), every(R), N, s["head_dim"] ** -0.5, 512)

    return prepass, scoring


def allocation_jobs(q, k, v, pos, mod, rc, scaling):
    """SnapKV's scoring of one layer and the cache's choice of the kept tokens (25% of the image tokens,
    sinks 4, recent 16), for the uniform budget and for PyramidKV / AdaKV over SnapKV."""
    from mm_oval.cache import choose_kept, request_info
    from mm_oval.config import OvalConfig
    from mm_oval.policies.budgets import Allocation

    ids = torch.where(mod == IMAGE, 99, 7)
    info = request_info(ids, None, 99, LLAVA7B["grid"] ** 2, 4, 16)
    ctx = PrefillContext(
        layer_idx=0, keys=k, values=v, queries=q, positions=pos, modality=info.modality, image_rc=rc,
        scaling=scaling,
    )  # fmt: skip
    jobs = {}
    for label, name in (
        ("snapkv", "snapkv"),
        ("pyramidkv (snapkv)", "pyramidkv"),
        ("adakv (snapkv)", "adakv"),
    ):
        pol, cfg = make_eviction(name), OvalConfig(method=name, budget=0.25)
        alloc = Allocation.of(pol)
        jobs[f"{label} scoring + choice"] = lambda p=pol, c=cfg, a=alloc: choose_kept(
            p.score(ctx), info, c, a, 0, LLAVA7B["layers"]
        )
    return jobs


def timer(device):
    def run(fn, reps: int = 1) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    return run


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument(
        "--text-tokens", type=int, default=59, help="prompt text tokens besides the 5-token prefix"
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    ap.add_argument("--read-budget", type=float, default=0.25)
    ap.add_argument(
        "--image-tile",
        type=int,
        default=4,
        choices=[2, 4],
        help="image pages: 2x2 or 4x4 tiles (4: wrap's default)",
    )
    ap.add_argument(
        "--kv-dtype", default="float16", choices=["float32", "float16", "bfloat16"],
        help="dtype of the KV the summaries table counts (and of the keys its float summaries come from)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    clock = timer(device)
    s = LLAVA7B
    layer, rope, cfg = build_layer(device, dtype)
    pos, mod, rc = prompt_layout(args.text_tokens, device)
    N = pos.shape[1]
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(1, N, s["hidden"], generator=g) * 0.5).to(device=device, dtype=dtype)
    pe = rope(x, pos)

    # the layer's K/V of the prompt, as the cache holds them (after RoPE)
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (1, N, s["kv_heads"], s["head_dim"])
    q = attn.q_proj(h).view(1, N, s["heads"], s["head_dim"]).transpose(1, 2)
    k = attn.k_proj(h).view(shape).transpose(1, 2)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *pe)

    agents = {
        "kvp (proj 64, hidden 64, + modality / 2-D features)": KVPAgents(
            KVPAgentConfig(
                num_layers=1, num_kv_heads=s["kv_heads"], head_dim=s["head_dim"], grid_side=s["grid"]
            )
        ),
        "kvp, paper size (proj 256, hidden 256)": KVPAgents(
            KVPAgentConfig(
                num_layers=1,
                num_kv_heads=s["kv_heads"],
                head_dim=s["head_dim"],
                proj=256,
                hidden=256,
                pos_dim=32,
                pos_table=6000,
                extra_features=(),
            )  # fmt: skip
        ),
    }
    agents = {name: a.to(device=device).eval() for name, a in agents.items()}
    kf, vf = k.float(), v.float()
    expected = make_eviction("expected_attention")
    expected_ctx = PrefillContext(
        layer_idx=0, keys=k, values=v, queries=q, positions=pos, modality=mod, image_rc=rc,
        scaling=attn.scaling, module=attn, rope=Rope(rope),
    )  # fmt: skip

    # decode: the prompt cached, one new token
    cache = DynamicCache()
    layer(x, position_embeddings=pe, cache=cache, use_cache=True)
    assert cache.get_seq_length() == N, "the decode step must read the cached prompt"
    x1 = torch.randn(1, 1, s["hidden"], generator=g).to(device=device, dtype=dtype) * 0.5
    pe1 = rope(x1, torch.tensor([[N]], device=device))

    def decode_step():
        layer(x1, position_embeddings=pe1, cache=cache, use_cache=True)
        assert cache.get_seq_length() == N + 1
        cache.crop(-1)  # drop the new token again

    embeds = x.float()
    pages, page_start, page_len, kind = pages_of(kf, vf, mod, rc, embeds, attn, args.image_tile)
    cand = (kind == IMAGE) & (page_len > 0)
    query1 = attn.q_proj(layer.input_layernorm(x1)).view(1, 1, s["heads"], s["head_dim"]).transpose(1, 2)
    router = HybridRouter(
        RouterConfig(hidden_size=s["hidden"], num_layers=s["layers"], num_kv_heads=s["kv_heads"])
    )
    retrieval = {
        # the float records (the rows without "compact"; LOCKS's and OVAL's default is the compact one)
        "quest": make_retrieval("quest", summary_format="float"),
        "locks": make_retrieval("locks", summary_format="float"),
        "oval": make_retrieval("oval", summary_format="float"),
        "oval r=2": make_retrieval("oval", rank=2, summary_format="float"),
        "router": RouterRetrieval(router=router.to(device).eval()),
    }
    compact = ("quest", "locks", "oval", "oval r=2")
    retrieval.update(
        {
            "quest compact": make_retrieval("quest", summary_format="compact"),
            "locks compact": make_retrieval("locks", summary_format="compact"),
            "oval compact": make_retrieval("oval", summary_format="compact"),
            "oval r=2 compact": make_retrieval("oval", rank=2, summary_format="compact"),
        }
    )
    summaries = {name: pol.summarize(pages) for name, pol in retrieval.items()}
    hidden_last = torch.randn(1, s["hidden"], generator=g).to(device)

    def select(name, layer_idx=0, step=None):
        ctx = DecodeContext(
            layer_idx=layer_idx, query=query1.float(), summaries=summaries[name], page_start=page_start,
            page_len=page_len, page_kind=kind, candidates=cand, scaling=attn.scaling, module=attn,
            step=step if step is not None else StepState(last_hidden=hidden_last),
        )  # fmt: skip
        return retrieval[name].select(ctx, args.read_budget)

    def router_step():  # one decode step: the text state once, then every layer
        step = StepState(last_hidden=hidden_last)
        for li in range(s["layers"]):
            select("router", li, step)

    kvzip_prepass, kvzip_scoring = kvzip_jobs(layer, cfg, rope, x, pe, g)
    # KVP with the bundled 576 agents' redundancy-aware selection over its scores (the prompt's pair kernel
    # is computed once per request, not per layer: left out, as the policy keeps it across layers)
    committed = next(iter(agents.values()))
    first_agents = lambda: committed.score_layer(0, kf, vf, pos, mod, rc).log_softmax(-1)  # noqa: E731
    selection = RedundancySelection(redundancy=4.0, sigma=3.0)
    pair = pair_kernel(mod, rc, selection.sigma)
    n_img_25 = -(-(s["grid"] ** 2) // 4)  # a 25% image budget's count per head: the walk stops there
    jobs = {
        "prefill layer": lambda: layer(x, position_embeddings=pe),
        "kvzip pre-pass": kvzip_prepass,
        "kvzip scoring": kvzip_scoring,
        **{name: (lambda a=a: a.score_layer(0, kf, vf, pos, mod, rc)) for name, a in agents.items()},
        SELECTED: lambda: redundancy_scores(first_agents(), kf, mod, rc, selection, pair),
        SELECTED_25: lambda: redundancy_scores(first_agents(), kf, mod, rc, selection, pair, n_img_25),
        "decode layer": decode_step,
        **{
            f"{name} page choice": (lambda n=name: select(n))
            for name in (*compact, *(f"{n} compact" for n in compact))
        },
        "router page choice (a step of 32 layers)": router_step,
    }
    jobs["expected_attention scoring"] = lambda: expected.score(expected_ctx)
    jobs.update(allocation_jobs(q, k, v, pos, mod, rc, attn.scaling))
    for fn in jobs.values():  # warm up
        fn()
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(args.repeats):
        for name, fn in jobs.items():
            times[name].append(clock(fn, 3))
    med = {name: statistics.median(t) for name, t in times.items()}
    med["router page choice (per layer)"] = med.pop("router page choice (a step of 32 layers)") / s["layers"]

    rows = []
    for name in agents:
        rows.append(("prefill", name, med[name], med["prefill layer"]))
    rows.append(("prefill", SELECTED, med[SELECTED], med["prefill layer"]))
    rows.append(("prefill", SELECTED_25, med[SELECTED_25], med["prefill layer"]))
    rows.append(("prefill", "expected_attention", med["expected_attention scoring"], med["prefill layer"]))
    for part, key in (
        ("kvzip pre-pass (prompt + reconstruction, scored)", "kvzip pre-pass"),
        ("kvzip scoring alone (max attention, 512-row blocks)", "kvzip scoring"),
    ):
        rows.append(("prefill", part, med[key], med["prefill layer"]))
    for label in ("snapkv", "pyramidkv (snapkv)", "adakv (snapkv)"):
        rows.append(("prefill", f"{label} scoring + kept-token choice", med[f"{label} scoring + choice"],
                     med["prefill layer"]))  # fmt: skip
    for name in (*compact, *(f"{n} compact" for n in compact), "router"):
        key = f"{name} page choice" + (" (per layer)" if name == "router" else "")
        rows.append(("decode", name, med[key], med["decode layer"]))
    kv_dtype = getattr(torch, args.kv_dtype)
    sized = pages_of(kf.to(kv_dtype), vf.to(kv_dtype), mod, rc, embeds, attn)[0]
    per_token = 2 * s["head_dim"] * torch.finfo(kv_dtype).bits // 8  # keys + values of one token, one KV head
    kv_bytes = int(page_len[cand].sum()) * per_token
    sizes = []
    for name, pol in retrieval.items():
        read = pol.summary_bytes(pol.summarize(sized), page_len)
        sizes.append((name, int(read[cand].sum()), kv_bytes))
    title = (
        f"mm-oval overhead at LLaVA-1.5-7B's layer shape ({args.device}, {args.dtype}, prompt {N} tokens, "
        f"read budget {args.read_budget}, median of {args.repeats})"
    )
    print(title)
    print(f"{'phase':<8} {'part':<52} {'part ms':>9} {'layer ms':>9} {'ratio':>8}")
    for phase, name, part, base in rows:
        print(f"{phase:<8} {name:<52} {1e3 * part:>9.3f} {1e3 * base:>9.3f} {100 * part / base:>7.2f}%")
    n_cand = int(cand.sum())
    print(
        f"\nsummaries scored per decode step and layer: {n_cand // s['kv_heads']} image pages ({args.image_tile}x{args.image_tile} tiles) "
        f"per KV head x {s['kv_heads']} heads, KV in {args.kv_dtype}"
    )
    print(f"{'method':<61} {'summary KB':>10} {'KV KB':>9} {'ratio':>8}")
    for name, read, kv in sizes:
        print(f"{name:<61} {read / 1024:>10.1f} {kv / 1024:>9.1f} {100 * read / kv:>7.2f}%")
    if args.out:
        payload = {
            "title": title,
            "device": args.device,
            "dtype": args.dtype,
            "prompt_tokens": N,
            "median_seconds": med,
            "rows": [
                {"phase": p, "part": n, "part_s": a, "layer_s": b, "ratio": a / b} for p, n, a, b in rows
            ],
            "summary_bytes": [
                {"method": n, "kv_dtype": args.kv_dtype, "summary_bytes": a, "kv_bytes": b, "ratio": a / b}
                for n, a, b in sizes
            ],
        }
        atomic_write_json(args.out, payload, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
