"""`OvalConfig`: every knob of the wrapped model, validated with messages that say what to do.

Two kinds of knobs, kept apart:
- what is kept after prefill (eviction): `method`, `budget` (image tokens), `text_budget`,
  `eviction_scope` (image and text ranked separately, or together), `head_budget`;
- what is read per decode step (retrieval): `retrieval`, `read_budget` (the fraction of candidate pages)
  or `read_bytes_budget` (the fraction of dense attention's bytes), `read_scope` (which pages are candidates),
  `read_head_budget`, `read_chunks` (whether a forward of several tokens also reads by retrieval),
  `dense_layers` (the first layers read every page), `read_layer_budget` (how the read bytes are divided
  over the layers), `unread_pages` (whether the pages not read enter the attention as their means).
A knob of one kind that the configuration cannot use is refused (a budget with method "full" keeps
everything; a read budget without a retrieval method reads everything), never silently ignored.
`scope` and `retrieval_scope`, the former names of the two scopes, are refused with the new names.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import InitVar, dataclass, field
from typing import Any

from .errors import ConfigError
from .pages import PageSizing
from .registry import (
    EVICTION_REGISTRY,
    RETRIEVAL_REGISTRY,
    check_spec,
    is_retrieval_only,
    load_builtin_policies,
)

EVICTION_SCOPES = ("image", "all")
READ_SCOPES = ("image", "all")
PAGE_SIZINGS = ("fixed", "dynamic", "kept")
DYNAMIC_PAGE_KNOBS = ("page_split", "max_page_tokens", "min_page_tokens", "mean_page_tokens")
HEAD_BUDGETS = ("uniform", "shared")
# how a forward feeding more than one token after the prefill (a later turn, or the question read after a
# compressed context) reads the cache: "retrieval" (every token fed reads by the retrieval policy, within the
# read budget) or "dense" (every page, as Quest's evaluation code does: retrieval at q_len == 1 only)
READ_CHUNKS = ("retrieval", "dense")
# what a decode step does with the candidate pages it does not read: "skip" (left out of its attention) or
# "centroid" (each enters as one token: its keys' mean, weighted by its token count, and its values' mean) or
# "scored" (the same with the retrieval scorer's estimate of its log attention mass in place of the keys' mean)
UNREAD_PAGES = ("skip", "centroid", "scored")
# 4x4 tiles: 16-token image pages, the page size Quest's and LOCKS's authors use, and the smallest at which every
# page summary is at most 15% of the KV it indexes (Quest's float bounds 6.25%, compact LOCKS/OVAL rank 8 9.6%;
# on 2x2 tiles they are 25% and 34%). On LLaVA-1.5's 24x24 grid that is 36 pages per image.
DEFAULT_IMAGE_TILE = 4
RENAMED = {"scope": "eviction_scope", "retrieval_scope": "read_scope"}


def _check_budget(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a fraction in (0, 1] or a positive token count, got {value!r}")
    if isinstance(value, float) and not (0.0 < value <= 1.0):
        raise ConfigError(
            f"{name}={value} is out of range: a float budget is a fraction in (0, 1]; "
            "pass an int for a token count"
        )
    if isinstance(value, int) and value < 1:
        raise ConfigError(f"{name}={value} is out of range: a token-count budget is an int >= 1")


@dataclass
class OvalConfig:
    """What `mm_oval.wrap` does. See docs/wrap.md for the meaning of every field."""

    method: str = "full"
    method_options: dict[str, Any] = field(default_factory=dict)
    budget: float | int = 1.0  # image tokens kept: fraction in (0, 1] or token count
    text_budget: float | int = 1.0  # text tokens kept
    # "image": image and text ranked separately, each within its budget; "all": modality-blind, all prompt
    # tokens ranked together at the same total count
    eviction_scope: str = "image"
    # "uniform": every KV head keeps the same count; "shared": a layer's heads share Hkv x that count, ranked
    # jointly on the method's scores (AdaKV with alpha_safeguard 0; the method must declare its scores
    # comparable across heads, see mm_oval/policies/budgets.py)
    head_budget: str = "uniform"
    sink_tokens: int = 4
    recent_tokens: int = 16
    retrieval: str | None = None
    retrieval_options: dict[str, Any] = field(default_factory=dict)
    read_budget: float = 1.0  # fraction of candidate pages read per decode step
    # instead of read_budget: the bytes read per decode step and KV head (summaries scanned, selected and
    # always-read pages' keys and values) as a fraction of dense attention's over the resident cache
    read_bytes_budget: float | None = None
    read_scope: str = "image"  # candidate pages: "image" pages only (text pages always read), or "all"
    # "uniform": each KV head reads within its own read budget; "shared": a layer's KV heads read within the
    # sum of theirs, the best-scoring pages of any head first (the retrieval method must declare its page
    # scores comparable across heads: core.SharedHeads)
    read_head_budget: str = "uniform"
    # "retrieval": a later turn fed at once reads by the retrieval policy too; "dense": it reads every page
    # (only one-token decode steps read by retrieval: Quest's rule); see READ_CHUNKS
    read_chunks: str = "retrieval"
    # the first `dense_layers` layers read every page at every step (Quest's evaluation code reads layers 0
    # and 1 densely, `self.layer_id < 2`); their bytes count as dense reads, so at one read_bytes_budget the
    # whole model reads more than with 0
    dense_layers: int = 0
    # "uniform": every layer reads within the same read budget; else a JSON file of per-layer "weights"
    # fitted for one model: layer l reads within weight_l x the budget (capped at every page), the weights
    # averaging 1 so the total is kept (mm_oval.allocation.read_layer_weights)
    read_layer_budget: str = "uniform"
    # "skip": a decode step attends over the pages it reads only; "centroid": each candidate page it does not
    # read enters the step's attention as one token, its keys' mean with the weight of its token count and its
    # values' mean (both kept per page when it closes and read at each step: counted with the summaries);
    # "scored": the same token with the logit the retrieval scorer's summary estimates for the page's log
    # attention mass (OVAL, LOCKS: its low-rank keys), so only the values' mean is kept and read
    unread_pages: str = "skip"
    # each decode step also computes exact attention to measure the retrieval (stats' retrieval_monitor)
    monitor_retrieval: bool = False
    image_tile: int = DEFAULT_IMAGE_TILE
    text_page_size: int = 16
    # "fixed": image_tile x image_tile image pages and text_page_size text pages; "dynamic": OVAL's page
    # sizing (mm_oval.pages.PageSizing), chosen at prefill per layer and KV head from the keys: pages of
    # min_page_tokens to max_page_tokens tokens, cut while a key lies further from its page's mean key than
    # page_split times the head's key spread, the most spread first, at most one page per mean_page_tokens
    # kept tokens (the summaries' cost of fixed pages that size); generated text goes in text_page_size pages;
    # "kept": image pages of image_tile^2 kept tokens, each image's kept patches cut in Z-order
    # (mm_oval.pages.kept_labels), so pages stay full after eviction (the tiles themselves when none is)
    page_sizing: str = "fixed"
    page_split: float = PageSizing.split
    max_page_tokens: int = PageSizing.max_tokens
    min_page_tokens: int | None = None  # None: PageSizing.min_tokens (16), or max_page_tokens if smaller
    mean_page_tokens: int = PageSizing.mean_tokens
    chunk_size: int = 512
    # the former names of the two scopes: refused with the new ones (not fields: never stored)
    scope: InitVar[Any] = None
    retrieval_scope: InitVar[Any] = None

    def __post_init__(self, scope: Any = None, retrieval_scope: Any = None) -> None:
        _refuse_renamed({"scope": scope, "retrieval_scope": retrieval_scope})
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ConfigError(f"method must be a method name, got {self.method!r}")
        _check_budget("budget", self.budget)
        _check_budget("text_budget", self.text_budget)
        if self.eviction_scope not in EVICTION_SCOPES:
            raise ConfigError(f"eviction_scope={self.eviction_scope!r} is not one of {EVICTION_SCOPES}")
        if self.head_budget not in HEAD_BUDGETS:
            raise ConfigError(f"head_budget={self.head_budget!r} is not one of {HEAD_BUDGETS}")
        if self.read_scope not in READ_SCOPES:
            raise ConfigError(f"read_scope={self.read_scope!r} is not one of {READ_SCOPES}")
        if self.read_head_budget not in HEAD_BUDGETS:
            raise ConfigError(f"read_head_budget={self.read_head_budget!r} is not one of {HEAD_BUDGETS}")
        if self.read_chunks not in READ_CHUNKS:
            raise ConfigError(
                f"read_chunks={self.read_chunks!r} is not one of {READ_CHUNKS}: 'dense' reads every page when "
                "several tokens are fed at once (a later turn), 'retrieval' reads them by the retrieval policy"
            )
        if (
            isinstance(self.dense_layers, bool)
            or not isinstance(self.dense_layers, int)
            or self.dense_layers < 0
        ):
            raise ConfigError(
                f"dense_layers must be a whole number >= 0 (how many of the first layers read every page), got "
                f"{self.dense_layers!r}"
            )
        if not isinstance(self.read_layer_budget, str) or not self.read_layer_budget:
            raise ConfigError(
                f"read_layer_budget must be 'uniform' or a JSON file of fitted per-layer weights, "
                f"got {self.read_layer_budget!r}"
            )
        if self.unread_pages not in UNREAD_PAGES:
            raise ConfigError(
                f"unread_pages={self.unread_pages!r} is not one of {UNREAD_PAGES}: 'centroid' adds each unread "
                "page to a decode step's attention as its keys' and values' means, 'scored' as the scorer's "
                "estimate of its attention mass and its values' mean, 'skip' leaves it out"
            )
        if not isinstance(self.monitor_retrieval, bool):
            raise ConfigError(f"monitor_retrieval must be True or False, got {self.monitor_retrieval!r}")
        for name in ("sink_tokens", "recent_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("image_tile", "text_page_size", "chunk_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        self._check_page_sizing()
        if (
            isinstance(self.read_budget, bool)
            or not isinstance(self.read_budget, (int, float))
            or not (0.0 < float(self.read_budget) <= 1.0)
        ):
            raise ConfigError(f"read_budget={self.read_budget!r} must be a fraction in (0, 1]")
        if self.read_bytes_budget is not None:
            if (
                isinstance(self.read_bytes_budget, bool)
                or not isinstance(self.read_bytes_budget, (int, float))
                or not (0.0 < float(self.read_bytes_budget) <= 1.0)
            ):
                raise ConfigError(
                    f"read_bytes_budget={self.read_bytes_budget!r} must be a fraction of dense bytes in (0, 1]"
                )
            if self.read_budget != 1.0:
                raise ConfigError(
                    f"read_budget={self.read_budget!r} and read_bytes_budget={self.read_bytes_budget!r} are both "
                    "set: a decode step's reads are bounded by pages or by bytes, give one of them"
                )
            self.read_bytes_budget = float(self.read_bytes_budget)
        if not isinstance(self.method_options, dict) or not isinstance(self.retrieval_options, dict):
            raise ConfigError("method_options and retrieval_options must be dicts")
        self._check_methods()
        self._check_combination()
        if self.method != "full":  # a budget shared by the heads needs a scorer whose scores allow it
            check_spec(self.method, self.method_options, self.head_budget)

    def _check_page_sizing(self) -> None:
        if self.page_sizing not in PAGE_SIZINGS:
            raise ConfigError(f"page_sizing={self.page_sizing!r} is not one of {PAGE_SIZINGS}")
        if self.page_sizing in ("fixed", "kept"):
            unused = {
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name in DYNAMIC_PAGE_KNOBS and getattr(self, f.name) != f.default
            }
            if unused:
                items = ", ".join(f"{k}={v!r}" for k, v in unused.items())
                raise ConfigError(f"{items} set with page_sizing={self.page_sizing!r}: they size dynamic "
                                  "pages; set page_sizing='dynamic' too, or leave them out")  # fmt: skip
            return
        if self.image_tile != DEFAULT_IMAGE_TILE:
            raise ConfigError(
                f"image_tile={self.image_tile!r} set with page_sizing='dynamic', which sizes image pages itself "
                "(max_page_tokens, min_page_tokens): leave image_tile out or use page_sizing='fixed'"
            )
        v = self.page_split
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v) >= 0.0:
            raise ConfigError(f"page_split must be a number >= 0 (a share of the key spread), got {v!r}")
        self.page_split = float(v)
        for name in ("max_page_tokens", "min_page_tokens"):
            v = getattr(self, name)
            if v is None and name == "min_page_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 32 or v & (v - 1):
                raise ConfigError(f"{name} must be a power of two from 1 to 32, got {v!r}")
        v = self.mean_page_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"mean_page_tokens must be an int >= 1 (kept tokens per page), got {v!r}")
        if self.min_page_tokens is not None and self.min_page_tokens > self.max_page_tokens:
            raise ConfigError(
                f"min_page_tokens={self.min_page_tokens} is above max_page_tokens={self.max_page_tokens}"
            )

    @property
    def sizing(self) -> PageSizing | None:
        """The dynamic page sizing (None for fixed pages)."""
        if self.page_sizing != "dynamic":
            return None
        return PageSizing(
            split=self.page_split,
            max_tokens=self.max_page_tokens,
            min_tokens=min(PageSizing.min_tokens, self.max_page_tokens)
            if self.min_page_tokens is None
            else self.min_page_tokens,
            min_text_tokens=min(PageSizing.min_text_tokens, self.max_page_tokens),
            mean_tokens=self.mean_page_tokens,
        )

    @property
    def max_page_len(self) -> int:
        """The most tokens a page can hold (the sparse decode kernel's page block)."""
        if self.page_sizing == "dynamic":
            return max(self.max_page_tokens, self.text_page_size)
        return max(self.image_tile**2, self.text_page_size)

    def _check_methods(self) -> None:
        """The method names are registered ones, each of its kind."""
        load_builtin_policies()
        if self.method != "full" and self.method not in EVICTION_REGISTRY:
            if is_retrieval_only(self.method):
                raise ConfigError(
                    f"method={self.method!r} is a retrieval method (it chooses the pages read per decode step, "
                    f"it evicts nothing): set retrieval={self.method!r} and read_budget=..., or write the spec "
                    f"{self.method!r} with OvalConfig.from_spec({self.method!r}, read_budget)"
                )
            known = ", ".join(sorted(["full", *EVICTION_REGISTRY]))
            raise ConfigError(f"unknown eviction method {self.method!r}; known methods: {known}")
        if self.retrieval is not None and (
            not isinstance(self.retrieval, str) or self.retrieval not in RETRIEVAL_REGISTRY
        ):
            known = ", ".join(sorted(RETRIEVAL_REGISTRY))
            raise ConfigError(f"unknown retrieval method {self.retrieval!r}; known methods: {known}")

    def _check_combination(self) -> None:
        """Knobs the configuration cannot use are refused, never ignored."""
        if self.method == "full":
            if self.method_options:
                raise ConfigError("method 'full' takes no options")
            unused = {
                k: getattr(self, k)
                for k, default in (
                    ("budget", 1.0),
                    ("text_budget", 1.0),
                    ("eviction_scope", "image"),
                    ("head_budget", "uniform"),
                )
                if getattr(self, k) != default or (k.endswith("budget") and isinstance(getattr(self, k), int))
            }
            if unused:
                items = ", ".join(f"{k}={v!r}" for k, v in unused.items())
                raise ConfigError(
                    f"{items} set with method 'full', which keeps every token: name an eviction method "
                    "(e.g. method='snapkv'); to read fewer pages per decode step use retrieval=... with read_budget"
                )
        if self.retrieval is None:
            unused = {
                k: getattr(self, k)
                for k, default in (
                    ("read_budget", 1.0),
                    ("read_bytes_budget", None),
                    ("read_scope", "image"),
                    ("read_head_budget", "uniform"),
                    ("read_chunks", "retrieval"),
                    ("dense_layers", 0),
                    ("read_layer_budget", "uniform"),
                    ("unread_pages", "skip"),
                    ("page_sizing", "fixed"),
                    ("monitor_retrieval", False),
                )
                if getattr(self, k) != default
            }
            if self.retrieval_options:
                unused["retrieval_options"] = self.retrieval_options
            if unused:
                items = ", ".join(f"{k}={v!r}" for k, v in unused.items())
                raise ConfigError(
                    f"{items} set without a retrieval method, which reads every page: set retrieval=... "
                    "(e.g. retrieval='oval')"
                )
        elif self.read_head_budget == "shared":
            cls = RETRIEVAL_REGISTRY[self.retrieval]
            if not getattr(cls, "comparable_across_heads", False):
                shared = sorted(
                    k for k, c in RETRIEVAL_REGISTRY.items() if getattr(c, "comparable_across_heads", False)
                )
                raise ConfigError(
                    f"read_head_budget='shared' ranks every KV head's pages together, but {self.retrieval!r} does "
                    "not score pages on one scale across heads: use read_head_budget='uniform' with it, or one of "
                    f"{shared}"
                )

    @property
    def evicts(self) -> bool:
        """False when nothing can be evicted (method full, or both budgets keep everything)."""

        # an int budget is a token count (1 = one token); only the float 1.0 means "keep everything"
        def keeps_all(b: float | int) -> bool:
            return isinstance(b, float) and b == 1.0

        return self.method != "full" and not (keeps_all(self.budget) and keeps_all(self.text_budget))

    def replace(self, **changes: Any) -> OvalConfig:
        _refuse_renamed(changes)
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown OvalConfig field(s) {sorted(unknown)}; known: {field_names()}")
        return dataclasses.replace(self, **changes)

    def for_text_only(self) -> OvalConfig:
        """This configuration on a plain decoder-only LM (no image tokens): `budget` is the share (or count)
        of the context's tokens kept, and every page is a retrieval candidate (the pages are all text). A
        `text_budget` alone means the same; the two given with different values are refused."""
        budget, text_budget = self.budget, self.text_budget
        if budget != 1.0 and text_budget != 1.0 and budget != text_budget:
            raise ConfigError(
                f"a plain language model has one context budget, but budget={budget!r} and "
                f"text_budget={text_budget!r} were both given: give budget alone (the fraction or count of the "
                "context's tokens kept)"
            )
        kept = budget if budget != 1.0 else text_budget
        scope = "all" if self.retrieval else self.read_scope
        return dataclasses.replace(self, budget=kept, text_budget=kept, read_scope=scope)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved(self) -> dict[str, Any]:
        """`to_dict` with each method's options completed by its defaults (rank, summary_format, weights,
        ...): what this configuration does, spelled out, so a record of it (a run's identity) tells two
        configurations apart when a default changes under the same spec string."""
        load_builtin_policies()
        # shallow: options may hold objects given through the Python API (agents, a router), not copied
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["method_options"], d["retrieval_options"] = dict(self.method_options), dict(self.retrieval_options)
        if self.method != "full":
            d["method_options"] = _with_defaults(EVICTION_REGISTRY[self.method], self.method_options)
        if self.retrieval is not None:
            d["retrieval_options"] = _with_defaults(
                RETRIEVAL_REGISTRY[self.retrieval], self.retrieval_options
            )
        return d

    @classmethod
    def from_spec(cls, spec: str, budget: float | int | None = None, **overrides: Any) -> OvalConfig:
        """Parse "name" or "name:key=value,key=value". Keys naming an OvalConfig field set it, keys
        `retrieval.<option>` set an option of the retrieval method (e.g. "kvp:retrieval=oval,
        retrieval.summary_format=compact"); the others are the method's options.

        `budget` (when given) is the spec's budget axis, the one a sweep varies (`budget_field` names it):
        - for an eviction method ("snapkv", "kvp:..."), the image tokens kept: it sets `budget`;
        - for a retrieval method named alone ("oval", "quest", "router"), the whole cache stays resident and
          `budget` is the fraction of candidate pages read per decode step: it sets `read_budget` (a
          fraction in (0, 1]). Such a spec takes no `budget=` key (that is the eviction budget, which a
          retrieval method does not have: write `read_budget=`), and a `read_budget=` key together with
          the `budget` argument is refused (the read budget would be given twice); with the bare key
          `read_bytes_budget` ("oval:read_bytes_budget") the argument sets `read_bytes_budget` instead."""
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"empty method spec {spec!r}; write 'name' or 'name:key=value,...'")
        name, _, rest = spec.strip().partition(":")
        fields: dict[str, Any] = {}
        options: dict[str, Any] = {}
        names = set(field_names())
        bytes_axis = False  # the bare key `read_bytes_budget`: the budget argument is a bytes budget
        for item in filter(None, (p.strip() for p in rest.split(","))):
            if item == "read_bytes_budget":
                bytes_axis = True
                continue
            key, eq, raw = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"bad item {item!r} in method spec {spec!r}; write key=value")
            key = key.strip()
            if key in RENAMED:
                raise ConfigError(
                    f"{key!r} in method spec {spec!r} is now called {RENAMED[key]!r}: write "
                    f"{RENAMED[key]}={raw.strip()} ({_RENAMED_HELP})"
                )
            if key in fields or key in options:
                raise ConfigError(f"{key!r} is given twice in method spec {spec!r}; give each key once")
            if key.startswith("retrieval."):  # an option of the retrieval method (e.g. retrieval.rank=4)
                sub = key[len("retrieval.") :]
                if not sub:
                    raise ConfigError(
                        f"bad item {item!r} in method spec {spec!r}; write retrieval.<option>=value"
                    )
                if sub in fields.get("retrieval_options", {}):
                    raise ConfigError(f"{key!r} is given twice in method spec {spec!r}; give each key once")
                fields.setdefault("retrieval_options", {})[sub] = _parse_value(raw.strip())
                continue
            (fields if key in names else options)[key] = _parse_value(raw.strip())
        name = name.strip()
        retrieval_alone = budget_field(name) == "read_budget"
        if bytes_axis and (budget is None or not retrieval_alone or "read_bytes_budget" in fields):
            raise ConfigError(
                f"method spec {spec!r}: the bare key read_bytes_budget makes the budget argument (a sweep's "
                "--budgets) a bytes budget of a retrieval method named alone (e.g. 'oval:read_bytes_budget' "
                "with budget 0.25); otherwise give it a value: read_bytes_budget=0.25"
            )
        if retrieval_alone:
            # a retrieval method named alone: keep the whole cache resident, read part of it per step
            if "budget" in fields or "text_budget" in fields:
                raise ConfigError(
                    f"method spec {spec!r}: {name!r} is a retrieval method, which evicts nothing, so it has no "
                    f"(text_)budget of kept tokens: write {name}:read_budget=... for the pages read per step, "
                    f"or name an eviction method to evict as well (e.g. 'snapkv:retrieval={name}')"
                )
            fields.setdefault("retrieval", name)
            options_target = fields.setdefault("retrieval_options", {})
            options_target.update(options)
            options = {}
            name = "full"
            if budget is not None:
                if "read_budget" in fields:
                    raise ConfigError(
                        f"method spec {spec!r} sets read_budget and a budget of {budget!r} is given too (for "
                        "a retrieval method the budget is the read budget): give it once"
                    )
                if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
                    raise ConfigError(
                        f"retrieval method {spec!r} takes a read budget in (0, 1], got {budget!r}"
                    )
                fields["read_bytes_budget" if bytes_axis else "read_budget"] = float(budget)
                budget = None
        if budget is not None:
            fields["budget"] = budget
        fields.update(overrides)
        fields.setdefault("method_options", {})
        fields["method_options"] = {**fields["method_options"], **options}
        return cls(method=name, **fields)


