"""Is retrieval's miss the choice of pages or the number of pages? On SmolLM2-135M-Instruct and a bundled
long-context text task, question-agnostic as the harness runs it, this runs OVAL (compact, rank 8) beside an
oracle that reads the same number of pages in the same bytes but picks them by the exact attention the
query pays each page: its records hold the page's keys beside OVAL's own, it is charged only OVAL's record
bytes, and it scores a page by the share of softmax attention the query heads of the KV head pay the
page's keys (the mass router v2's teacher measures), averaged over the group. So the two rows differ only
in which pages are read: what no page scorer that ranks by attention can beat at that page count. A
diagnostic, not a method: the oracle reads every key to score, which no real retrieval can afford, and this
script registers it in its own process only (mm-oval's registry does not hold it).

    python benchmarks/probe_retrieval_oracle.py --task message_1k --ranks 8,2 --out runs/oracle-message
    python benchmarks/probe_retrieval_oracle.py --task duo_1k --compress prompt --limit 20 \
        --sweep-args "--multi-turn 2" --out runs/oracle-duo
    python benchmarks/probe_retrieval_oracle.py --task message_1k --ranks 8,2 --read-head-budget shared \
        --out runs/oracle-message-shared

With `--read-head-budget shared` both read as a layer's KV heads sharing their bytes (OVAL's
`read_head_budget=shared`): one ranking of every head's pages, so the oracle is the best choice by
attention share across the heads too. With `--oracle output` the oracle picks the pages whose omission would
move the head's output most instead (`OutputOraclePages`: a page's attention share times the distance of its
values' attention-weighted mean from the output, to first order that move), at the same records and bytes.

It runs `mm-oval sweep` (the same cells, resumable, with its table in OUT/sweep.md) with the two methods for
each OVAL rank of `--ranks` (the oracle charged that rank's record bytes: a cheaper record reads more pages).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import ClassVar

import torch

from mm_oval.cli import main as mm_oval_main
from mm_oval.measures import exact_page_log_mass, group_mean
from mm_oval.policies.base import DecodeContext, PageBatch
from mm_oval.policies.pagebases import OvalRetrieval
from mm_oval.registry import RETRIEVAL_REGISTRY

KEYS, MASK = "oracle_keys", "oracle_mask"  # the oracle's extra records (not charged, not OVAL's)


@dataclass
class OraclePages(OvalRetrieval):
    """OVAL's records and bytes, pages picked by the exact attention mass (diagnostic only)."""

    name: ClassVar[str] = "oracle_pages"

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        out = dict(super().summarize(pages))
        # every page padded to coef_rows rows, as OVAL's coefficients
        pad = self.coef_rows - pages.keys.shape[-2]
        out[KEYS] = torch.nn.functional.pad(pages.keys, (0, 0, 0, pad))
        out[MASK] = torch.nn.functional.pad(pages.mask, (0, pad))
        return out

    def summary_bytes(self, summaries: dict[str, torch.Tensor], page_len: torch.Tensor) -> torch.Tensor:
        own = {k: v for k, v in summaries.items() if k not in (KEYS, MASK)}
        return super().summary_bytes(own, page_len)

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:
        keys, mask = ctx.summaries[KEYS], ctx.summaries[MASK]  # (B, Hkv, P, T, D), (B, Hkv, P, T)
        # per query row: each query head's share of its softmax on each page (B, Hq, P), group mean (B, Hkv, P)
        shares = [
            group_mean(
                exact_page_log_mass(ctx.query[:, :, i], keys, mask, ctx.scaling).softmax(-1), keys.shape[1]
            )
            for i in range(ctx.query.shape[2])
        ]
        return (torch.stack(shares).mean(0) + 1e-30).log()  # only the ranking matters (select fills by score)


VALUES = "oracle_values"  # the output oracle's values (not charged either)


