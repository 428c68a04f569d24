"""The harness's readers: crash-safe JSONL appends, tables (TSV / CSV / XLSX, read with pandas as the
official tools read them) and images, each failing with a `DataError` that names the file and the row.
Files are written with the library's atomic writers (`mm_oval.files`)."""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
from PIL import Image

from mm_oval.errors import DataError
from mm_oval.files import atomic_write_json, atomic_write_text, is_missing  # noqa: F401 (the lmms plugin's writer)

log = logging.getLogger(__name__)

# base64 images make MMBench cells far longer than csv's default limit
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


def _not_utf8(what: str, path: Path, e: UnicodeDecodeError) -> DataError:
    return DataError(
        f"{what} {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
        "re-save it as UTF-8"
    )


def _read_text(path: Path, what: str) -> str:
    """The file as text: UTF-8, with or without a byte-order mark; anything else is a DataError."""
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if data.startswith(b"\xef\xbb\xbf"):  # offsets counted in the file, not after the mark
            e = UnicodeDecodeError(e.encoding, data, e.start + 3, e.end + 3, e.reason)
        raise _not_utf8(what, path, e) from None


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    path = Path(path)
    text = _read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{what} {path} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}"
        ) from e
    except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
        raise DataError(f"{what} {path} is not valid JSON: {e}") from e


def read_jsonl_lines(path: str | os.PathLike, what: str = "JSONL file") -> list[tuple[int, dict]]:
    """(line number, dict) of every non-blank line of a JSONL file; a corrupt line is an error naming its
    line number. The numbers are the file's own, blank lines counted, so later checks can name them too."""
    path = Path(path)
    rows = []
    for lineno, line in enumerate(_read_text(path, what).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{what} {path}, line {lineno}: not valid JSON ({e.msg})") from e
        except (ValueError, RecursionError) as e:
            raise DataError(f"{what} {path}, line {lineno}: not valid JSON ({e})") from e
        if not isinstance(row, dict):
            raise DataError(f"{what} {path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append((lineno, row))
    return rows


def read_jsonl(path: str | os.PathLike, what: str = "JSONL file") -> list[dict]:
    """Every line of a JSONL file as a dict; a corrupt line is an error naming its line number."""
    return [row for _, row in read_jsonl_lines(path, what)]


def write_jsonl_answers(path: Path, answers: Iterable[tuple[Any, str]]) -> Path:
    """LLaVA's answers file (what `read_jsonl_answers` reads): one JSON row {"question_id", "text"} per
    (question id, answer), written atomically at `path` with the suffix .jsonl; the path written."""
    path = path.with_suffix(".jsonl")
    lines = [json.dumps({"question_id": qid, "text": text}, ensure_ascii=False) for qid, text in answers]
    atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""))
    return path


def read_jsonl_answers(
    path: Path, ids: set[str], what: str, key: Callable[[dict, str], str] | None = None
) -> tuple[dict[str, str], int]:
    """LLaVA's answers file (JSONL rows {"question_id", "text"}): ({question key: text} for the keys in
    `ids`, the number of rows). `key(row, where)` gives a row's question key (default: its question_id as
    text); a question answered twice is an error naming the line, rows naming other questions are
    counted, logged and left out. The caller says what no matching row at all means for its task."""
    lines = read_jsonl_lines(path, what)
    out: dict[str, str] = {}
    unknown = 0
    for lineno, r in lines:
        where = f"{path}, line {lineno}"
        if "question_id" not in r or "text" not in r:
            raise DataError(f'{where}: needs "question_id" and "text"')
        if not isinstance(r["text"], str):
            raise DataError(f"{where}: text {r['text']!r} is not text")
        k = key(r, where) if key else str(r["question_id"])
        if k in out:
            raise DataError(f"{where}: a second answer to question {k}; keep one")
        if k in ids:
            out[k] = r["text"]
        else:
            unknown += 1
    if unknown:
        log.warning("%s: %d answers name questions that are not in the data; ignored", path, unknown)
    return out, len(lines)


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


def read_table(path: str | os.PathLike, what: str = "table") -> list[dict[str, Any]]:
    """Rows of a TSV / CSV / XLSX file read as the official MMBench tools read them (pandas with its
    defaults: `read_csv(sep="\\t")`, `read_csv`, `read_excel`), as dicts keyed by the header. So numbers
    come back as int / float, and the cells pandas treats as missing (empty, "NA", "N/A", "NaN", "None",
    "null", ... its default `na_values`) come back as float NaN (see `is_missing`)."""

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix in (".xlsx", ".xlsm"):
            frame = pd.read_excel(path)
        else:
            frame = pd.read_csv(path, sep="," if suffix == ".csv" else "\t")
    except UnicodeDecodeError as e:
        raise _not_utf8(what, path, e) from None
    except pd.errors.EmptyDataError:
        raise DataError(f"{what} {path} is empty") from None
    except pd.errors.ParserError as e:
        raise DataError(
            f"{what} {path} could not be parsed ({e}; a tab or newline inside a cell, or a truncated file?)"
        ) from e
    except Exception as e:  # openpyxl and the parsers raise many types for a damaged file
        raise DataError(f"{what} {path} could not be read as a table: {type(e).__name__}: {e}") from e
    return [{str(k): v for k, v in row.items()} for row in frame.to_dict("records")]


def write_table(path: str | os.PathLike, rows: Iterable[dict], columns: list[str]) -> None:
    """Write rows as a TSV (atomically)."""
    buf = io.StringIO()
    w = csv.writer(buf, delimiter="\t", lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
    atomic_write_text(path, buf.getvalue())


def decode_base64_image(payload: str, where: str) -> Image.Image:
    try:
        raw = base64.b64decode(payload, validate=False)
        with Image.open(io.BytesIO(raw)) as im:
            return im.convert("RGB")
    except Exception as e:
        raise DataError(f"{where}: the image cell is not a base64-encoded image ({e})") from e
