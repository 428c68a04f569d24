"""Page layout of the kept tokens of one layer: image pages are 2-D patch tiles, text pages runs of
consecutive kept text tokens. Everything is vectorised over (batch, KV head).

The storage of each (b, h) is page-major: the tokens of page 0 (in position order), then page 1, ...
Pages are ordered by their first position, so image tiles sit where their image sits in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import IMAGE, PAD, TEXT


@dataclass
class Layout:
    """Where each kept token goes. L = slots per head (the longest head), P = pages per head (the most)."""

    src: torch.Tensor  # (B, Hkv, L) long: prompt index of the token in each slot, -1 for an empty slot
    slot_page: torch.Tensor  # (B, Hkv, L) long: page of each slot, -1 for an empty slot
    page_start: torch.Tensor  # (B, Hkv, P) long
    page_len: torch.Tensor  # (B, Hkv, P) long, 0 for an empty page slot
    page_kind: torch.Tensor  # (B, Hkv, P) int8: TEXT, IMAGE or PAD
    page_pinned: torch.Tensor  # (B, Hkv, P) bool: holds a sink or recent token (always read)


def _tile_ids(image_rc: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, int]:
    """(B, N) tile of each image token in a grid of h x w tiles per image (garbage elsewhere), and the
    number of tile ids."""
    max_rc = image_rc.clamp(min=0).amax(dim=(0, 1))  # (3,)
    tiles_r = int(max_rc[1]) // h + 1
    tiles_c = int(max_rc[2]) // w + 1
    rc = image_rc.clamp(min=0)
    tile = (rc[..., 0] * tiles_r + rc[..., 1] // h) * tiles_c + rc[..., 2] // w
    return tile, (int(max_rc[0]) + 1) * tiles_r * tiles_c


def fixed_labels(
    keep: torch.Tensor, modality: torch.Tensor, image_rc: torch.Tensor, image_tile: int, text_page_size: int
) -> tuple[torch.Tensor, int]:
    """Fixed pages: every `text_page_size` kept text tokens in position order, image tiles of
    image_tile x image_tile patches of one image. -> (B, Hkv, N) page label of each kept token (-1 for
    the others) and the number of labels."""
    B, H, N = keep.shape
    mod = modality.unsqueeze(1).expand(B, H, N)
    is_img = keep & (mod == IMAGE)
    is_txt = keep & (mod == TEXT)
    text_ord = is_txt.long().cumsum(-1) - 1  # storage order is position order
    n_labels = -(-N // text_page_size)
    label = torch.where(is_txt, text_ord // text_page_size, torch.full_like(text_ord, -1))
    if bool(is_img.any()):
        tile, n_tiles = _tile_ids(image_rc, image_tile, image_tile)
        label = torch.where(is_img, n_labels + tile.unsqueeze(1), label)
        n_labels += n_tiles
    return label, n_labels


def _morton(rc: torch.Tensor) -> torch.Tensor:
    """(..., 2) long (row, col) >= 0 -> (...,) long: the Z-order (Morton) code, row and col bits interleaved
    (row bits the higher of each pair), over as many bits as the largest row or col needs (below 2^31)."""
    code = torch.zeros(rc.shape[:-1], dtype=torch.long, device=rc.device)
    r, c = rc[..., 0], rc[..., 1]
    for b in range(int(rc.max()).bit_length() if rc.numel() else 0):  # 5 for LLaVA-1.5's 24 x 24 grid
        code |= ((c >> b) & 1) << (2 * b)
        code |= ((r >> b) & 1) << (2 * b + 1)
    return code


def kept_labels(
    keep: torch.Tensor, modality: torch.Tensor, image_rc: torch.Tensor, image_tile: int, text_page_size: int
) -> tuple[torch.Tensor, int]:
    """Pages over the kept tokens (`page_sizing="kept"`): text pages as `fixed_labels`; each image's kept
    patches, in Z-order (Morton order) of its grid, cut into runs of image_tile^2 -> (B, Hkv, N) page label
    of each kept token (-1 for the others) and the number of labels.

    After eviction a fixed tile holds only the tokens its head kept (a 4x4 tile about 1.6 at 10% kept),
    while its summary costs what a full tile's does, so a small kept cache spends its read budget on
    summaries. A run of image_tile^2 kept tokens is as full as a tile of the full cache and, Z-order
    keeping neighbours together, spans a compact patch of the image (wider where the head kept fewer
    tokens). With nothing evicted, a power-of-two image_tile and a grid whose sides are multiples of it,
    the runs are exactly the image_tile x image_tile tiles."""
    B, H, N = keep.shape
    mod = modality.unsqueeze(1).expand(B, H, N)
    label, n_labels = fixed_labels(keep & (mod != IMAGE), modality, image_rc, image_tile, text_page_size)
    is_img = keep & (mod == IMAGE)
    if not bool(is_img.any()):
        return label, n_labels
    run = image_tile * image_tile
    rc = image_rc.clamp(min=0)
    n_images = int(rc[..., 0].max()) + 1
    img = rc[..., 0].unsqueeze(1).expand(B, H, N)
    code = _morton(rc[..., 1:3]).unsqueeze(1).expand(B, H, N)
    big = torch.iinfo(torch.long).max
    key = torch.where(is_img, img * (int(code.max()) + 1) + code, big)
    order = key.argsort(dim=-1, stable=True)
    sorted_img = torch.where(is_img.gather(-1, order), img.gather(-1, order), n_images)
    # place of each kept image token among its image's kept tokens: its sorted place minus the number of
    # kept tokens of the images before it
    count = torch.zeros(B, H, n_images + 1, dtype=torch.long, device=keep.device)
    count.scatter_add_(-1, sorted_img, torch.ones_like(sorted_img))
    before = count.cumsum(-1) - count
    place = torch.arange(N, device=keep.device).expand(B, H, N) - before.gather(-1, sorted_img)
    per_image = -(-(int(rc[..., 1].max()) + 1) * (int(rc[..., 2].max()) + 1) // run)  # runs an image can hold
    run_label = n_labels + sorted_img * per_image + place // run
    img_label = torch.empty_like(run_label).scatter_(-1, order, run_label)
    label = torch.where(is_img, img_label, label)
    return label, n_labels + n_images * per_image


@dataclass(frozen=True)
class PageSizing:
    """OVAL's page sizing: pages small where the keys (so the attention a query can give them) vary, large
    where they are uniform, chosen at prefill per layer and KV head from the keys alone (so it does not
    depend on a question the prompt may not hold yet).

    Image pages are the leaves of a binary split of each image's patch grid: the top tiles hold
    `max_tokens` patches (4 x 8 for 32: rows x columns), and a tile is cut in two halves (its wider side)
    while some kept token's squared distance to the tile's mean key exceeds a threshold times the head's
    key spread (the mean squared distance of its kept image keys to their mean); tiles of `min_tokens`
    patches are never cut. A query's logits over an uncut page differ by at most 2 |q| sqrt(threshold x
    spread), so a page is cut where it mixes keys a query can tell apart (an object's edge) and kept
    whole over background or an object's interior. Pages cost their summaries, scanned at every step
    whichever pages are read, so a head gets at most one page per `mean_tokens` kept tokens (what fixed
    pages of that size cost): the threshold rises from `split` until the head fits, so the tiles whose
    keys spread most are the ones cut. Text pages are the same over the run of kept text tokens (spread
    of the text keys): aligned runs of `max_tokens`, halved down to `min_text_tokens`."""

    split: float = 0.05
    max_tokens: int = 32
    min_tokens: int = 16  # smaller image pages lose accuracy at equal bytes on the bundled benchmark
    min_text_tokens: int = 4
    mean_tokens: int = 16

    def image_levels(self) -> list[tuple[int, int]]:
        """Tile shapes (rows, cols) from the largest to the smallest, each nested in the one before."""
        h = w = 1
        while h * w * 2 <= self.max_tokens:
            if w <= h:
                w *= 2
            else:
                h *= 2
        levels = [(h, w)]
        while h * w > max(self.min_tokens, 1):
            if w >= h:
                w //= 2
            else:
                h //= 2
            levels.append((h, w))
        return levels

    def text_levels(self) -> list[int]:
        size = 1
        while size * 2 <= self.max_tokens:
            size *= 2
        levels = [size]
        while size > max(self.min_text_tokens, 1):
            size //= 2
            levels.append(size)
        return levels


def _masked_mean_key(keys: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    m = member.unsqueeze(-1).to(keys.dtype)
    return (keys * m).sum(-2) / m.sum(-2).clamp_min(1.0)  # (B, H, D)


def _tile_dispersion(
    keys: torch.Tensor, member: torch.Tensor, tile: torch.Tensor, n_tiles: int
) -> torch.Tensor:
    """keys (B, H, N, D) fp32, member (B, H, N) bool, tile (B, H, N) long -> (B, H, n_tiles): per tile, the
    largest squared distance of a member to the tile's mean key."""
    B, H, N, D = keys.shape
    t = tile.clamp(min=0)
    m = member.unsqueeze(-1).to(keys.dtype)
    total = keys.new_zeros(B, H, n_tiles, D).scatter_add_(2, t.unsqueeze(-1).expand(B, H, N, D), keys * m)
    count = keys.new_zeros(B, H, n_tiles).scatter_add_(2, t, member.to(keys.dtype))
    mean = total / count.clamp_min(1.0).unsqueeze(-1)
    dist = (keys - mean.gather(2, t.unsqueeze(-1).expand(B, H, N, D))).square().sum(-1)
    return keys.new_zeros(B, H, n_tiles).scatter_reduce_(2, t, dist * member, reduce="amax")


def _present(tokens: torch.Tensor, tile: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """(B, H, N) bool tokens, (B, H, N) tile -> (B, H, n_tiles) bool: the tile holds one of the tokens."""
    out = torch.zeros(*tokens.shape[:2], n_tiles, dtype=torch.long, device=tokens.device)
    return out.scatter_reduce_(2, tile.clamp(min=0), tokens.long(), reduce="amax").bool()


def dynamic_labels(
    keys: torch.Tensor,
    keep: torch.Tensor,
    modality: torch.Tensor,
    image_rc: torch.Tensor,
    sizing: PageSizing,
    head_chunk: int = 4,
) -> tuple[torch.Tensor, int]:
    """OVAL's page sizing (see `PageSizing`): keys (B, Hkv, N, D) of the prompt -> (B, Hkv, N) page label of
    each kept token (-1 for the others) and the number of labels. Each token goes to the largest tile of its
    ancestry that is not cut (or the smallest tile). KV heads go `head_chunk` at a time (the fp32
    temporaries stay below a few copies of `head_chunk` heads' keys)."""
    B, H, N = keep.shape
    if H > head_chunk:
        parts = [
            dynamic_labels(
                keys[:, h : h + head_chunk], keep[:, h : h + head_chunk], modality, image_rc, sizing
            )
            for h in range(0, H, head_chunk)
        ]
        return torch.cat([p[0] for p in parts], 1), parts[0][1]
    k = keys.float()
    mod = modality.unsqueeze(1).expand(B, H, N)
    label = torch.full((B, H, N), -1, dtype=torch.long, device=keep.device)
    offset = 0

    def assign(member: torch.Tensor, tiles: list[tuple[torch.Tensor, int]]) -> None:
        nonlocal label, offset
        for (t, n), accept in zip(tiles, _sized_levels(k, member, tiles, sizing)):
            label = torch.where(accept, offset + t, label)
            offset += n

    is_txt = keep & (mod == TEXT)  # text: aligned runs of the kept text tokens, halved
    text_ord = (is_txt.long().cumsum(-1) - 1).clamp(min=0)
    assign(is_txt, [(text_ord // size, N // size + 1) for size in sizing.text_levels()])
    is_img = keep & (mod == IMAGE)  # image: nested tiles of each image's grid
    if bool(is_img.any()):
        levels = []
        for h, w in sizing.image_levels():
            tile, n_tiles = _tile_ids(image_rc, h, w)
            levels.append((tile.unsqueeze(1).expand(B, H, N), n_tiles))
        assign(is_img, levels)
    return label, offset


def _sized_levels(
    k: torch.Tensor, member: torch.Tensor, tiles: list[tuple[torch.Tensor, int]], sizing: PageSizing
) -> list[torch.Tensor]:
    """Per level of `tiles` (finest last; tile ids (B, H, N) and their count), the `member` tokens that stay
    in that level's tile: a tile is cut when its keys' dispersion, as a share of the head's spread, passes
    the least threshold (per head, at least `sizing.split`) that keeps the head within its pages (one per
    `sizing.mean_tokens` members); the tiles whose keys spread most are cut first. The last level is never
    cut."""
    mu = _masked_mean_key(k, member)
    spread = ((k - mu.unsqueeze(-2)).square().sum(-1) * member).sum(-1) / member.sum(-1).clamp_min(1)
    spread = spread.clamp_min(1e-30).unsqueeze(-1)  # (B, H, 1)
    disp = [_tile_dispersion(k, member, t, n) / spread for t, n in tiles[:-1]]

    def cut(threshold: torch.Tensor):
        """-> per level the tokens that stay in that level's tile, and the page count per head."""
        todo, stays, pages = member, [], 0
        for i, (t, n) in enumerate(tiles):
            if i < len(disp):
                over = disp[i] > threshold.unsqueeze(-1)
                accept = todo & ~over.gather(-1, t.clamp(min=0))
            else:
                accept = todo
            stays.append(accept)
            pages = pages + _present(accept, t, n).sum(-1)
            todo = todo & ~accept
        return stays, pages

    # bisection on the threshold: the page count falls as it grows
    most = -(-member.sum(-1) // sizing.mean_tokens)
    lo = torch.zeros_like(spread[..., 0])
    hi = torch.stack([d.amax(-1) for d in disp], -1).amax(-1) + 1.0 if disp else lo + 1.0
    for _ in range(24):
        mid = (lo + hi) / 2
        fits = cut(mid)[1] <= most
        hi, lo = torch.where(fits, mid, hi), torch.where(fits, lo, mid)
    return cut(hi.clamp_min(sizing.split))[0]


def layout_pages(
    keep: torch.Tensor,
    modality: torch.Tensor,
    positions: torch.Tensor,
    image_rc: torch.Tensor,
    protected: torch.Tensor,
    image_tile: int,
    text_page_size: int,
    labels: tuple[torch.Tensor, int] | None = None,
) -> Layout:
    """keep (B, Hkv, N) bool; modality/positions/protected (B, N); image_rc (B, N, 3). The pages are the
    fixed ones (`fixed_labels`) unless `labels` gives each kept token's page label and the number of
    labels (`dynamic_labels`)."""
    B, H, N = keep.shape
    device = keep.device
    mod = modality.unsqueeze(1).expand(B, H, N)
    if labels is None:
        labels = fixed_labels(keep, modality, image_rc, image_tile, text_page_size)
    label, n_labels = labels
    label = torch.where(keep, label, torch.full_like(label, -1))

    kept = label >= 0
    safe_label = label.clamp(min=0)
    big = torch.iinfo(torch.long).max
    pos = positions.unsqueeze(1).expand(B, H, N).long()
    first_pos = torch.full((B, H, n_labels), big, dtype=torch.long, device=device)
    first_pos.scatter_reduce_(-1, safe_label, torch.where(kept, pos, big), reduce="amin")
    present = first_pos < big
    # page rank of each label: labels ordered by first position; absent labels last
    order = first_pos.argsort(dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n_labels, device=device).expand_as(order))
    n_pages = present.sum(-1)  # (B, H)
    P = max(int(n_pages.max()) if n_pages.numel() else 0, 1)

    tok_page = torch.where(kept, rank.gather(-1, safe_label), torch.full_like(label, -1))
    # storage order: by page, then by position
    key = torch.where(kept, tok_page * (int(pos.max().clamp(min=0)) + 1 + 1) + pos, big)
    n_kept = kept.sum(-1)
    L = max(int(n_kept.max()) if n_kept.numel() else 0, 1)
    src = key.argsort(dim=-1, stable=True)[..., :L]
    slot_ok = torch.arange(L, device=device) < n_kept.unsqueeze(-1)
    src = torch.where(slot_ok, src, torch.full_like(src, -1))
    slot_page = torch.where(slot_ok, tok_page.gather(-1, src.clamp(min=0)), torch.full_like(src, -1))

    page_len = torch.zeros((B, H, P), dtype=torch.long, device=device)
    page_len.scatter_add_(-1, slot_page.clamp(min=0), slot_ok.long())
    page_start = page_len.cumsum(-1) - page_len
    page_kind = torch.full((B, H, P), PAD, dtype=torch.int8, device=device)
    kind_tok = torch.where(kept, mod.long(), torch.full_like(label, -2))
    kind_page = torch.full((B, H, P), -2, dtype=torch.long, device=device)
    kind_page.scatter_reduce_(-1, tok_page.clamp(min=0), kind_tok, reduce="amax")
    page_kind = torch.where(kind_page >= 0, kind_page, torch.full_like(kind_page, PAD)).to(torch.int8)
    prot = (protected.unsqueeze(1).expand(B, H, N) & kept).long()
    pinned = torch.zeros((B, H, P), dtype=torch.long, device=device)
    pinned.scatter_reduce_(-1, tok_page.clamp(min=0), prot, reduce="amax")
    return Layout(src, slot_page, page_start, page_len, page_kind, pinned.bool())


def gather_pages(
    keys: torch.Tensor,
    values: torch.Tensor,
    page_start: torch.Tensor,
    page_len: torch.Tensor,
    pages: slice,
    slot_src: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pad the pages `pages` of every (b, h) into (B, Hkv, P, T, D) keys/values, a (B, Hkv, P, T) mask and,
    when `slot_src` (B, Hkv, L) is given, the prompt index of each page token (-1 past a page's length)."""
    start = page_start[..., pages]
    length = page_len[..., pages]
    T = max(int(length.max()) if length.numel() else 0, 1)
    offs = torch.arange(T, device=keys.device)
    mask = offs < length.unsqueeze(-1)  # (B, H, P, T)
    idx = (start.unsqueeze(-1) + offs).clamp(max=keys.shape[2] - 1)
    idx = torch.where(mask, idx, torch.zeros_like(idx))
    B, H, P, _ = idx.shape
    D = keys.shape[-1]
    flat = idx.reshape(B, H, P * T, 1).expand(B, H, P * T, D)
    k = keys.gather(2, flat).reshape(B, H, P, T, D) * mask.unsqueeze(-1)
    v = values.gather(2, flat).reshape(B, H, P, T, D) * mask.unsqueeze(-1)
    src = None
    if slot_src is not None:
        src = slot_src.gather(2, idx.reshape(B, H, P * T)).reshape(B, H, P, T).masked_fill(~mask, -1)
    return k, v, mask, src
