"""File helpers shared by the tasks and the runner: atomic writes, crash-safe JSONL appends, tables
(TSV / CSV / XLSX) and images, each failing with a `DataError` that names the file and the row."""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import os
import re
import secrets
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from ..errors import DataError

log = logging.getLogger(__name__)

# base64 images make MMBench cells far longer than csv's default limit
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and `os.replace`, so a
    reader never sees a half-written file and a crash leaves the previous version intact. The file gets
    the user's usual permissions (0666 less the umask), like any file the user creates; a temporary file
    left behind by a killed writer is removed by `remove_stale_tmp`."""
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
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


TMP_SUFFIX = ".tmp"
# `.{name}.{random}.tmp`: the temporary files of `atomic_write_text` (and of tempfile.mkstemp, used before)
_TMP_NAME = re.compile(r"^\..+\.[A-Za-z0-9_]{6,}\.tmp$")


def remove_stale_tmp(folder: str | os.PathLike) -> list[str]:
    """Delete the temporary files an interrupted `atomic_write_text` left in `folder`; return their names.
    Only call it while no other process writes into the folder (the runner holds the folder's lock)."""
    removed = []
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


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{what} {path} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}"
        ) from e


def read_jsonl(path: str | os.PathLike, what: str = "JSONL file") -> list[dict]:
    """Every line of a JSONL file as a dict; a corrupt line is an error naming its line number."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{what} {path}, line {lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise DataError(
                    f"{what} {path}, line {lineno}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


class JsonlAppender:
    """Appends one JSON record per line and flushes it at once, so a killed run loses at most the line
    being written. Opening repairs a file whose last line was cut off by a crash."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_jsonl(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _scan_jsonl(path: Path) -> tuple[list[dict], int]:
    """The records of a JSONL file written by `JsonlAppender` and the byte offset where its whole lines
    end. A last line without its newline is what a crash mid-write leaves: it is not a record. Any
    other line that is not a JSON object means the file was damaged after it was written: an error
    naming the line, never a silent loss of the records after it."""
    data = path.read_bytes()
    records: list[dict] = []
    pos, lineno = 0, 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            return records, pos
        lineno += 1
        line = data[pos:nl]
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise DataError(
                    f"{path}, line {lineno}: not a whole JSON record ({getattr(e, 'msg', e)}); the file was damaged after it "
                    "was written. Delete that line (its item is then generated again) or use another --out"
                ) from None
            if not isinstance(rec, dict):
                raise DataError(
                    f"{path}, line {lineno}: expected a JSON object, got {type(rec).__name__}; delete that "
                    "line (its item is then generated again) or use another --out"
                )
            records.append(rec)
        pos = nl + 1


def repair_jsonl(path: Path) -> int:
    """Cut a trailing partial line (a crash mid-write) off a JSONL file; return the number of whole records.
    A damaged line before the last is a `DataError` (see `_scan_jsonl`)."""
    if not path.exists():
        return 0
    records, good_end = _scan_jsonl(path)
    size = path.stat().st_size
    if good_end < size:
        log.warning("%s: dropping %d bytes of an unfinished last record", path, size - good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return len(records)


def iter_records(path: Path) -> Iterator[dict]:
    """Whole records of a JSONL file written by `JsonlAppender`; an unfinished last line is skipped, a
    damaged line before it is a `DataError` naming the line."""
    if not path.exists():
        return
    yield from _scan_jsonl(path)[0]


def read_table(path: str | os.PathLike, what: str = "table") -> list[dict[str, str | None]]:
    """Rows of a TSV / CSV / XLSX file as dicts keyed by the header; empty cells are None."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".xlsx", ".xlsm"):
        return _read_xlsx(path, what)
    delimiter = "," if suffix == ".csv" else "\t"
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        try:
            header = next(reader)
        except StopIteration:
            raise DataError(f"{what} {path} is empty") from None
        rows = []
        for lineno, cells in enumerate(reader, 2):
            if not cells or all(not c for c in cells):
                continue
            if len(cells) != len(header):
                raise DataError(
                    f"{what} {path}, row {lineno}: {len(cells)} cells but the header has {len(header)} "
                    f"(a tab or newline inside a cell, or a truncated file?)"
                )
            rows.append({h: (c if c != "" else None) for h, c in zip(header, cells)})
    return rows


def _read_xlsx(path: Path, what: str) -> list[dict[str, str | None]]:
    from openpyxl import load_workbook

    try:
        wb = load_workbook(path, read_only=True, data_only=True)
    except Exception as e:  # openpyxl raises many types for a damaged file
        raise DataError(f"{what} {path} could not be read as an Excel workbook: {e}") from e
    ws = wb.worksheets[0]
    it = ws.iter_rows(values_only=True)
    try:
        header = [str(h) if h is not None else "" for h in next(it)]
    except StopIteration:
        raise DataError(f"{what} {path} is empty") from None
    rows = []
    for cells in it:
        if cells is None or all(c is None for c in cells):
            continue
        rows.append({h: (None if c is None else _cell_str(c)) for h, c in zip(header, cells)})
    wb.close()
    return rows


def _cell_str(c: Any) -> str:
    if isinstance(c, float) and c.is_integer():
        return str(int(c))
    return str(c)


def write_table(path: str | os.PathLike, rows: Iterable[dict], columns: list[str]) -> None:
    """Write rows as a TSV (atomically)."""
    buf = io.StringIO()
    w = csv.writer(buf, delimiter="\t", lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
    atomic_write_text(path, buf.getvalue())


def open_image(path: str | os.PathLike) -> Image.Image:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except Exception as e:
        raise DataError(f"image {path} could not be decoded: {e}") from e


def decode_base64_image(payload: str, where: str) -> Image.Image:
    try:
        raw = base64.b64decode(payload, validate=False)
        with Image.open(io.BytesIO(raw)) as im:
            return im.convert("RGB")
    except Exception as e:
        raise DataError(f"{where}: the image cell is not a base64-encoded image ({e})") from e
