"""What a small image-KV budget keeps of each object on the 576-token tiny LLaVA, per eviction method, in
the heads whose attention reads objects for the answer; and where the KVP training target's attention comes
from. Prints two tables.

    python benchmarks/bench_kvp_coverage576.py --scenes 12 --budgets 0.05 0.1

Held-out scenes (the zoo576 generator's held-out seed, never the dev sets), prompts cut after the image
(`--compress image`). Per (layer, KV head) of `HEADS` and budget: objects with no kept patch, objects with
fewer than 2 (an "is there" question needs two), and the mean distance (patches, |dx| + |dy|) between the
centre of an object's kept patches and the centre of all its patches, over objects with at least one kept
(relations compare centres). Second table: per layer and KV head, the share of the image tokens' future
attention (the KVP utility) that comes from the tokens that produce the answer (the last prompt token and
the answer's) rather than the question's.
"""

from __future__ import annotations

import argparse
import math

import torch

from mm_oval.modelfiles import load_model
from mm_oval.policies.base import IMAGE, make_eviction
from mm_oval.policies.kvp import KVPPolicy
from mm_oval.training import traces as T
from mm_oval.training.kvp import policy_scorer
from mm_oval.zoo.generate576 import TrainSampler576
from mm_oval.zoo.scenes import GRID

HEADS = ((2, 0), (2, 1), (2, 2), (3, 0))  # layer 2's retrieval heads (KV 0-2), layer 3's nearest object


def coverage(keep: set[int], members: list[list[tuple[int, int]]]) -> tuple[int, int, list[float]]:
    none = fewer = 0
    err = []
    for mem in members:
        ids = [r * GRID + c for r, c in mem]
        kept = [p for p in ids if p in keep]
        none += not kept
        fewer += len(kept) < 2
        if kept:
            cx = sum(p % GRID for p in kept) / len(kept) - sum(p % GRID for p in ids) / len(ids)
            cy = sum(p // GRID for p in kept) / len(kept) - sum(p // GRID for p in ids) / len(ids)
            err.append(abs(cx) + abs(cy))
    return none, fewer, err


class _QueryShare(T._Recorder):
    """The capture recorder, also keeping per future query the attention mass on the image tokens."""

    is_image: torch.Tensor  # (prompt tokens,) bool, set on a subclass per sample
    sink: list  # the recorders made for the sample land here

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mass: dict[int, torch.Tensor] = {}
        self.sink.append(self)

    def record(self, module, query, key, value, scaling) -> None:
        super().record(module, query, key, value, scaling)
        n = self.prompt_len
        B, Hq, L, _ = query.shape
        G = Hq // key.shape[1]
        logits = torch.matmul(query[:, :, n:].float(), key.float().repeat_interleave(G, 1).transpose(-1, -2))
        j = torch.arange(n, L)[:, None]
        att = (logits * scaling).masked_fill(torch.arange(L)[None, :] > j, float("-inf")).softmax(-1)
        img = self.is_image[:n]
        mass = att[..., :n][..., img].sum(-1)  # (B, Hq, L - n)
        self.mass[int(module.layer_idx)] = mass.view(B, -1, G, L - n).amax(2)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenes", type=int, default=12)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, processor = load_model("bundled576")
    methods = {
        "kvp (agents' own order)": KVPPolicy(agents="bundled576-image", model=model, redundancy=0),
        "kvp (recorded selection)": KVPPolicy(agents="bundled576-image", model=model),
        "keydiff": make_eviction("keydiff"),
    }
    sampler = TrainSampler576(args.seed + T.ZOO_HELDOUT_SEED_OFFSET)
    samples = T.zoo_samples("heldout", args.scenes, args.seed, 0, 576)
    table: dict[tuple, list] = {}
    share: dict[tuple[int, int], list[float]] = {}
    for i, sample in enumerate(samples):
        members = sampler.item(i, 1).scene.members
        prompt = processor.apply_chat_template(T._conversation(sample, None), add_generation_prompt=True)
        ids = processor(images=sample.images, text=[prompt], return_tensors="pt")["input_ids"][0]
        recorders: list[_QueryShare] = []
        Rec = type("Rec", (_QueryShare,), {"is_image": ids == model.config.image_token_id, "sink": recorders})
        old, T._Recorder = T._Recorder, Rec
        try:
            trace = T.capture_sample(model, processor, sample, compress="image")
        finally:
            T._Recorder = old
        cut = int(trace["positions"].shape[0])
        producing = ids.shape[0] - 1 - cut  # the future's index of the prompt's last token
        for layer, mass in recorders[0].mass.items():
            for h in range(mass.shape[0]):
                d = share.setdefault((layer, h), [0.0, 0.0])
                d[0] += float(mass[h, producing:].sum())
                d[1] += float(mass[h].sum())
        img = (trace["modality"].long() == IMAGE).nonzero()[:, 0]
        for name, policy in methods.items():
            score = policy_scorer(policy)
            for layer, head in HEADS:
                s = score(trace, layer)[head][img]
                for b in args.budgets:
                    keep = set(s.topk(math.ceil(b * img.numel())).indices.tolist())
                    none, fewer, err = coverage(keep, members)
                    d = table.setdefault((name, b, layer, head), [0, 0, 0, []])
                    d[0] += len(members)
                    d[1] += none
                    d[2] += fewer
                    d[3] += err
    print(
        f"{args.scenes} held-out scenes; per head: objects with no kept patch / fewer than 2 / centre error"
    )
    head_names = "".join(f"{f'L{ly} KV{h}':>20}" for ly, h in HEADS)
    print(f"{'method':<26}{'budget':>7}{head_names}")
    for name in methods:
        for b in args.budgets:
            cells = []
            for layer, head in HEADS:
                n, none, fewer, err = table[(name, b, layer, head)]
                cells.append(f"{none:>3}/{fewer:>3} of {n:<3} {sum(err) / max(1, len(err)):>5.2f}")
            print(f"{name:<26}{b:>7.2f}" + "".join(f"{c:>20}" for c in cells))
    print(
        "\nshare of the image tokens' future attention from the answer-producing tokens (the rest: question)"
    )
    for (layer, h), (prod, tot) in sorted(share.items()):
        print(f"layer {layer} KV head {h}: {100 * prod / max(tot, 1e-12):5.1f}%")


if __name__ == "__main__":
    main()
