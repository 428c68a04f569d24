"""`OvalConfig`: every knob of the wrapped model, validated with messages that say what to do."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .registry import check_spec, is_retrieval_only

SCOPES = ("image", "all")
HEAD_BUDGETS = ("uniform", "shared")


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
    scope: str = "image"  # "image": per-modality ranking; "all": modality-blind at the same total count
    # "uniform": every KV head keeps the same count; "shared": a layer's heads share Hkv x that count, ranked
    # jointly on the method's scores (AdaKV with alpha_safeguard 0; the method must declare its scores
    # comparable across heads, see mm_oval/policies/budgets.py)
    head_budget: str = "uniform"
    sink_tokens: int = 4
    recent_tokens: int = 16
    retrieval: str | None = None
    retrieval_options: dict[str, Any] = field(default_factory=dict)
    read_budget: float = 1.0  # fraction of candidate pages read per decode step
    retrieval_scope: str = "image"
    image_tile: int = 2
    text_page_size: int = 16
    chunk_size: int = 512

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ConfigError(f"method must be a method name, got {self.method!r}")
        _check_budget("budget", self.budget)
        _check_budget("text_budget", self.text_budget)
        if self.scope not in SCOPES:
            raise ConfigError(f"scope={self.scope!r} is not one of {SCOPES}")
        if self.head_budget not in HEAD_BUDGETS:
            raise ConfigError(f"head_budget={self.head_budget!r} is not one of {HEAD_BUDGETS}")
        if self.retrieval_scope not in SCOPES:
            raise ConfigError(f"retrieval_scope={self.retrieval_scope!r} is not one of {SCOPES}")
        for name in ("sink_tokens", "recent_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("image_tile", "text_page_size", "chunk_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        if (
            isinstance(self.read_budget, bool)
            or not isinstance(self.read_budget, (int, float))
            or not (0.0 < float(self.read_budget) <= 1.0)
        ):
            raise ConfigError(f"read_budget={self.read_budget!r} must be a fraction in (0, 1]")
        if self.method == "full" and self.method_options:
            raise ConfigError("method 'full' takes no options")
        if not isinstance(self.method_options, dict) or not isinstance(self.retrieval_options, dict):
            raise ConfigError("method_options and retrieval_options must be dicts")
        if self.method != "full":  # a budget shared by the heads needs a scorer whose scores allow it
            check_spec(self.method, self.method_options, self.head_budget)

    @property
    def evicts(self) -> bool:
        """False when nothing can be evicted (method full, or both budgets keep everything)."""

        # an int budget is a token count (1 = one token); only the float 1.0 means "keep everything"
        def keeps_all(b: float | int) -> bool:
            return isinstance(b, float) and b == 1.0

        return self.method != "full" and not (keeps_all(self.budget) and keeps_all(self.text_budget))

    def replace(self, **changes: Any) -> OvalConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown OvalConfig field(s) {sorted(unknown)}; known: {field_names()}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_spec(cls, spec: str, budget: float | int | None = None, **overrides: Any) -> OvalConfig:
        """Parse "name" or "name:key=value,key=value". Keys naming an OvalConfig field set it; the others
        are the method's options. `budget` (when given) sets the image budget."""
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"empty method spec {spec!r}; write 'name' or 'name:key=value,...'")
        name, _, rest = spec.strip().partition(":")
        fields: dict[str, Any] = {}
        options: dict[str, Any] = {}
        names = set(field_names())
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, raw = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"bad item {item!r} in method spec {spec!r}; write key=value")
            key = key.strip()
            if key in fields or key in options:
                raise ConfigError(f"{key!r} is given twice in method spec {spec!r}; give each key once")
            (fields if key in names else options)[key] = _parse_value(raw.strip())
        name = name.strip()
        if is_retrieval_only(name):
            # a retrieval method named alone ("oval", "quest", ...): keep the whole cache resident and read
            # `budget` of the candidate pages per decode step (the budget axis of page retrieval)
            fields.setdefault("retrieval", name)
            options_target = fields.setdefault("retrieval_options", {})
            options_target.update(options)
            options = {}
            name = "full"
            if budget is not None:
                if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
                    raise ConfigError(
                        f"retrieval method {spec!r} takes a read budget in (0, 1], got {budget!r}"
                    )
                fields["read_budget"] = float(budget)
                budget = None
        if budget is not None:
            fields["budget"] = budget
        fields.update(overrides)
        fields.setdefault("method_options", {})
        fields["method_options"] = {**fields["method_options"], **options}
        return cls(method=name, **fields)


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
