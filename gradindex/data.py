"""Reading training or query data with `datasets`, tokenizing it, and batching it.

Accepted fields, in order of precedence: pre-tokenized ``input_ids`` (optional ``labels`` with
-100 for ignored positions); ``prompt`` + ``completion`` (loss on the completion only); a text
field (``text`` by default).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch

IGNORE = -100
_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_records(path: str | os.PathLike) -> datasets.Dataset:
    """Load a jsonl/json/csv/parquet file or a ``save_to_disk`` folder as a Dataset."""
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
        raise ValueError(f"data file {str(p)!r} is empty; nothing to index")
    try:
        return datasets.load_dataset(fmt, data_files=str(p), split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many types for unreadable files
        raise ValueError(f"could not read {str(p)!r} as {fmt}: {type(e).__name__}: {e}") from None


def records_from_texts(texts: list[str]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": list(texts)})


@dataclass(frozen=True)
class Tokenized:
    """Token ids and labels per example, plus what tokenizing did."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    n_truncated: int
    field: str
    truncated: tuple[bool, ...] = ()
    """Per example: whether it was cut to ``max_length`` (empty when not recorded)."""

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize_records(
    ds: datasets.Dataset, tokenizer, max_length: int, text_field: str = "text"
) -> Tokenized:
    """Token ids and labels for each record (labels are unshifted; -100 = not a target)."""
    if len(ds) == 0:
        raise ValueError("the data set is empty; nothing to index")
    cols = set(ds.column_names)
    ids_out: list[list[int]] = []
    labels_out: list[list[int]] = []
    n_trunc = 0
    if "input_ids" in cols:
        field = "input_ids"
        labels_col = ds["labels"] if "labels" in cols else None
        for i, ids in enumerate(ds["input_ids"]):
            ids = [int(t) for t in ids]
            lab = [int(t) for t in labels_col[i]] if labels_col is not None else list(ids)
            if len(lab) != len(ids):
                raise ValueError(f"record {i}: labels ({len(lab)}) and input_ids ({len(ids)}) differ in length")
            ids_out.append(ids)
            labels_out.append(lab)
    elif {"prompt", "completion"} <= cols:
        field = "prompt+completion"
        for p, c in zip(ds["prompt"], ds["completion"]):
            pi = tokenizer(p, add_special_tokens=False)["input_ids"]
            ci = tokenizer(c, add_special_tokens=False)["input_ids"]
            ids_out.append(pi + ci)
            labels_out.append([IGNORE] * len(pi) + ci)
    elif text_field in cols:
        field = text_field
        for t in ds[text_field]:
            if t is None:
                t = ""
            ids = tokenizer(str(t), add_special_tokens=False)["input_ids"]
            ids_out.append(ids)
            labels_out.append(list(ids))
    else:
        raise ValueError(
            f"no field {text_field!r} in the data (columns: {sorted(cols)}); pass --text-field NAME, "
            "or give 'prompt' and 'completion', or pre-tokenized 'input_ids'"
        )
    truncated = [len(x) > max_length for x in ids_out]
    for i in range(len(ids_out)):
        if truncated[i]:
            ids_out[i] = ids_out[i][:max_length]
            labels_out[i] = labels_out[i][:max_length]
            n_trunc += 1
        if not ids_out[i]:  # keep row alignment: an empty example is one pad-free token
            ids_out[i] = [tokenizer.eos_token_id or 0]
            labels_out[i] = [IGNORE]
    return Tokenized(ids_out, labels_out, n_trunc, field, tuple(truncated))


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
