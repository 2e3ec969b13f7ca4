"""Queries in any form → records → token ids and labels, tokenized exactly as the build does.

A single query is a text (``str``), a ``(prompt, completion)`` tuple (loss on the completion
only), a sequence of token ids (loss on every next token), or a record ``dict`` with the fields
:func:`gradindex.data.tokenize_records` reads (``text``/``--text-field``, ``prompt`` +
``completion``, or ``input_ids`` with optional ``labels``). A batch is a ``list`` of these.

A record may also name a ``target``: a piece of its loss tokens' text (the completion, the assistant's turns,
or the text), whose tokens alone are measured; the loss on the rest is left out of the query's gradient
(:func:`measure_target`). For fact tracing, the fact itself: asked "What is the capital of X?" / "It is V.",
the default query is decided by the model's surprise at "It" where the target ``V`` is not.

Then their gradients: the model an index was built with, opened and checked against it (:func:`open_model`), and
the tokens captured as the build captured its rows, the same capture, projection and row basis
(:func:`query_gradients`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gradindex.adapter import adapter_fingerprint
from gradindex.capture import GradientCapture, ProjectedRows, RowSpace
from gradindex.capture.adam import adam_capture_transforms
from gradindex.capture.batch import batch_gradients
from gradindex.chat import MESSAGES, render_turns, set_chat_template, template_of
from gradindex.data import IGNORE, Records, load_records, tokenize_records
from gradindex.fingerprint import check_tokenizer, model_fingerprint
from gradindex.index import OpenIndex
from gradindex.model import max_positions, resolve_pad_id, vocab_size
from gradindex.quantize import base_quantization
from gradindex.spec.build import batch_size_of
from gradindex.spec.manifest import IndexMismatchError, Manifest, identity_differences, layer_identity
from gradindex.store.basis import capture_transforms, to_rows

log = logging.getLogger("gradindex")


@dataclass
class QueryTokens:
    """Tokenized queries, with what truncation did to each."""

    records: list[dict]
    input_ids: list[list[int]]
    labels: list[list[int]]
    truncated: list[bool]
    measured: list[str | None] = field(default_factory=list)  # per query: what its target kept, or None

    def __len__(self) -> int:
        return len(self.input_ids)


def _is_ids(q) -> bool:
    if isinstance(q, torch.Tensor | np.ndarray):
        return q.ndim == 1
    return isinstance(q, Sequence) and not isinstance(q, str | tuple) and len(q) > 0 and all(
        isinstance(x, int | np.integer) for x in q)


def as_record(q, text_field: str = "text") -> dict:
    """One query as a record dict (see the module doc for the accepted forms)."""
    if isinstance(q, str):
        return {text_field: q}
    if isinstance(q, tuple) and len(q) == 2 and all(isinstance(x, str) for x in q):
        return {"prompt": q[0], "completion": q[1]}
    if isinstance(q, dict):
        return dict(q)
    if _is_ids(q):
        return {"input_ids": [int(x) for x in (q.tolist() if hasattr(q, "tolist") else q)]}
    raise TypeError(
        f"cannot read a query of type {type(q).__name__}; give a text, a (prompt, completion) tuple, "
        "a list of token ids, or a record dict"
    )


def as_records(queries, text_field: str = "text") -> list[dict]:
    """A batch (``list``; or a 2-D tensor of ids) → records."""
    if isinstance(queries, torch.Tensor | np.ndarray) and queries.ndim == 2:
        return [as_record(row, text_field) for row in queries]
    if not isinstance(queries, list):
        raise TypeError(f"a batch of queries is a list, got {type(queries).__name__}")
    if not queries:
        raise ValueError("the batch of queries is empty")
    if _is_ids(queries):
        raise TypeError("a list of ints is one token-id query; use query(), or wrap it: query_batch([ids])")
    return [as_record(q, text_field) for q in queries]


def measure_target(labels: list[int], target: str, tokenizer, i: int = 1) -> list[int]:
    """``labels`` with every loss token outside the last occurrence of ``target`` in their text ignored (a token
    partly inside it is kept). Refused, naming the text, where the loss tokens do not contain ``target``. ``i``: the
    query's number in messages, counted from 1 as the results are."""
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"query {i}'s target must be a non-empty string, got {target!r}")
    if tokenizer is None:
        raise ValueError(f"query {i} names a target, and this engine has no tokenizer to find it with; pass "
                         "tokenizer=, or give labels with -100 outside the tokens to measure")
    at = [k for k, y in enumerate(labels) if y != IGNORE]
    prefixes = [tokenizer.decode([labels[k] for k in at[:n + 1]]) for n in range(len(at))]  # (a token's text
    ends = [len(t) for t in prefixes]  # ends where its prefix's does: decoding one token alone can differ)
    text = prefixes[-1] if prefixes else ""
    start = text.rfind(target)
    if start < 0:
        raise ValueError(f"query {i}'s target {target!r} is not in the text its loss is taken on ({text[:200]!r}); "
                         "give a piece of the completion or the assistant's answer, as written there")
    out = [IGNORE] * len(labels)
    for n, k in enumerate(at):
        begin = ends[n - 1] if n else 0
        if begin < start + len(target) and ends[n] > start:
            out[k] = labels[k]
    return out


