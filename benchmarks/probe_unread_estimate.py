"""How well do the unread pages' estimates (`unread_pages`) stand in for the pages a decode step does not
read? Generates each item's answer under a retrieval configuration with `unread_pages` "centroid" or
"scored" (question-agnostic, as the harness runs it) and, at every one-token decode step and layer, compares
with exact attention over the same cache, per query head, three estimates of the unread candidate pages:

- `centroid`: each page's keys' mean plus the log of its token count (a lower bound of its log-mass, by
  Jensen), with its values' plain mean;
- `scored_plain`: the retrieval scorer's own estimate of each page's log-mass (OVAL / LOCKS's low-rank
  record), with the plain mean;
- `scored` (what `unread_pages="scored"` serves; with it in the spec): the same mass, with the values
  weighted by the prompt's last queries' attention (`summaries.attended_value_means`).

Per group of layers: the unread pages' share of the attention (exact, and each estimate's beside the exact
attention over the pages read), the error of the values alone (the unread pages' output with each page's
exact mass and its plain or attended values' mean, relative to the exact), and the error of the whole step's
output (skipping the unread pages, or with each estimate, against exact attention over every slot). The
means are computed exactly here (no int8 rounding): the figures measure the estimators, not the storage.
A diagnostic: it reads every key at every step.

    python benchmarks/probe_unread_estimate.py --task passkey_1k --data train --limit 8 \
        --spec oval:read_bytes_budget=0.25,read_head_budget=shared,read_chunks=dense,unread_pages=scored
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from mm_oval.eval.tasks import get_task, resolve_data
from mm_oval.eval.textgen import generate_text

import mm_oval
from mm_oval.cache import decode, summaries
from mm_oval.config import OvalConfig
from mm_oval.errors import MmOvalError
from mm_oval.files import atomic_write_json

ESTIMATES = ("centroid", "scored_plain", "scored")


def step_errors(
    layer: Any, query: torch.Tensor, pages: torch.Tensor, scaling: float
) -> dict[str, torch.Tensor]:
    """For one step of one layer (batch of one): per query head with unread pages, the exact log-mass and
    share of the unread candidate pages and each estimate's (`ESTIMATES`)."""
    store = layer.store
    P_s = next(iter(layer.summaries.values())).shape[2]
    B, Hq, _, D = query.shape
    H = store.keys.shape[1]
    G = Hq // H
    q = query[:, :, -1].float().reshape(B, H, G, D)
    unread = (store.page_len[..., :P_s] > 0) & ~pages[..., :P_s]
    page = store.slot_page.clamp(min=0)
    full_unread = torch.nn.functional.pad(unread, (0, pages.shape[-1] - P_s))
    slot_unread = store.slot_valid & full_unread.gather(-1, page)
    slot_read = store.slot_valid & pages.gather(-1, page)
    logits = torch.einsum("bhgd,bhld->bhgl", q, store.keys.float()) * scaling
    lse_true = logits.masked_fill(~slot_unread.unsqueeze(2), float("-inf")).logsumexp(-1)
    lse_read = logits.masked_fill(~slot_read.unsqueeze(2), float("-inf")).logsumexp(-1)
    # each page's exact keys' mean (no int8 rounding) and token count
    member = torch.nn.functional.one_hot(page, pages.shape[-1])[
        ..., :P_s
    ].float() * store.slot_valid.unsqueeze(-1)
    n = member.sum(2).clamp(min=1)  # (B, H, P_s)
    k_mean = torch.einsum("bhlp,bhld->bhpd", member, store.keys.float()) / n.unsqueeze(-1)
    values = store.values.float()
    v_mean = torch.einsum("bhlp,bhld->bhpd", member, values) / n.unsqueeze(-1)
    # each estimate: (its pages' logits, its pages' values)
    est = {"centroid": (torch.einsum("bhgd,bhpd->bhgp", q, k_mean) * scaling + n.log().unsqueeze(2), v_mean)}
    policy = layer.owner.retrieval
    v_att = None
    if getattr(policy, "estimates_page_mass", False):
        record = policy.page_log_mass(decode.decode_context(layer, query, scaling)).float()
        est["scored_plain"] = (record, v_mean)
        if layer.value_query is not None:  # the values weighted by the prompt's last queries, exactly
            batch = summaries._page_batch(layer, 0, P_s, summaries.page_width(layer, 0, P_s), layer.slot_src)
            v_att = summaries.attended_value_means(batch.values, batch.keys, batch.mask, layer.value_query)
            est["scored"] = (record, v_att)
    has = torch.isfinite(lse_true)  # heads with an unread page
    out = {"true_lse": lse_true[has], "true_share": torch.sigmoid(lse_true - lse_read)[has]}
    # the unread pages' output (their attention-weighted values, normalised over them): exact; and each
    # page's values' mean weighted by the exact page masses (the error of the values' means alone)
    unread_logits = logits.masked_fill(~slot_unread.unsqueeze(2), float("-inf"))
    o_true = torch.softmax(unread_logits, -1).nan_to_num(0.0) @ values
    page_true = torch.softmax(unread_logits, -1).nan_to_num(0.0) @ member
    norm = o_true.norm(dim=-1).clamp_min(1e-6)
    out["mean_value_err"] = ((page_true @ v_mean - o_true).norm(dim=-1) / norm)[has]
    if v_att is not None:
        out["attended_value_err"] = ((page_true @ v_att - o_true).norm(dim=-1) / norm)[has]
    # the step's whole output: exact over every slot, and skipping the unread pages (the pages read only)
    read_logits = logits.masked_fill(~slot_read.unsqueeze(2), float("-inf"))
    o_read = torch.softmax(read_logits, -1).nan_to_num(0.0) @ values
    share = torch.sigmoid(lse_true - lse_read).unsqueeze(-1)
    o_all = (1 - share) * o_read + share * o_true
    all_norm = o_all.norm(dim=-1).clamp_min(1e-6)
    out["skip_step_err"] = ((o_read - o_all).norm(dim=-1) / all_norm)[has]
    for name, (page_logits, page_values) in est.items():
        page_logits = page_logits.masked_fill(~unread.unsqueeze(2), float("-inf"))
        lse = page_logits.logsumexp(-1)
        out[f"{name}_lse"] = lse[has]
        out[f"{name}_share"] = torch.sigmoid(lse - lse_read)[has]
        o_est = torch.softmax(page_logits, -1).nan_to_num(0.0) @ page_values
        out[f"{name}_out_err"] = ((o_est - o_true).norm(dim=-1) / norm)[has]
        s_est = torch.sigmoid(lse - lse_read).unsqueeze(-1)
        step = (1 - s_est) * o_read + s_est * o_est
        out[f"{name}_step_err"] = ((step - o_all).norm(dim=-1) / all_norm)[has]
    return out