@dataclass
class OutputOraclePages(OraclePages):
    """OVAL's records and bytes, pages picked by how much leaving each one out would move the head's output
    (diagnostic only): per query head, a page's attention share times the distance of its values'
    attention-weighted mean from the output over every closed page, a_p * |v_p - o| = |sum_t a_t v_t - a_p o|
    (to first order the output's move when the page goes unread and the rest is renormalised), group mean."""

    name: ClassVar[str] = "output_oracle_pages"

    def summarize(self, pages: PageBatch) -> dict[str, torch.Tensor]:
        out = super().summarize(pages)
        out[VALUES] = torch.nn.functional.pad(
            pages.values, (0, 0, 0, self.coef_rows - pages.values.shape[-2])
        )
        return out

    def summary_bytes(self, summaries: dict[str, torch.Tensor], page_len: torch.Tensor) -> torch.Tensor:
        return super().summary_bytes({k: v for k, v in summaries.items() if k != VALUES}, page_len)

    def score_pages(self, ctx: DecodeContext) -> torch.Tensor:
        keys, mask, values = ctx.summaries[KEYS], ctx.summaries[MASK], ctx.summaries[VALUES]
        b, hkv, p, t, d = keys.shape
        moves = []
        for i in range(ctx.query.shape[2]):
            q = ctx.query[:, :, i].float().reshape(b, hkv, -1, d)
            logits = torch.einsum("bhgd,bhptd->bhgpt", q, keys.float()) * ctx.scaling
            logits = logits.masked_fill(~mask.bool()[:, :, None], float("-inf"))
            att = logits.flatten(-2).softmax(-1).view(logits.shape)  # over every closed page's tokens
            part = torch.einsum("bhgpt,bhptd->bhgpd", att, values.float())  # sum_t a_t v_t per page
            share = att.sum(-1, keepdim=True)  # a_p
            move = (part - share * part.sum(-2, keepdim=True)).norm(dim=-1)  # (B, Hkv, G, P)
            moves.append(move.mean(2))
        return (torch.stack(moves).mean(0) + 1e-30).log()


ORACLES = {"attention": OraclePages, "output": OutputOraclePages}


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(
            f"--ranks wants OVAL ranks >= 1, comma-separated (e.g. 8,2), got {text!r}"
        )
    return ranks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="message_1k")
    ap.add_argument("--compress", default="context")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--budgets", default="0.25")
    ap.add_argument("--data", default="bundled")
    ap.add_argument("--sweep-args", default="", help="more `mm-oval sweep` arguments, e.g. '--multi-turn 2'")
    ap.add_argument(
        "--ranks",
        type=_ranks,
        default=[8],
        help="OVAL ranks, comma-separated: each runs OVAL and the oracle charged its bytes",
    )
    ap.add_argument(
        "--read-head-budget",
        choices=("uniform", "shared"),
        default="uniform",
        help="each KV head reads its own bytes (uniform) or a layer's heads share them (shared)",
    )
    ap.add_argument(
        "--oracle",
        choices=tuple(ORACLES),
        default="attention",
        help="pick pages by their exact attention share (attention) or by how far leaving each out moves "
        "the head's output (output)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    oracle = ORACLES[args.oracle]
    RETRIEVAL_REGISTRY[oracle.name] = oracle
    argv = ["sweep", "--model", "smollm2", "--task", args.task, "--compress", args.compress]
    argv += ["--limit", str(args.limit), "--budgets", args.budgets, "--data", args.data, "--out", args.out]
    argv += ["--no-progress", "--batch-size", "10", *shlex.split(args.sweep_args)]
    argv.append("--methods")
    for rank in args.ranks:
        opt = "" if rank == 8 else f",rank={rank}"  # 8: OVAL's default, spelled as the sweeps spell it
        if args.read_head_budget == "shared":
            opt += ",read_head_budget=shared"
        argv += [f"oval:read_bytes_budget{opt}", f"{oracle.name}:read_bytes_budget{opt}"]
    return mm_oval_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