def read_queries(path: str | os.PathLike) -> list[dict]:
    """Records of a query file, in any format `gradindex build` reads; each record is typed on its own.

    A file may mix forms (``text``, ``prompt`` + ``completion``, ``input_ids``): its table gives every
    record every column, ``None`` where the record has none, so those are dropped here and each record
    keeps only its own fields (:func:`tokenize_queries` tokenizes records of one form together).
    """
    fix = 'give it one query a line, e.g. {"prompt": "...", "completion": "..."}'
    ds = load_records(path, "query file", fix)
    if len(ds) == 0:
        raise ValueError(f"query file {str(path)!r} holds no records; {fix}")
    return [{f: v for f, v in r.items() if v is not None} for r in ds.to_list()]


def tokenize_queries(records: list[dict], tokenizer, max_length: int,
                     text_field: str = "text", vocab_size: int | None = None) -> QueryTokens:
    """Token ids and labels per record, truncated to the build's ``max_length`` (flagged).

    Records with the same fields are tokenized together by :func:`tokenize_records` (the build's
    code, which also truncates and flags). Token-id records need no ``tokenizer`` (``None``).
    """
    if tokenizer is None:
        texts = [i for i, r in enumerate(records) if "input_ids" not in r]
        if texts:
            raise ValueError(f"query {texts[0] + 1} is text ({_preview(records[texts[0]])}), and this engine has no "
                             "tokenizer; pass tokenizer=, or give token ids")
    targets = [r.get("target") for r in records]
    records = [{f: v for f, v in r.items() if f != "target"} for r in records]
    ids: list[list[int]] = [[] for _ in records]
    labels: list[list[int]] = [[] for _ in records]
    truncated = [False] * len(records)
    groups: dict[tuple, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault(tuple(sorted(rec)), []).append(i)
    for members in groups.values():
        ds = Records([records[i] for i in members])
        tok = tokenize_records(ds, tokenizer, max_length, text_field, vocab_size=vocab_size,
                               require_targets=False)
        for j, i in enumerate(members):
            ids[i], labels[i], truncated[i] = tok.input_ids[j], tok.labels[j], tok.truncated[j]
    measured: list[str | None] = [None] * len(records)
    for i, target in enumerate(targets):
        if target is not None:
            try:
                kept = measure_target(labels[i], target, tokenizer, i + 1)
            except ValueError as e:
                if truncated[i]:  # (the cause, not the target's wording)
                    raise ValueError(f"{e}; query {i + 1} was cut to the index's max length ({max_length} tokens), "
                                     "which may have cut its target off: shorten the query") from None
                raise
            n, of = sum(y != IGNORE for y in kept), sum(y != IGNORE for y in labels[i])
            labels[i], measured[i] = kept, f"only the target {target!r} measured: {n} of the answer's {of} tokens"
    for i, y in enumerate(labels):
        if not any(t != IGNORE for t in y[1:]):
            if targets[i] is not None:
                raise ValueError(f"query {i + 1}'s target {targets[i]!r} covers only its text's first token, which "
                                 "has no loss (no token before it predicts it); name a later piece of the text")
            raise ValueError(
                f"query {i + 1} has no target token to take a loss on ({_preview(records[i])}): a text needs at "
                "least two tokens, a completion at least one" + (" after truncation" if truncated[i] else "")
            )
    return QueryTokens(records, ids, labels, truncated, measured)


def describe(rec: dict, text_field: str = "text", sep: str = "|") -> str:
    """A query record as one line of text: its text, ``prompt<sep>completion``, or its token count."""
    if rec.get(text_field) is not None:
        return str(rec[text_field])
    if "prompt" in rec:
        return f"{rec['prompt']}{sep}{rec.get('completion', '')}"
    if rec.get(MESSAGES) is not None:
        return render_turns(rec[MESSAGES], sep=f" {sep} ")
    return f"[{len(rec.get('input_ids', []))} token ids]"


def _preview(rec: dict, n: int = 40) -> str:
    s = repr(rec)
    return s if len(s) <= n else s[: n - 3] + "..."


def open_model(ix: OpenIndex, layers: list[str], model_dir=None, *, model=None, tokenizer=None, device: str = "auto",
               dtype: str | None = None, optimizer_state=None, pad_id: int | None = None) -> tuple:
    """``(model, tokenizer, space, capture, pad_id)`` of ``ix``'s ``layers``: ``model`` (default: ``model_dir``'s, else
    the index's ``model_id``) refused where it does not fit the index (fingerprint, layers, projection, dtype)."""
    given = model is not None
    if not given:  # (load_causal_lm checks the tokenizer it loads against the index's fingerprint)
        model, tokenizer = _load(ix.manifest, model_dir, device, dtype)
    if ix.manifest.get("chat_template") and tokenizer is not None and template_of(tokenizer) is None:
        set_chat_template(tokenizer, ix.manifest["chat_template"])  # the template the build used
    if given:
        check_tokenizer(Manifest.of(ix.manifest).tokenizer, tokenizer, "the query's tokenizer", ix.dir)
    try:
        spec = ix.projection
    except ValueError as e:
        raise IndexMismatchError(str(e)) from None
    route = ix.described.route
    model.requires_grad_(False)
    transforms, optimizer = _optimizer_transforms(ix.manifest, optimizer_state, model, layers)
    if transforms is None:  # the row basis's side maps (an Adam index has the raw basis)
        transforms = capture_transforms(ix.basis)
    try:
        space = RowSpace(spec, transforms)  # (what the index's rows hold of each layer)
        capture = GradientCapture(model, layers, ProjectedRows(space, route))
    except ValueError as e:  # another architecture: the index's layers are not there
        raise IndexMismatchError(f"this model does not fit the index in {str(ix.dir)!r}: the index's {e}; query with "
                                 "the model the index was built from, or rebuild the index") from None
    now = {"model_fingerprint": model_fingerprint(model), "projection": spec.to_dict(),
           "adapter_fingerprint": adapter_fingerprint(model), "base_quantization": base_quantization(model),
           "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "optimizer": optimizer,
           "layers": layer_identity(space)}
    diffs = identity_differences(ix.described.build, now)
    if diffs:
        raise IndexMismatchError(f"this model does not fit the index in {str(ix.dir)!r}: " + "; ".join(diffs)
                                 + ". Query with the model the index was built from, or rebuild the index")
    return model, tokenizer, space, capture, resolve_pad_id(model, tokenizer) if pad_id is None else pad_id


def _load(manifest: dict, model_dir, device: str, dtype: str | None) -> tuple:
    """The model and tokenizer in ``model_dir`` (default: the index's ``model_id``), loaded as the build loaded them."""
    from gradindex.adapter import is_adapter_dir
    from gradindex.model import index_model_options, load_causal_lm

    path = Path(model_dir or manifest.get("model_id") or "")
    if not str(path) or not path.exists():
        raise FileNotFoundError(f"the model that built this index, {str(path)!r}, is not there; "
                                "pass its directory (model_dir= / --model)")
    options = index_model_options(manifest)
    if model_dir is not None and is_adapter_dir(path):  # the adapter given, not the index's: its
        options["adapter"] = None  # fingerprint is checked by the identity check (it was ignored: issue 33 item 2)
    return load_causal_lm(path, dtype=dtype or manifest.get("dtype", "float32"), device=device, **options)


def _optimizer_transforms(manifest: dict, path, model, layers: list[str]) -> tuple[dict | None, dict | None]:
    """The Adam transforms the build applied to every row, so queries get the same (or none)."""
    m = Manifest(manifest)
    rec = m.optimizer
    if not rec:
        return None, None
    path = Path(path or m.optimizer_state)
    if not path.is_file():
        raise FileNotFoundError(f"this index's rows are Adam-preconditioned and queries need the same optimizer "
                                f"state, but {str(path)!r} is not there; pass it (optimizer_state= / "
                                "--optimizer-state)")
    return adam_capture_transforms(path, rec["mode"], model, layers)


def tokenize(model, tokenizer, manifest: dict, queries: list, text_field: str = "text") -> QueryTokens:
    """Records → tokens, truncated to the build's max length and the model's positions (flagged per query)."""
    recs = [as_record(q, text_field) if not isinstance(q, dict) else q for q in queries]
    return tokenize_queries(recs, tokenizer, query_length(model, manifest), text_field, vocab_size=vocab_size(model))


def query_length(model, manifest: dict) -> int:
    """The most tokens a query keeps: the build's max length, no longer than the model's positions (an index whose
    data fit keeps the ``--max-length`` it was given, even past them)."""
    max_length = Manifest(manifest).max_length
    return min(max_length, max_positions(model) or max_length)


def query_gradients(model, capture: GradientCapture, basis, manifest: dict, tokens: QueryTokens,
                    pad_id: int) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
    """Per-layer projected query gradients ``{layer: [Q, D]}`` in the rows' basis (CPU float32), losses, tokens."""
    B = batch_size_of(manifest)
    parts, loss, ntok = [], [], []
    with capture:
        for s in range(0, len(tokens), B):
            bg = batch_gradients(model, capture, tokens.input_ids[s:s + B], tokens.labels[s:s + B], pad_id)
            parts.append({n: v.float().cpu() for n, v in bg.grads.items()})
            loss.append(bg.loss.float().cpu().numpy())
            ntok.append(bg.num_tokens.cpu().numpy())
    shapes = Manifest(manifest).shapes
    grads = {n: torch.from_numpy(to_rows(basis, n, torch.cat([p[n] for p in parts]).numpy(), shapes[n]))
             for n in parts[0]}
    if not all(torch.isfinite(v).all() for v in grads.values()):
        raise ValueError("a query's gradient is not finite (overflow in the model); try dtype float32")
    return grads, np.concatenate(loss), np.concatenate(ntok)


def describe_queries(results: list, tokens: QueryTokens, loss: np.ndarray, ntok: np.ndarray, max_length: int,
                     seconds: dict[str, float], note: str | None = None) -> None:
    """Each query's tokens, loss, truncation (noted), gradient ``seconds`` and ``note`` on its result."""
    for j, r in enumerate(results):
        r.num_tokens, r.loss, r.truncated = int(ntok[j]), float(loss[j]), tokens.truncated[j]
        r.seconds.update(seconds)
        if note:
            r.notes.append(note)
        if j < len(tokens.measured) and tokens.measured[j]:
            r.notes.append(tokens.measured[j])
        if r.truncated:
            r.notes.append(f"query {j + 1} was longer than the index's max length ({max_length} tokens) and was "
                           "truncated")
            log.info(r.notes[-1])
