"""The method registries: name -> policy class, for eviction and for retrieval. Below the policies and the
configuration: `mm_oval.config` validates method names here, the policy families register themselves here
(`register_eviction` / `register_retrieval` in their files), and `make_eviction` / `make_retrieval` build
one. The project's own families are loaded, by module name, the first time a name is looked up.

Checks of a method spec that need a family's knowledge (e.g. a budget shared by the heads needs a scorer
whose scores are comparable across heads, `mm_oval.policies.budgets`) are registered with
`register_spec_check` by that family and run by `check_spec`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .errors import ConfigError, MmOvalError

EVICTION_REGISTRY: dict[str, type] = {}
RETRIEVAL_REGISTRY: dict[str, type] = {}
_SPEC_CHECKS: list[Callable[[str, dict[str, Any], str], None]] = []
_BUILTIN_FAMILIES = (
    "heuristics",
    "quest",
    "kvp",
    "pagebases",
    "router",
    "router2",
    "expected",
    "kvzip",
    "budgets",
)


def register_eviction(cls: type) -> type:
    EVICTION_REGISTRY[cls.name] = cls
    return cls


def register_retrieval(cls: type) -> type:
    RETRIEVAL_REGISTRY[cls.name] = cls
    return cls


def register_spec_check(check: Callable[[str, dict[str, Any], str], None]) -> None:
    """`check(method, method_options, head_budget)` raises ConfigError for a spec the family refuses."""
    if check not in _SPEC_CHECKS:
        _SPEC_CHECKS.append(check)


def load_builtin_policies() -> None:
    """Import the files that register the project's methods (a missing optional file is skipped)."""
    for mod in _BUILTIN_FAMILIES:
        try:
            importlib.import_module(f"mm_oval.policies.{mod}")
        except ModuleNotFoundError as e:  # a family not built yet
            if e.name != f"mm_oval.policies.{mod}":
                raise


def make_eviction(name: str, **options: Any) -> Any:
    load_builtin_policies()
    if name not in EVICTION_REGISTRY:
        known = ", ".join(sorted(["full", *EVICTION_REGISTRY]))
        raise ConfigError(f"unknown eviction method {name!r}; known methods: {known}")
    try:
        return EVICTION_REGISTRY[name](**options)
    except TypeError as e:
        if isinstance(e, MmOvalError):  # ModelError is a TypeError: a policy's own error, not bad options
            raise
        raise ConfigError(f"bad options {options} for eviction method {name!r}: {e}") from e


def make_retrieval(name: str, **options: Any) -> Any:
    load_builtin_policies()
    if name not in RETRIEVAL_REGISTRY:
        known = ", ".join(sorted(RETRIEVAL_REGISTRY))
        raise ConfigError(f"unknown retrieval method {name!r}; known methods: {known}")
    try:
        return RETRIEVAL_REGISTRY[name](**options)
    except TypeError as e:
        if isinstance(e, MmOvalError):  # ModelError is a TypeError: a policy's own error, not bad options
            raise
        raise ConfigError(f"bad options {options} for retrieval method {name!r}: {e}") from e


def known_methods() -> tuple[list[str], list[str]]:
    """(eviction methods incl. "full", retrieval methods) currently registered."""
    load_builtin_policies()
    return sorted(["full", *EVICTION_REGISTRY]), sorted(RETRIEVAL_REGISTRY)


def is_retrieval_only(name: str) -> bool:
    """True for a registered retrieval method that is no eviction method (e.g. "oval", "quest")."""
    load_builtin_policies()
    return name in RETRIEVAL_REGISTRY and name not in EVICTION_REGISTRY and name != "full"


def check_spec(method: str, options: dict[str, Any], head_budget: str) -> None:
    """The families' checks of an eviction method spec (no policy built)."""
    if method == "full":
        return
    load_builtin_policies()
    for check in _SPEC_CHECKS:
        check(method, options, head_budget)
