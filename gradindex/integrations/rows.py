"""Training row ids through data sets and collators."""

from __future__ import annotations

import torch

from gradindex.integrations.live import MISSING_ROWS, ROW_KEY


def with_row_ids(dataset):
    """``dataset`` (a ``datasets.Dataset``) with a ``gradindex_row`` column: each row's 0-based position."""
    if ROW_KEY in dataset.column_names:
        return dataset
    return dataset.add_column(ROW_KEY, list(range(len(dataset))))


class KeepRows:
    """Wrap a collator that drops columns it does not know (TRL's does): carry ``gradindex_row`` past it.

    A collator that packs or flattens examples (``packing``, ``padding_free``) makes rows that are
    not one training example each; that is refused with an error.
    """

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples: list[dict]) -> dict:
        try:
            rows = [int(ex[ROW_KEY]) for ex in examples]
        except KeyError:
            raise ValueError(MISSING_ROWS) from None
        batch = self.collator([{k: v for k, v in ex.items() if k != ROW_KEY} for ex in examples])
        n = batch["input_ids"].shape[0]
        if n != len(rows):
            raise ValueError(
                f"the collator turned {len(rows)} examples into {n} rows (packing or padding-free batches); "
                "in-loop capture needs one example per row: turn packing/padding_free off while capturing"
            )
        batch[ROW_KEY] = torch.tensor(rows)
        return batch


def keep_rows(collator) -> KeepRows:
    """See :class:`KeepRows`."""
    return collator if isinstance(collator, KeepRows) else KeepRows(collator)
