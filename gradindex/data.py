"""Reading training or query data with `datasets`, tokenizing it, and batching it.

Accepted fields, in order of precedence: pre-tokenized ``input_ids`` (optional ``labels`` with
-100 for ignored positions); ``prompt`` + ``completion`` (loss on the completion only); chat
``messages`` (the tokenizer's chat template, loss on the assistant turns: :mod:`gradindex.chat`);
a text field (``text`` by default).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gradindex.chat import IGNORE, MESSAGES, chat_tokens

if TYPE_CHECKING:
    import datasets  # (imported where a file or folder is read: it takes most of a second)

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_records(path: str | os.PathLike, what: str = "data file",
                 empty: str = "nothing to index") -> datasets.Dataset:
    """Load a jsonl/json/csv/parquet file or a ``save_to_disk`` folder as a Dataset; ``what`` names the file in
    errors and ``empty`` says what to do with one without rows (a query file's is not "nothing to index")."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data {str(p)!r} does not exist")
    datasets.disable_progress_bars()
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise ValueError(
                f"{str(p)!r} is a folder but not a `datasets` save_to_disk folder ({e}); "
                "pass a .jsonl/.json/.csv/.parquet file or a saved Dataset"
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1:
                raise ValueError(f"{str(p)!r} holds splits {list(ds)}; save one split")
            ds = next(iter(ds.values()))
        return ds
    fmt = _FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"cannot read {p.name!r}: use one of {sorted(_FORMATS)} or a `datasets` folder"
        )
    if p.stat().st_size == 0:
        raise ValueError(f"{what} {str(p)!r} is empty; {empty}")
    if fmt in ("json", "csv"):
        check_utf8(p, header=p.suffix.lower() == ".csv")
    quiet = datasets.logging.get_logger("datasets")  # it would log the error we raise, twice
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(fmt, data_files=str(p), split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for unreadable files
        if "corresponds to no data" in str(e):  # only blank lines, or a CSV header without rows
            raise ValueError(f"{what} {str(p)!r} has no rows; {empty}") from None
        if p.suffix.lower() == ".jsonl":
            check_jsonl(p)  # names the line
        cause = e.__cause__ or e.__context__
        why = f"{type(e).__name__}: {e}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
        raise ValueError(f"could not read {str(p)!r} as {fmt}: {why}") from None
    finally:
        quiet.setLevel(level)


def check_jsonl(path: Path) -> None:
    """Refuse a JSON Lines file with a line that is not one JSON object, naming the line and the fix."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                v = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{str(path)!r} line {n}, column {e.colno} is not valid JSON ({e.msg}); "
                                 "a .jsonl file holds one JSON object per line") from None
            if not isinstance(v, dict):
                raise ValueError(f"{str(path)!r} line {n} is a JSON {type(v).__name__}, not an object; "
                                 'a .jsonl file holds one object per line, e.g. {"text": "..."}') from None


def check_utf8(path: Path, header: bool = False) -> None:
    """Refuse a text file that is not UTF-8, naming the file, line and row (``header``: CSV's first line)."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                row = n - 1 - int(header)
                raise ValueError(
                    f"{str(path)!r} is not UTF-8: line {n} (row {row}), byte {e.start} is {line[e.start]:#04x}; "
                    "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None


class Records:
    """Records held in memory (dicts with the same fields), read as :func:`tokenize_records` reads a
    ``datasets.Dataset`` (``column_names``, ``records[field]``, ``len``) without importing ``datasets``:
    a query's few records, or texts given in code."""

    def __init__(self, rows: list[dict]):
        self.rows = list(rows)
        self.column_names = list(dict.fromkeys(k for r in self.rows for k in r))

    def __getitem__(self, field: str) -> list:
        return [r.get(field) for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def select(self, ids) -> Records:
        return Records([self.rows[int(i)] for i in ids])


def records_from_texts(texts: list[str]) -> datasets.Dataset:
    import datasets

    return datasets.Dataset.from_dict({"text": list(texts)})


class Ragged(Sequence):
    """Rows of ints held as one flat array and offsets (4 bytes a token; a list of lists of Python ints
    takes ~40): what :func:`tokenize_records` returns, so that 10^6 tokenized examples hold ~0.3 GB,
    not ~1.5 GB. Reads as a list of lists: ``r[i]`` and iteration give lists, ``r[s:e]`` a list of them."""

    def __init__(self, rows: Iterable[Sequence[int]] = ()):
        b = RaggedBuilder()
        for r in rows:
            b.append(r)
        self.flat, self.offsets = b.arrays()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        return self._row(self._index(i))

    def _index(self, i: int) -> int:
        n = len(self)
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"row {i} of {n}")
        return j

    def __setitem__(self, i: int, row: Sequence[int]) -> None:
        """Replace row ``i`` (a row of another length moves the rows after it: O(total) per call)."""
        j = self._index(i)
        new = np.asarray(list(row), dtype=np.int64)
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        info = np.iinfo(self.flat.dtype)
        fits = len(new) == 0 or (new.min() >= info.min and new.max() <= info.max)
        flat = self.flat if fits else self.flat.astype(np.int64)
        if len(new) == b - a:
            flat[a:b] = new
        else:
            flat = np.concatenate([flat[:a], new.astype(flat.dtype), flat[b:]])
            self.offsets[j + 1:] += len(new) - (b - a)
        self.flat = flat

    def _row(self, j: int) -> list[int]:
        return self.flat[self.offsets[j]:self.offsets[j + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self._row(j) for j in range(len(self)))

    def __add__(self, other) -> list[list[int]]:
        return list(self) + list(other)

    def __radd__(self, other) -> list[list[int]]:
        return list(other) + list(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(
            list(a) == b for a, b in zip(other, self))

    def __hash__(self) -> int:  # (mutable contents, like a list)
        raise TypeError("unhashable type: 'Ragged'")

    def lengths(self) -> np.ndarray:
        """``[N]`` int64 row lengths."""
        return np.diff(self.offsets)

    def __repr__(self) -> str:
        return f"Ragged({len(self)} rows, {len(self.flat)} values)"


class RaggedBuilder:
    """Rows appended one at a time into a growing flat buffer, then :meth:`build` → :class:`Ragged`."""

    def __init__(self):
        self.values, self.lengths = array("q"), array("q")

    def append(self, row: Sequence[int]) -> None:
        self.values.extend(row)
        self.lengths.append(len(row))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(flat, offsets)``: the values (int32 where they fit) and the ``N + 1`` row offsets; empties the builder."""
        flat = np.frombuffer(self.values, np.int64) if len(self.values) else np.zeros(0, np.int64)
        fits = len(flat) == 0 or (flat.min() >= -(1 << 31) and flat.max() < (1 << 31))
        flat = flat.astype(np.int32) if fits else flat.copy()
        offsets = np.zeros(len(self.lengths) + 1, np.int64)
        if len(self.lengths):
            np.cumsum(np.frombuffer(self.lengths, np.int64), out=offsets[1:])
        self.values, self.lengths = array("q"), array("q")
        return flat, offsets

    def build(self) -> Ragged:
        r = Ragged.__new__(Ragged)
        r.flat, r.offsets = self.arrays()
        return r


@dataclass(frozen=True)
class Tokenized:
    """Token ids and labels per example, plus what tokenizing did."""

    input_ids: Sequence[list[int]]
    """Per example its token ids (a list of lists, or a :class:`Ragged` from :func:`tokenize_records`)."""
    labels: Sequence[list[int]]
    n_truncated: int
    field: str
    truncated: tuple[bool, ...] = ()
    """Per example: whether it was cut to ``max_length`` (empty when not recorded)."""

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize_records(
    ds: datasets.Dataset | Records, tokenizer, max_length: int, text_field: str = "text",
    vocab_size: int | None = None,
    require_targets: bool = True,
) -> Tokenized:
    """Token ids and labels for each record (labels are unshifted; -100 = not a target).

    Refused with the row named (a ``ValueError``), never turned into a zero-gradient row: a missing,
    null or non-string text, prompt or completion; a non-empty text that the tokenizer turns into no
    tokens (a model folder without its tokenizer files); token ids that are negative or, with
    ``vocab_size``, outside the vocabulary; and, with ``require_targets``, an example left with no
    target token (an empty completion, a one-token text, a completion truncated away).
    """
    if len(ds) == 0:
        raise ValueError("the data set is empty; nothing to index")
    cols = set(ds.column_names)
    _check_one_format(ds, text_field)
    ids_out, labels_out, truncated = RaggedBuilder(), RaggedBuilder(), []

    def add(ids: list[int], lab: list[int]) -> None:  # cut to max_length; an empty example: one pad-free token
        truncated.append(len(ids) > max_length)
        if truncated[-1]:
            ids, lab = ids[:max_length], lab[:max_length]
        if not ids:
            ids, lab = [tokenizer.eos_token_id or 0], [IGNORE]
        ids_out.append(ids)
        labels_out.append(lab)

    field, pairs = _token_pairs(ds, cols, tokenizer, text_field, max_length, vocab_size)
    for ids, lab in pairs:
        add(ids, lab)
    ids, labels = ids_out.build(), labels_out.build()
    if require_targets:
        _check_targets(labels, truncated, max_length)
    return Tokenized(ids, labels, sum(truncated), field, tuple(truncated))


def _token_pairs(ds: datasets.Dataset | Records, cols: set, tokenizer, text_field: str, max_length: int,
                 vocab_size: int | None) -> tuple[str, Iterator[tuple[list[int], list[int]]]]:
    """``(field, pairs)``: the data's format (pre-tokenized, prompt and completion, chat messages or text) and each
    record's ``(ids, labels)`` in it, checked, as :func:`tokenize_records` reads them (it cuts them to
    ``max_length``)."""
    def given():
        labels_col = _column(ds, "labels") if "labels" in cols else None
        for i, ids in enumerate(_column(ds, "input_ids")):
            ids = _int_list(ids, i, "input_ids")
            lab = _int_list(labels_col[i], i, "labels") if labels_col is not None else list(ids)
            if len(lab) != len(ids):
                raise ValueError(f"record {i}: labels ({len(lab)}) and input_ids ({len(ids)}) differ in length")
            _check_ids(ids, i, vocab_size)
            yield ids, lab

    def prompted():
        for i, (p, c) in enumerate(zip(_column(ds, "prompt"), _column(ds, "completion"))):
            pi = _tokens(tokenizer, _text(p, i, "prompt"), i, max_length)
            ci = _tokens(tokenizer, _text(c, i, "completion"), i, max_length)
            yield pi + ci, [IGNORE] * len(pi) + ci

    def chats():
        for i, msgs in enumerate(_column(ds, MESSAGES)):
            ids, lab = chat_tokens(tokenizer, msgs, i)
            _check_ids(ids, i, vocab_size)
            yield ids, lab

    def texts():
        for i, t in enumerate(_column(ds, text_field)):
            ids = _tokens(tokenizer, _text(t, i, text_field), i, max_length)
            yield ids, ids

    if "input_ids" in cols:
        return "input_ids", given()
    if {"prompt", "completion"} <= cols:
        return "prompt+completion", prompted()
    if MESSAGES in cols:
        return MESSAGES, chats()
    if text_field in cols:
        return text_field, texts()
    raise ValueError(
        f"no field {text_field!r} in the data (columns: {sorted(cols)}); pass --text-field NAME, "
        "or give 'prompt' and 'completion', chat 'messages', or pre-tokenized 'input_ids'"
    )


def _column(ds: datasets.Dataset | Records, field: str) -> list:
    """One field of every record as a list, read at once (a ``datasets`` column iterated row by row decodes
    each row on its own: 40% of tokenizing 10^6 short texts)."""
    return ds[field][:]


def _check_one_format(ds: datasets.Dataset | Records, text_field: str) -> None:
    """Refuse a file whose rows use different formats (text / prompt+completion / input_ids)."""
    forms = {"input_ids": ("input_ids",), "prompt+completion": ("prompt", "completion"), MESSAGES: (MESSAGES,),
             text_field: (text_field,)}
    forms = {k: v for k, v in forms.items() if all(c in ds.column_names for c in v)}
    if len(forms) < 2:
        return
    cols = {c: ds[c] for v in forms.values() for c in v}
    first: dict[str, int] = {}
    for i in range(len(ds)):
        have = [k for k, v in forms.items() if all(cols[c][i] is not None for c in v)]
        if len(have) == 1:
            first.setdefault(have[0], i)
    if len(first) > 1:
        (a, i), (b, j) = sorted(first.items(), key=lambda kv: kv[1])[:2]
        raise ValueError(f"the data mixes formats: row {i} has {a!r}, row {j} has {b!r}; "
                         "use one format per file")


def _text(v, row: int, field: str) -> str:
    if isinstance(v, str):
        return v
    what = "missing or null" if v is None else f"a {type(v).__name__}, not a string"
    raise ValueError(f"row {row}: the {field!r} field is {what}; every row needs a string there "
                     "(fix or drop that row)")


CHARS_PER_TOKEN = 16
"""Characters of a text tokenized per token of ``max_length`` at first: generous (English runs about
4 characters a token), so a long text is cut before the tokenizer sees it (a 10 MB line took minutes)."""


def _tokens(tokenizer, text: str, row: int, max_length: int | None = None) -> list[int]:
    """Token ids of ``text``; with ``max_length``, the same first ``max_length`` ids as the whole text's,
    from a prefix of it: ``CHARS_PER_TOKEN`` characters a token, four times more while the prefix gives
    fewer than ``2 × max_length`` tokens (the last tokens of a cut text may differ from the whole text's:
    at least ``max_length`` of them lie between the cut and the ids kept)."""
    n = (max_length or 0) * CHARS_PER_TOKEN
    while max_length and len(text) > n:
        ids = tokenizer(text[:n], add_special_tokens=False)["input_ids"]
        if len(ids) >= 2 * max_length:
            return list(ids)
        n *= 4
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids and text.strip():
        raise ValueError(
            f"row {row}: a text of {len(text)} characters became no tokens: the tokenizer is missing or broken "
            "(does the model folder hold its tokenizer files? save them with tokenizer.save_pretrained(MODEL_DIR))"
        )
    return list(ids)


def _int_list(v, row: int, field: str) -> list[int]:
    if v is None or isinstance(v, str | bytes) or not hasattr(v, "__iter__"):
        raise ValueError(f"row {row}: {field!r} is {'null' if v is None else type(v).__name__}, not a list of ints")
    out = []
    for t in v:
        whole = isinstance(t, int | np.integer) and not isinstance(t, bool)
        if not whole and isinstance(t, float | np.floating) and float(t).is_integer():
            whole = True  # a JSON column of ints with one float in it is read as floats: 3.0 is 3
        if not whole:
            raise ValueError(f"row {row}: {field!r} holds {t!r}, not an integer token id; token ids are whole "
                             "numbers (were these ids rounded, or scores?)")
        out.append(int(t))
    return out


def _check_ids(ids: list[int], row: int, vocab_size: int | None) -> None:
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        rng = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
        raise ValueError(f"row {row}: token id {bad[0]} is outside the model's vocabulary ({rng}); "
                         "were these ids made with another tokenizer?")


def _check_targets(labels: Ragged, truncated: list[bool], max_length: int) -> None:
    """Refuse examples with no target token: their gradient would be a silent row of zeros."""
    target = labels.flat != IGNORE
    target[labels.offsets[:-1][labels.lengths() > 0]] = False  # (a row's first token is no target)
    seen = np.concatenate([[0], np.cumsum(target)])
    empty = np.flatnonzero(seen[labels.offsets[1:]] == seen[labels.offsets[:-1]]).tolist()
    if not empty:
        return
    i = empty[0]
    why = (f"its targets were cut off at --max-length {max_length}" if truncated[i]
           else "an empty completion or text, or a single token")
    rows = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
    raise ValueError(
        f"{len(empty)} row(s) have no target token to take a loss on (rows {rows}; row {i}: {why}); "
        "their gradients would be zero: drop or fix those rows"
    )


def token_hash(ids: list[int], labels: list[int]) -> bytes:
    """16-byte content hash of an example's tokens and targets."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(ids, dtype=np.int64).tobytes())
    h.update(np.asarray(labels, dtype=np.int64).tobytes())
    return h.digest()


def collate(ids: list[list[int]], labels: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and shifted-ready ``labels`` ``[B, T]``."""
    T = max(len(x) for x in ids)
    B = len(ids)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    lab = torch.full((B, T), IGNORE, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for i, (x, y) in enumerate(zip(ids, labels)):
        input_ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": lab}


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropy over each example's targets, and the target counts.

    ``logits`` ``[B, T, V]``, ``labels`` ``[B, T]`` (unshifted). Returns ``[B]`` losses (fp32)
    and ``[B]`` token counts.
    """
    shift_logits = logits[:, :-1].float()  # [B, T-1, V]
    shift_labels = labels[:, 1:]  # [B, T-1]
    tok = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    ).view(shift_labels.shape)
    return tok.sum(dim=1), (shift_labels != IGNORE).sum(dim=1)
