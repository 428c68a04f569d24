"""File helpers shared by the tasks and the runner: atomic writes, crash-safe JSONL appends, tables
(TSV / CSV / XLSX) and images, each failing with a `DataError` that names the file and the row."""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import os
import sys
import tempfile
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
    reader never sees a half-written file and a crash leaves the previous version intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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


def repair_jsonl(path: Path) -> int:
    """Cut a trailing partial line (a crash mid-write) off a JSONL file; return the number of whole records."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    good_end, count = 0, 0
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        line = data[pos:nl]
        if line.strip():
            try:
                json.loads(line)
            except ValueError:
                break
            count += 1
        good_end = nl + 1
        pos = nl + 1
    if good_end < len(data):
        log.warning("%s: dropping %d bytes of an unfinished last record", path, len(data) - good_end)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return count


def iter_records(path: Path) -> Iterator[dict]:
    """Whole records of a JSONL file written by `JsonlAppender`; an unfinished last line is skipped."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    break


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
