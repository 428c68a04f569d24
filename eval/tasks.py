"""What every benchmark provides to the runner, and the registry of tasks.

A task is one file (eval/vqa.py, eval/pope.py, ...) holding one `Task` subclass that declares everything
the command line, `mm-oval score`, the demo and the runner need to know about it: its name and labels, the
data options its loader reads (each becomes a flag of `mm-oval eval` / `score` / `sweep`), the bundled dev
sets `--data bundled` / `bundled576` find, its prompt, its scoring rules and scorer, and the readers/writers
of its official prediction formats. The runner is generic over these. Adding a task is that file, one line
in `TASKS` below, and its data."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from mm_oval import bundled
from mm_oval.bundled import bundled576_data_dir, bundled_data_dir
from mm_oval.errors import ConfigError, DataError

# the bundled dev sets `--data` can name, and the package-data folder each is (see `Task.bundled`)
BUNDLED_SETS: dict[str, Callable[[], Path]] = {"bundled": bundled_data_dir, "bundled576": bundled576_data_dir}


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


@dataclass(frozen=True)
class DataOption:
    """A file or folder a task's loader reads besides --data. `name` is the keyword of `Task.load` and the
    key recorded in run.json's data_options; the command line spells it `--name` with dashes. Tasks that
    read the same option (VQAv2's and TextVQA's --questions) share the flag, and its help lists each."""

    name: str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


class Task(ABC):
    """One benchmark. Subclasses declare the class attributes below and implement the loader and scorer."""

    name: ClassVar[str]  # what --task names, and the key in `TASKS`
    title: ClassVar[str]  # the benchmark's own spelling, in help texts ("VQAv2")
    metric_label: ClassVar[str]  # the primary score's column header in tables ("VQAv2 acc")
    # "image": an image and a question per item (a LLaVA-style model); "text": a context read before the
    # question, no image (a plain language model; eval/longtext.py)
    modality: ClassVar[str] = "image"
    # short answers: greedy decoding stops at EOS long before this; it only bounds runaway outputs
    max_new_tokens: ClassVar[int] = 16
    primary_metric: ClassVar[str]
    # what --data points at for this task (for the help text)
    data_help: ClassVar[str] = ""
    # the options `load` reads besides --data, each a command-line flag (see DataOption)
    data_options: ClassVar[tuple[DataOption, ...]] = ()
    # the bundled dev sets this task has: `--data NAME` -> the function finding their folder (package data)
    bundled: ClassVar[dict[str, Callable[[], Path]]] = {}
    # predictions-file formats `mm-oval score` reads for this task (for the help text)
    predictions_format: ClassVar[str] = ""
    # the scoring rules this task offers, the default first
    rules: ClassVar[tuple[Rule, ...]]
    # the prompt (the text inside the model's chat template), called by `load` per item with the task's own
    # fields (a question; MMBench: question, hint, options); where the zoo's training data use the same
    # prompt it comes from mm_oval.prompts, defined once for both
    prompt: ClassVar[Callable[..., str]]

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


# the registry: task name -> "module:class" (imported when the task is used)
TASKS: dict[str, str] = {
    "mmbench": "mm_oval.eval.mmbench:MMBenchTask",
    "vqav2": "mm_oval.eval.vqa:VQAv2Task",
    "textvqa": "mm_oval.eval.textvqa:TextVQATask",
    "pope": "mm_oval.eval.pope:POPETask",
    "objlist": "mm_oval.eval.objlist:ObjListTask",
    # long-context text tasks (plain language models): <kind>_<length>, the kinds and lengths SmolLM2-135M-
    # Instruct answers at >= 80 with the full cache (docs/results/smollm2.md: ~2k: 0-70, ~4k pass key: 0);
    # eval/longtext.py generates the others too (2k and 4k; doorkeys, keylist, trio), for KVP's text traces
    **{
        f"{kind}_{length}": f"mm_oval.eval.longtext:{kind.capitalize()}{length.upper()}Task"
        for kind in ("passkey", "needle", "message", "duo")
        for length in ("1k",)
    },
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def all_tasks() -> list[Task]:
    """Every registered task, in registry order (what the command line's help texts list)."""
    return [get_task(name) for name in TASKS]


def resolve_data(data: str | Path, task: Task | None = None) -> Path:
    """`bundled` -> the bundled synthetic dev sets, `bundled576` -> the 576-token ones (with a `task`: the
    sets that task declares in `Task.bundled`); anything else must exist."""
    name = str(data)
    if task is not None and name in task.bundled:
        return task.bundled[name]()
    if task is not None and (name in BUNDLED_SETS or any(name in t.bundled for t in all_tasks())):
        has = ", ".join(task.bundled) or "none"
        raise DataError(
            f"{task.name} has no bundled dev set {name!r} (its bundled sets: {has}); pass --data the path of "
            f"its data ({task.data_help})"
        )
    return bundled.resolve_data(data)  # `bundled` / `bundled576`, or a path that must exist


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
