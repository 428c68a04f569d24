"""The project's one way to write a file: atomically, through a temporary file in the same folder and
`os.replace`, so a reader never sees a half-written file and a crash leaves the previous version intact.

    atomic_write_bytes(path, data)     atomic_write_text(path, text)     atomic_write_json(path, obj)

The folder is created when missing. The file gets the user's usual permissions (0666 less the umask), like
any file the user creates. A temporary file left behind by a killed writer is named `.{name}.{random}.tmp`
and removed by `remove_stale_tmp` (the evaluation runner calls it under its folder lock).

`FolderLock(folder)` holds an output folder for one run (`flock` on FOLDER/.lock): the evaluation runner and
the training commands (train-kvp, train-router, train-smol) take it, so two runs never write one folder.

`load_checkpoint` reads a training checkpoint back with `torch.load(weights_only=True)`: tensors and plain
data only, never pickled objects.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
import secrets
from pathlib import Path
from typing import Any

from .errors import DataError, ResultsError

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
# `.{name}.{random}.tmp`: the temporary files of `atomic_write_bytes` (and of tempfile.mkstemp, used before)
_TMP_NAME = re.compile(r"^\..+\.[A-Za-z0-9_]{6,}\.tmp$")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        try:
            # os.open applies the umask to 0o666 (tempfile.mkstemp would make it 0600)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """`atomic_write_bytes` of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2, default: Any = None) -> None:
    """`obj` as JSON (UTF-8, non-ASCII kept as is, a final newline); `default` as for `json.dumps`."""
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False, default=default) + "\n")


def remove_stale_tmp(folder: str | os.PathLike) -> list[str]:
    """Delete the temporary files an interrupted atomic write left in `folder`; return their names.
    Only call it while no other process writes into the folder (the runner holds the folder's lock)."""
    removed: list[str] = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for f in folder.iterdir():
        if _TMP_NAME.match(f.name) and f.is_file():
            try:
                f.unlink()
            except FileNotFoundError:
                continue
            removed.append(f.name)
    if removed:
        log.info("%s: removed %d temporary file(s) of an interrupted write", folder, len(removed))
    return removed


def is_missing(cell: Any) -> bool:
    """`pandas.isna` on one cell of a table read with pandas (None, NaN, pandas' NA and NaT): what the
    official tools treat as an empty cell."""
    if cell is None:
        return True
    if isinstance(cell, float):
        return math.isnan(cell)
    return type(cell).__name__ in ("NAType", "NaTType")


def load_checkpoint(path: str | Path, what: str = "checkpoint") -> dict:
    """A training checkpoint written with `torch.save` of tensors and plain data, read with
    `weights_only=True`. A missing, truncated or pickle-only file is a DataError naming it."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DataError(
            f"{what} {path} holds objects other than tensors and plain data (it may come from an older mm-oval "
            "or another program); it is not loaded, since unpickling it could run code. Start over without it "
            "(delete it or use another output directory)"
        ) from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        brief = " ".join(str(e).split())
        raise DataError(
            f"{what} {path} is truncated or not a PyTorch checkpoint ({brief}); delete it to start over"
        ) from e
    if not isinstance(state, dict):
        raise DataError(f"{what} {path} holds a {type(state).__name__}, not a checkpoint dict")
    return state


class FolderLock:
    """An exclusive lock on an output folder: `flock` on FOLDER/.lock, which also holds the pid of the
    process that has it. The kernel drops the lock when that process ends, however it ends, so a lock
    file left behind by a crash never blocks a later run."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / ".lock"
        self._f: Any = None

    def acquire(self) -> FolderLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+", encoding="utf-8")
        except OSError as e:
            raise ResultsError(f"cannot write into the output folder {self.folder}: {e}") from e
        try:
            _lock_file(f)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "a process"
            f.close()
            raise ResultsError(
                f"{self.folder} is in use by another run ({holder}): two runs writing into one folder mix "
                "their records; wait for that run to end, or use another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {platform.node()}\n")
        f.flush()
        self._f = f
        return self

    def release(self) -> None:
        if self._f is not None:
            self._f.close()  # closing the file drops the lock
            self._f = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _lock_file(f: Any) -> None:
    """Lock an open file exclusively without waiting; OSError when another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