_RENAMED_HELP = (
    "eviction_scope: image and text ranked separately or together when tokens are evicted; "
    "read_scope: which pages a retrieval method chooses among"
)


def _with_defaults(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """A policy class's constructor defaults overlaid with the given options."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
    else:
        for p in inspect.signature(cls).parameters.values():
            if p.default is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                out[p.name] = p.default
    return out | dict(options)


def _refuse_renamed(given: dict[str, Any]) -> None:
    for old, new in RENAMED.items():
        if given.get(old) is not None:
            raise ConfigError(
                f"OvalConfig has no {old!r} any more: write {new}={given[old]!r} ({_RENAMED_HELP})"
            )


def budget_field(method: str) -> str:
    """The OvalConfig field a spec's budget axis sets (`from_spec(spec, budget)`, a sweep's `--budgets`):
    "read_budget" for a retrieval method named alone (e.g. "oval"), "read_bytes_budget" for one whose spec
    holds the bare key `read_bytes_budget` (e.g. "oval:read_bytes_budget"), "budget" otherwise."""
    name, _, rest = method.strip().partition(":") if isinstance(method, str) else (method, "", "")
    name = name.strip() if isinstance(name, str) else name
    if not (isinstance(name, str) and is_retrieval_only(name)):
        return "budget"
    bare = {p.strip() for p in rest.split(",")}
    return "read_bytes_budget" if "read_bytes_budget" in bare else "read_budget"


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(OvalConfig)]


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw
