"""Capture log → the id-ordered store every later stage reads (``store/shard-*.h5``).

Each data set row gets one stored gradient: its last (or first) occurrence in the log, so a run of
several epochs stores the gradients of the final epoch by default. Rows the loop never saw (a
dropped last batch, a run stopped early) are stored as zeros, flagged not finite and listed, so that
shard ``k`` still holds ids ``[k*S, (k+1)*S)`` as the store's contract requires. Each shard also
gets a ``training`` group with the chosen rows' ``step``, ``epoch``, ``lr`` and ``loss_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradindex.fingerprint import digest_bytes
from gradindex.integrations.capture_log import COLUMNS, log_parts, read_columns, read_rows
from gradindex.store import STORE_DIR, ShardWriter, shard_name

KEEP = ("last", "first")
TRAINING_COLUMNS = ("step", "epoch", "lr", "loss_scale")
BLOCK = 1024


@dataclass
class Assembled:
    data_fingerprint: str
    unseen: list[int]
    nonfinite: list[int]
    seen_max: int
    """Most times one row was seen (epochs)."""
    log_rows: int


def _choose(ids: np.ndarray, epoch: np.ndarray, step: np.ndarray, part: np.ndarray, local: np.ndarray,
            keep: str) -> np.ndarray:
    """Index (into the concatenated log) of the kept occurrence of each distinct id, ids ascending: ordered by
    step, then epoch, then log order (without an optimizer the step stays 0, and the ranks' logs are not in time
    order: the epoch the loop set decides; a loop that sets the epoch from 0 again is still ordered by its steps)."""
    order = np.lexsort((local, part, epoch, step))
    sel = order if keep == "first" else order[::-1]
    _, pos = np.unique(ids[sel], return_index=True)
    return sel[pos]


def assemble_store(out_dir: str | Path, layer_dims: dict[str, int], n_rows: int, shard_size: int,
                   keep: str = "last", storage: str = "fp32") -> Assembled:
    """Write ``out_dir/store`` from ``out_dir/capture``; return what the manifest records."""
    if keep not in KEEP:
        raise ValueError(f"keep={keep!r} is not one of {KEEP}")
    parts = log_parts(out_dir)
    cols = [read_columns(p, ("ids", "step", "epoch", "token_hash")) for p in parts]
    ids = np.concatenate([c["ids"] for c in cols]) if cols else np.zeros(0, np.int64)
    if ids.size and ids.min() < 0:
        raise ValueError(f"captured row ids include {ids.min()}: row ids are the examples' 0-based positions in the "
                         "training data set (with_row_ids(ds) adds them), never negative")
    if ids.size and ids.max() >= n_rows:
        raise ValueError(
            f"captured row ids run {ids.min()}..{ids.max()}, outside a data set of {n_rows} rows; "
            "pass num_rows= the training data set's length (row ids are its 0-based positions)"
        )
    step = np.concatenate([c["step"] for c in cols]) if cols else np.zeros(0, np.int64)
    epoch = np.concatenate([c["epoch"] for c in cols]) if cols else np.zeros(0)
    part = np.concatenate([np.full(len(c["ids"]), k) for k, c in enumerate(cols)]) if cols else ids
    local = np.concatenate([np.arange(len(c["ids"])) for c in cols]) if cols else ids
    hashes = np.concatenate([c["token_hash"] for c in cols]) if cols else np.zeros((0, 16), np.uint8)
    chosen = np.full(n_rows, -1, dtype=np.int64)
    if ids.size:
        pick = _choose(ids, epoch, step, part, local, keep)
        chosen[ids[pick]] = pick
    row_hash = np.zeros((n_rows, 16), np.uint8)
    row_hash[chosen >= 0] = hashes[chosen[chosen >= 0]]
    data_fp = digest_bytes(row_hash[i].tobytes() for i in range(n_rows))
    counts = np.bincount(ids, minlength=n_rows) if ids.size else np.zeros(n_rows, np.int64)
    store = Path(out_dir) / STORE_DIR
    store.mkdir(parents=True, exist_ok=True)
    nonfinite: list[int] = []
    S = shard_size
    for k in range((n_rows + S - 1) // S):
        start, end = k * S, min((k + 1) * S, n_rows)
        w = ShardWriter(store / shard_name(k), start, end - start, layer_dims, data_fp, storage)
        if w.open():  # a leftover partial shard from a killed assembly: write it anew
            w.close()
            w.partial.unlink()
            w.open()
        training = {c: [] for c in TRAINING_COLUMNS}
        for s in range(start, end, BLOCK):
            e = min(s + BLOCK, end)
            block = _read_block(parts, part, local, chosen[s:e], layer_dims)
            nonfinite += [s + int(i) for i in np.nonzero(~block["finite"])[0]]
            w.append(np.arange(s, e, dtype=np.int64),
                     {n: block[f"grads/{n}"] for n in layer_dims},
                     loss=block["loss"], num_tokens=block["num_tokens"], finite=block["finite"],
                     token_hash=block["token_hash"])
            for c in TRAINING_COLUMNS:
                training[c].append(block[c])
        g = w.file.create_group("training")
        for c in TRAINING_COLUMNS:
            g[c] = np.concatenate(training[c])
        g["times_seen"] = counts[start:end].astype(np.int32)
        w.finish()
    unseen = [int(i) for i in np.nonzero(chosen < 0)[0]]
    return Assembled(data_fp, unseen, sorted(nonfinite), int(counts.max()) if n_rows else 0, int(ids.size))


def _read_block(parts: list[Path], part: np.ndarray, local: np.ndarray, chosen: np.ndarray,
                layer_dims: dict[str, int]) -> dict[str, np.ndarray]:
    """Columns and layer rows of the log rows ``chosen`` (``-1``: unseen, filled as a flagged zero row)."""
    n = len(chosen)
    out: dict[str, np.ndarray] = {k: np.zeros(n, dt) for k, dt in COLUMNS.items()}
    for k in ("epoch", "lr", "loss_scale", "loss"):
        out[k][:] = np.nan
    out["step"][:] = -1
    out["token_hash"] = np.zeros((n, 16), np.uint8)
    for name, d in layer_dims.items():
        out[f"grads/{name}"] = np.zeros((n, d), np.float32)
    seen = np.nonzero(chosen >= 0)[0]
    for p in np.unique(part[chosen[seen]]):
        mine = seen[part[chosen[seen]] == p]  # positions in the block
        loc = local[chosen[mine]]
        uniq, inv = np.unique(loc, return_inverse=True)
        for key, vals in read_rows(parts[int(p)], uniq, list(layer_dims)):
            out[key][mine] = vals[inv]
    return out
