"""What every benchmark provides to the runner: items (an image, a prompt, the ground truth), a scorer,
and the readers/writers of the official prediction formats. The runner is generic over these."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from ..errors import ConfigError, DataError
from ..zoo import bundled576_data_dir, bundled_data_dir


@dataclass
class Item:
    """One question. `id` is unique within the task (a string, so it can key JSON); `image` loads the
    image lazily; `meta` holds what the scorer needs; `group` names the conversation in multi-turn mode.
    A text task's item has no image (`image()` returns None) and a `context`: the text read before the
    question (the question-agnostic setting compresses the cache right after it)."""

    id: str
    prompt: str
    image: Callable[[], Image.Image | None]
    meta: dict[str, Any] = field(default_factory=dict)
    group: str | None = None
    context: str | None = None


@dataclass(frozen=True)
class Rule:
    """A named scoring rule and the published source it reproduces (repository, commit, file).

    Where the official sources disagree a task offers several; `score` records the one it used."""

    name: str
    repository: str
    commit: str
    file: str
    summary: str

    def record(self) -> dict[str, Any]:
        """What results.json stores: the name and the source revision."""
        return {
            "name": self.name,
            "source": {"repository": self.repository, "commit": self.commit, "file": self.file},
            "summary": self.summary,
        }

    def describe(self) -> str:
        return f"{self.name} ({self.repository} @ {self.commit[:10]}, {self.file})"


class Task(ABC):
    name: ClassVar[str]
    # short answers: greedy decoding stops at EOS long before this; it only bounds runaway outputs
    max_new_tokens: ClassVar[int] = 16
    primary_metric: ClassVar[str]
    # predictions-file formats `mm-oval score` reads for this task (for the help text)
    predictions_format: ClassVar[str] = ""
    # the scoring rules this task offers, the default first
    rules: ClassVar[tuple[Rule, ...]]

    @abstractmethod
    def load(self, data: Path, limit: int | None = None, **paths: Any) -> list[Item]:
        """Items in dataset order. `limit` keeps the first N questions (MMBench: N questions with
        all their rotations)."""

    @abstractmethod
    def score(
        self, items: list[Item], predictions: dict[str, str], rules: str | None = None
    ) -> dict[str, Any]:
        """Scores by the named rule (`None`: the task's default), recorded under "rules". Items without a
        prediction count as wrong unless the rule's source drops them (then the count says how many)."""

    def rule(self, name: str | None = None) -> Rule:
        """The rule called `name` (None: the default); an unknown name is a ConfigError listing the valid ones."""
        if name is None:
            return self.rules[0]
        for r in self.rules:
            if r.name == name:
                return r
        raise ConfigError(
            f"unknown scoring rule {name!r} for {self.name}; choose one of: {', '.join(r.name for r in self.rules)}"
        )

    @abstractmethod
    def read_predictions(self, path: Path, items: list[Item]) -> dict[str, str]:
        """Predictions written by another toolkit (the official format) -> {item id: text}."""

    @abstractmethod
    def write_predictions(self, path: Path, items: list[Item], predictions: dict[str, str]) -> Path:
        """Write predictions in the official format (what `read_predictions` reads); return the path."""

    def primary(self, scores: dict[str, Any]) -> float | None:
        """The headline score; None when the data has no ground truth (e.g. VQAv2 test-dev)."""
        value = scores[self.primary_metric]
        return None if value is None else float(value)


TASKS: dict[str, str] = {
    "mmbench": "mm_oval.eval.mmbench:MMBenchTask",
    "vqav2": "mm_oval.eval.vqa:VQAv2Task",
    "textvqa": "mm_oval.eval.textvqa:TextVQATask",
    "pope": "mm_oval.eval.pope:POPETask",
    "objlist": "mm_oval.eval.objlist:ObjListTask",
    # long-context text tasks (plain language models): <kind>_<length>
    **{
        f"{kind}_{length}": f"mm_oval.eval.longtext:{kind.capitalize()}{length.upper()}Task"
        for kind in ("passkey", "doorkeys", "keylist", "needle", "message", "trio")
        for length in ("1k", "2k", "4k")
    },
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def resolve_data(data: str | Path) -> Path:
    """`bundled` -> the bundled synthetic dev sets, `bundled576` -> the 576-token ones; anything else must exist."""
    if str(data) == "bundled":
        return bundled_data_dir()
    if str(data) == "bundled576":
        return bundled576_data_dir()
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"data path not found: {path}")
    return path


def find_one(folder: Path, patterns: list[str], what: str) -> Path:
    """The single file in `folder` matching the first pattern that matches anything."""
    for pattern in patterns:
        hits = sorted(p for p in folder.glob(pattern) if p.is_file())
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise DataError(
                f"{folder} holds several {what} files ({', '.join(h.name for h in hits)}); pass the file itself"
            )
    raise DataError(f"no {what} file in {folder} (looked for {', '.join(patterns)})")