@contextlib.contextmanager
def recorded(rows: dict[int, list[dict[str, torch.Tensor]]]) -> Iterator[None]:
    """While active, each estimate of the unread pages (`decode.add_unread_pages`) also records
    `step_errors` under its layer's index; the step's output is unchanged."""
    add = decode.add_unread_pages

    def add_unread_pages(layer: Any, query: torch.Tensor, pages: torch.Tensor, scaling: float, *rest: Any):
        rows.setdefault(layer.layer_idx, []).append(step_errors(layer, query, pages, scaling))
        return add(layer, query, pages, scaling, *rest)

    decode.add_unread_pages = add_unread_pages
    try:
        yield
    finally:
        decode.add_unread_pages = add


def summarize(rows: dict[int, list[dict[str, torch.Tensor]]], groups: int = 6) -> list[dict[str, Any]]:
    """Per group of consecutive layers and overall: mean true unread share, and per estimate the mean signed
    error of its unread log-mass (estimate - exact) and mean absolute error of its unread share."""
    layers = sorted(rows)
    size = -(-len(layers) // groups)
    spans = [layers[i : i + size] for i in range(0, len(layers), size)] + [layers]
    table = []
    for span in spans:
        cat = {k: torch.cat([r[k] for li in span for r in rows[li]]) for k in rows[span[0]][0]}
        row: dict[str, Any] = {
            "layers": f"{span[0]}-{span[-1]}" if span is not layers else "all",
            "heads_steps": int(cat["true_lse"].numel()),
            "true_share": float(cat["true_share"].mean()),
        }
        row["mean_value_err"] = float(cat["mean_value_err"].mean())
        if "attended_value_err" in cat:
            row["attended_value_err"] = float(cat["attended_value_err"].mean())
        row["skip_step_err"] = float(cat["skip_step_err"].mean())
        for name in ESTIMATES:
            if f"{name}_lse" in cat:
                row[f"{name}_lse_bias"] = float((cat[f"{name}_lse"] - cat["true_lse"]).mean())
                row[f"{name}_share"] = float(cat[f"{name}_share"].mean())
                row[f"{name}_share_abs_err"] = float((cat[f"{name}_share"] - cat["true_share"]).abs().mean())
                row[f"{name}_out_err"] = float(cat[f"{name}_out_err"].mean())
                row[f"{name}_step_err"] = float(cat[f"{name}_step_err"].mean())
        table.append(row)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="passkey_1k")
    ap.add_argument(
        "--data", default="bundled", help="a dev set, or 'train': the generator's training contexts"
    )
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument(
        "--spec",
        default="oval:read_bytes_budget=0.25,read_head_budget=shared,read_chunks=dense,unread_pages=scored",
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    a = ap.parse_args(argv)
    try:
        cfg = OvalConfig.from_spec(a.spec)
        if cfg.unread_pages == "skip":
            raise MmOvalError(f"--spec {a.spec!r}: add unread_pages=centroid or unread_pages=scored")
        from mm_oval.modelfiles import load_model

        task = get_task(a.task)
        if a.data == "train":  # training contexts (the generator's training seed), not a dev set
            from retrieval_layer_budget import training_items

            kind, length = a.task.rsplit("_", 1)
            items = training_items([kind], length, a.limit)[0][1]
        else:
            items = task.load(resolve_data(a.data, task))[: a.limit]
        model, processor = load_model(a.model, device="cpu", dtype="float32")
        rows: dict[int, list] = {}
        scores = []
        with mm_oval.wrapped(model, cfg), recorded(rows):
            for it in items:
                ans, _ = generate_text(model, processor, [it], a.max_new_tokens, compress="context")[0]
                scores.append(task.score([it], {it.id: ans})[task.primary_metric])
    except MmOvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = summarize(rows)
    print(f"{a.task} ({a.data}, {len(items)} items) under {a.spec}: score {sum(scores) / len(scores):.2f}")
    cols = ["layers", "heads_steps", "true_share", "mean_value_err"]
    cols += (
        ["attended_value_err"] * ("attended_value_err" in table[0])
        + ["skip_step_err"]
        + [
            f"{n}_{m}"
            for n in ESTIMATES
            for m in ("lse_bias", "share", "share_abs_err", "out_err", "step_err")
            if f"{n}_{m}" in table[0]
        ]
    )
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in table:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if a.out:
        atomic_write_json(
            a.out, {"spec": a.spec, "task": a.task, "data": a.data, "scores": scores, "table": table}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
