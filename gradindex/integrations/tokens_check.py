"""After a live capture: were the examples trained as the tokens ``gradindex build`` makes of the data file the index
names (``data_id``)? Queries show a row's text, and ``precondition`` and the exact stage re-run rows, only where they
were. A trainer that tokenizes the data itself may not make them: TRL appends an end-of-sequence token to text and
prompt/completion data. Checked on a sample of rows against the store's token hashes, right after the run, so the
cause is named while the run's settings are at hand."""

from __future__ import annotations

import os
from pathlib import Path

from gradindex.data import IGNORE, token_hash
from gradindex.precondition.factors import load_build_data, sample_rows
from gradindex.store import Store

SAMPLE = 256
"""Rows checked (all of them in a smaller index)."""


def loop_tokens_differ(out_dir: str | os.PathLike, manifest: dict, tokenizer) -> str | None:
    """Why the loop's tokens of the sampled rows differ from the data file's, with the fix; ``None`` where they do not
    (or where there is no data file or tokenizer to check against)."""
    path = manifest.get("data_id") or ""
    if not path or tokenizer is None or not Path(path).is_file():
        return None
    try:
        data = load_build_data(manifest, tokenizer, path, check=False)
    except (OSError, ValueError, KeyError):
        return None  # (a file that does not read as data: said where it is used)
    with Store(out_dir) as s:
        hashes, ntok = s.column("token_hash"), s.column("num_tokens")
    unseen = set((manifest.get("training") or {}).get("unseen_ids") or [])
    rows = [int(i) for i in sample_rows(min(len(data), len(hashes)), SAMPLE, 0) if int(i) not in unseen]
    bad = [i for i in rows if token_hash(data.input_ids[i], data.labels[i]) != hashes[i].tobytes()]
    short = None if len(hashes) >= len(data) else (
        f"the index holds {len(hashes)} rows and {path!r} {len(data)}: the training set the loop saw ended "
        f"{len(data) - len(hashes)} rows early (a trainer that drops examples, as TRL drops those left with no loss "
        f"token, dropped its last), so the index has no row for the file's last {len(data) - len(hashes)}; pass "
        f"num_rows={len(data)} to the callback: every row of the file gets one, those not trained flagged unseen")
    if not bad:
        return short
    i = bad[0]
    ours, theirs = sum(y != IGNORE for y in data.labels[i][1:]), int(ntok[i])
    if theirs == ours + 1:
        why = "one more loss token: an end-of-sequence token appended, as TRL does to text and prompt/completion data"
    elif theirs > ours:
        why = "the loss on more tokens: TRL trains chats on every token unless SFTConfig(assistant_only_loss=True)"
    else:
        why = "other tokens: another tokenizer, chat template or max_length, or another file"
    return (f"{short}; and " if short else "") + (
            f"{len(bad)} of {len(rows)} examples checked were trained as other tokens than `gradindex build` makes of "
            f"{path!r} (row {i}: {theirs} loss tokens in the loop, {ours} from the file; {why}); queries will show "
            "no text for such rows, and `precondition` and the exact stage refuse the file: give the trainer the "
            "file's tokens (gradindex.data.tokenize_records: input_ids and labels), docs/training.md")
