"""The query engine: open an index once, answer "which training examples made the model say this?".

A façade over the query's steps, each a module of its own: the query's gradients (:mod:`~gradindex.query.gradients`),
the method it answers with and its self-normalization (:mod:`~gradindex.query.defaults`), refinement
(:mod:`~gradindex.query.refine`), the first stage, candidates from the index's tier re-ranked exactly from the stored
rows (:mod:`~gradindex.query.search`), the exact full-space stage (:mod:`~gradindex.query.full`) and the texts
(:mod:`~gradindex.query.texts`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Generator, Mapping, Sequence

import numpy as np
import torch

from gradindex.index import IndexSet, OpenIndex, RowReader, open_index
from gradindex.methods import DEFAULT_DAMPING, default_method, parse_method
from gradindex.precondition import Preconditioner
from gradindex.precondition.preconditioner import CURVATURE_CACHE_BYTES
from gradindex.query import full, inputs
from gradindex.query.defaults import answer_for, baked_note, check_damping, default_query_method
from gradindex.query.inputs import QueryTokens, as_records
from gradindex.query.refine import RefineConfig, Refiner, refine_config, row_curvature, training_sample
from gradindex.query.scores import score_matrix
from gradindex.query.search import Hit, QueryResult, check_rows, clamp_k, first_stage, select_layers
from gradindex.query.texts import TrainingTexts, attach_texts
from gradindex.spec.build import batch_size_of

__all__ = ["Hit", "QueryEngine", "QueryResult"]
log = logging.getLogger("gradindex")


class QueryEngine:
    """An index directory opened once: model, capture, preconditioners and indices in memory.

    ``model_dir`` defaults to the model the index was built with (``manifest['model_id']``); a model that differs from
    it (fingerprint, layers, projection) is refused. ``layers`` (glob patterns) keeps only some layers (and loads only
    their indices); ``data`` overrides where training texts are read; ``load_model=False`` opens a search-only engine
    (:meth:`search` or :meth:`scores` on given gradients). The FAISS indices are read at the first search
    (:attr:`indices`); exact :meth:`scores` never read them, so they work before `gradindex index`. ``index`` is a path
    or an :class:`~gradindex.index.OpenIndex` (then shared, not closed here). A ``model`` passed in needs a
    ``tokenizer`` only for text queries; token-id queries pad with ``pad_id`` (default: the tokenizer's, else the model
    config's). ``optimizer_state`` overrides where an Adam-preconditioned index's optimizer state is read (default: the
    path it was built with; its hash must match)."""

    def __init__(self, index: str | os.PathLike | OpenIndex, model_dir: str | os.PathLike | None = None, *,
                 model=None, tokenizer=None, device: str = "auto", dtype: str | None = None,
                 data: str | os.PathLike | None = None, layers: Sequence[str] | None = None,
                 use_gpu: bool = True, load_model: bool = True, pad_id: int | None = None,
                 optimizer_state: str | os.PathLike | None = None, refine: RefineConfig | None = None):
        self.index, self._owns_index = open_index(index)
        self.refine = refine
        """The default query refinement (None: plain EK-FAC queries)."""
        self._refiner: Refiner | None = None
        self._full_pre: dict[str, Preconditioner] = {}
        self.announce: Callable[[str], None] = log.info
        """Where the exact stage says, before it starts, how long it will take (the CLI prints it)."""
        self._hinted, self._mean_tokens = False, None  # (the note on the exact stage: logged once; example tokens)
        self._columns: dict[str, np.ndarray] = {}
        try:
            self.dir, self.manifest, self.store = self.index.dir, self.index.manifest, self.index.store
            self.n, self.layer_names = self.index.n, list(self.index.layers)
            self.layers = self.select_layers(layers)
            """The layers this engine answers on (every indexed layer unless ``layers`` chose some), model order."""
            self.rows, self._use_gpu = RowReader(self.index.store, self.layers), use_gpu
            self.pre, self.basis = self.index.pre, self.index.basis
            self.curvature_cache_bytes: int | None = CURVATURE_CACHE_BYTES
            """Bytes of full-space curvature the exact stage keeps at once (read from its file as used; None: all)."""
            self.model, self.tokenizer, self.capture, self.space, self.pad_id = model, tokenizer, None, None, pad_id
            if load_model:
                self.model, self.tokenizer, self.space, self.capture, self.pad_id = inputs.open_model(
                    self.index, self.layer_names, model_dir, model=model, tokenizer=tokenizer, device=device,
                    dtype=dtype, optimizer_state=optimizer_state, pad_id=pad_id)
            self.texts = TrainingTexts(self.manifest, self.index.store, self.tokenizer, data)
        except BaseException:
            self.close()
            raise

    def check_current(self) -> None:
        """Refuse to answer when a build replaced the index since it was opened
        (:meth:`~gradindex.index.opened.OpenIndex.check_current`)."""
        self.index.check_current()

    def example_columns(self, names: Sequence[str], ids) -> dict[str, np.ndarray]:
        """Per-example columns ``names`` (``num_tokens``, ``loss``, ...) of rows ``ids`` (each column read once)."""
        ids = np.asarray(ids, dtype=np.int64)
        for n in names:
            if n not in self._columns:
                self._columns[n] = self.store.column(n)
        return {n: self._columns[n][ids] for n in names}

    def select_layers(self, patterns: Sequence[str] | str | None) -> list[str]:
        """Layer names matching glob ``patterns`` (all loaded layers when ``None``), model order."""
        return select_layers(getattr(self, "layers", self.layer_names), patterns, self.dir)

    @property
    def indices(self) -> IndexSet:
        """The tier of :attr:`layers`, loaded on first use by :meth:`search` (exact :meth:`scores` need none)."""
        return self.index.load_indices(self.layers, self._use_gpu)

    def close(self) -> None:
        if self._owns_index:
            self.index.close()

    def __enter__(self) -> QueryEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, queries: list, text_field: str = "text") -> QueryTokens:
        """Records → tokens, truncated to the build's max length (flagged per query)."""
        self._need_model()
        return inputs.tokenize(self.model, self.tokenizer, self.manifest, queries, text_field)

    def gradients(self, tokens: QueryTokens) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
        """Per-layer projected query gradients ``{layer: [Q, D]}`` (CPU float32), losses, token counts."""
        self._need_model()
        return inputs.query_gradients(self.model, self.capture, self.basis, self.manifest, tokens, self.pad_id)

    def _need_model(self) -> None:
        if self.capture is None:
            raise RuntimeError("this engine was opened with load_model=False; it answers search(grads) only")

    def query(self, query, **kwargs) -> QueryResult:
        """One query (text, ``(prompt, completion)``, token ids or record); see :meth:`query_batch`."""
        return self.query_batch([query], **kwargs)[0]

    def query_batch(self, queries, k: int = 10, method: str | None = None, damping: float = DEFAULT_DAMPING,
                    layers: Sequence[str] | str | None = None, lowest: int = 0, rerank_full: int | None = None,
                    candidates: int | None = None, shortlist: int | None = None, nprobe: int | None = None,
                    texts: bool = True, text_field: str = "text",
                    refine: RefineConfig | bool | None = None) -> list[QueryResult]:
        """Answer a batch of queries: capture, precondition, (refine), search and exact re-rank of the stored rows (the
        first stage), texts; the exact (full-space) stage only on request.

        ``k`` results per query (best first), ``lowest`` most negative ones on request, ``rerank_full=C``: the exact
        stage, the top ``C`` candidates of the index re-scored in full (unprojected) space under ``method``
        (:mod:`gradindex.query.full`; ``kfac``/``ekfac`` need the full-space fit, ``gradindex precondition --space
        full``), the best ``k`` of them returned; the union of the batch's candidates is recomputed once
        (:func:`~gradindex.query.full.full_scores_batch`). ``None`` (default) or ``0``: the first stage answers
        (:data:`~gradindex.query.full.DEFAULT_RERANK`); on a budget-bound index a note says how to ask for the exact
        stage and what it costs (:meth:`rerank_plan`); ``candidates`` (ANN results per layer), ``shortlist`` (kept per
        layer after exact per-layer scoring) and the index's ``nprobe`` tune the ANN search (docs/query.md); ``refine``:
        a :class:`~gradindex.query.refine.RefineConfig` (``None``: the engine's default, ``False``: none) refines
        kfac/ekfac query vectors against the model's Gauss-Newton matrix (docs/query.md, "Refined queries"), in the
        exact stage's full space too."""
        t0 = time.perf_counter()
        check_damping(damping)
        self.index.check_current()  # before the gradient pass: refused at once when a build replaced the index
        asked, method = method, self.resolve_method(method)
        refine = self.refine_config(refine, method)
        rerank_full, hint = self.rerank_plan(method, rerank_full)
        exact = self._exact_stage(method, damping, refine) if rerank_full else None
        rerank_full = min(rerank_full, self.n)
        tokens, grads, loss, ntok, seconds = self._query_rows(queries, text_field, method, damping, layers, refine, t0)
        results = self.search(grads, k=max(k, rerank_full), method=asked, damping=damping, layers=layers,
                              lowest=lowest, candidates=candidates, shortlist=shortlist, nprobe=nprobe,
                              texts=texts)  # (asked: None lets the search fall back from the default, with a note)
        inputs.describe_queries(results, tokens, loss, ntok, inputs.query_length(self.model, self.manifest),
                                seconds, refine and refine.note(self.n))
        if exact is not None:
            full.run_steps(exact.run(results, tokens, rerank_full))
        else:
            self._first_stage(results, tokens, hint)
        for r in results:
            r.hits = r.hits[:k]
        return results

    def _first_stage(self, results: list[QueryResult], tokens: QueryTokens, hint: str | None) -> None:
        """Label the results as the first stage's, with the note on the exact stage and its cost (logged once)."""
        if hint and self._mean_tokens is None:  # (a training example's tokens: the first shard's, read once)
            self._mean_tokens = full.example_tokens(self.index.store)
        said = full.label_first_stage(results, tokens, self.manifest, hint, self._mean_tokens)
        if said and not self._hinted:
            self._hinted = True
            log.info(said)

    def _query_rows(self, queries, text_field: str, method: str, damping: float, layers, refine: RefineConfig | None,
                    t0: float) -> tuple[QueryTokens, dict[str, torch.Tensor], np.ndarray, np.ndarray, dict]:
        """Tokens, rows ``{layer: [Q, D]}`` (refined), losses, token counts, seconds (since ``t0``) of ``queries``."""
        tokens = self.tokenize(as_records(queries, text_field), text_field)
        grads, loss, ntok = self.gradients(tokens)
        seconds = {"gradient": time.perf_counter() - t0}
        if refine is not None:
            grads = self.refined_rows(tokens, grads, method, damping, self.select_layers(layers), refine)
            seconds["refine"] = time.perf_counter() - t0 - seconds["gradient"]
        return tokens, grads, loss, ntok, seconds

    def search(self, grads: dict[str, torch.Tensor | np.ndarray], k: int = 10, method: str | None = None,
               damping: float = DEFAULT_DAMPING, layers: Sequence[str] | str | None = None, lowest: int = 0,
               candidates: int | None = None, shortlist: int | None = None, nprobe: int | None = None,
               texts: bool = True) -> list[QueryResult]:
        """Search with given per-layer query rows ``{layer: [Q, D]}`` (as :meth:`gradients` gives them)."""
        t0 = time.perf_counter()
        check_damping(damping)
        self.index.check_current()
        chosen = check_rows(grads, self.select_layers(layers))
        answer = answer_for(self.index, method, damping, chosen)
        k, lowest = clamp_k(k, lowest, self.n, answer.notes)
        q = {n: torch.as_tensor(grads[n]).float().cpu() for n in chosen}
        out = first_stage(self.index, self.indices, self.rows, q, chosen, answer, damping, k, lowest,
                          (candidates, shortlist, nprobe), t0)
        if texts and self.tokenizer is not None:
            self._attach_texts(out)
        return out

    def _attach_texts(self, out: list[QueryResult]) -> None:
        attach_texts(out, self.texts)

    def scores(self, queries, method: str | None = None, damping: float = DEFAULT_DAMPING,
               layers: Sequence[str] | str | None = None, text_field: str = "text",
               refine: RefineConfig | bool | None = None) -> np.ndarray:
        """``[Q, N]`` float64 exact scores of every query against every training example.

        Column ``j`` is training example ``j``; row ``i`` is query ``i``. ``queries``: a batch as :meth:`query_batch`
        takes it, or per-layer projected gradients ``{layer: [Q, D]}``. The same numbers as the hits of
        :meth:`query_batch` (which ranks them), computed without the FAISS indices by streaming the store
        (:func:`gradindex.query.scores.score_matrix`). ``refine`` as in :meth:`query_batch` (queries given as gradients
        are scored as they are).
        """
        self.index.check_current()
        asked, method = method, self.resolve_method(method)
        chosen = self.select_layers(layers)
        grads = queries if isinstance(queries, Mapping) else self._query_rows(
            queries, text_field, method, damping, chosen, self.refine_config(refine, method), time.perf_counter())[1]
        out = score_matrix(self.index, grads, asked, damping, chosen)  # (None: the default, with its fallback)
        note = baked_note(self.basis, parse_method(method)[0], damping)
        if note:  # (an array has no notes: the log says it, once a call)
            log.warning(note)
        return out

    def resolve_method(self, method: str | None = None) -> str:
        """``method``, or the index's default query method (:func:`~gradindex.query.defaults.default_query_method`)."""
        return method or default_query_method(self.manifest, self.dir)

    def base_method(self, method: str | None = None) -> str:
        """``method``, or the index's default base method: what explain and the audit report use (no ``-selfnorm``)."""
        return method or default_method(self.manifest, self.dir)

    def rerank_plan(self, method: str, rerank_full: int | None) -> tuple[int, str | None]:
        """``(C, note)``: candidates to re-rank in full space and a note (:func:`~gradindex.query.full.rerank_plan`)."""
        return full.rerank_plan(self.manifest, self.dir, self.texts, method, rerank_full)

    def exact_steps(self, results: list[QueryResult], queries, top: int, damping: float = DEFAULT_DAMPING,
                    refine: RefineConfig | bool | None = None,
                    text_field: str = "text") -> Generator[tuple[int, int], None, list[QueryResult]]:
        """The exact stage of first-stage ``results`` (of :meth:`query_batch` with ``rerank_full=0`` and ``k >= top``)
        for the same ``queries``, one forward + backward a step: a generator that yields ``(candidate passes done,
        total)`` and returns the results re-ranked as ``query_batch(rerank_full=top)`` would (``gradindex serve``
        answers the first stage at once and runs these steps between other requests). What the stage needs is checked
        here, at the call, not at the first step."""
        if not results:
            return full.returning(results)
        refine, top = self.refine_config(refine, results[0].method), min(top, self.n)
        full.check_heads(results, top)
        self.check_exact(results[0].method)
        tokens = self.tokenize(as_records(queries, text_field), text_field)
        return self._exact_stage(results[0].method, damping, refine).run(results, tokens, top)

    def _exact_stage(self, method: str, damping: float, refine: RefineConfig | None) -> full.ExactStage:
        pre = self.full_preconditioner(method)
        refiner = self.refiner if refine is not None and refine.steps else None
        return full.ExactStage(self.model, self.pad_id, self.texts, batch_size_of(self.manifest), pre, damping,
                               lambda msg: self.announce(msg), refiner, refine)

    def full_preconditioner(self, method: str) -> Preconditioner:
        """The full-space preconditioner of ``method`` (identity for graddot/cosine), loaded once."""
        return full.full_fit(self._full_pre, self.index, method, self.curvature_cache_bytes)

    def check_exact(self, method: str) -> None:
        """Refuse at once an exact stage of ``method`` that would fail: no full-space fit, no training data."""
        self.full_preconditioner(method)
        self.texts.require("the exact stage (full-space re-rank) needs the training data")

    def refine_config(self, refine: RefineConfig | bool | None, method: str) -> RefineConfig | None:
        """The refinement a call asked for (``None``: the engine's), checked against ``method``."""
        return refine_config(self.refine, refine, method, self.manifest, self.dir, self.basis.kind)

    @property
    def refiner(self) -> Refiner:
        """The engine's :class:`~gradindex.query.refine.Refiner` (training sample, curvature, cache), made once."""
        self._need_model()
        if self._refiner is None:
            self._refiner = Refiner(self.model, self.capture, self.space, self.pad_id, self._refine_sample,
                                    functools.partial(row_curvature, self.basis, self.pre),
                                    gradients=lambda x, y: self.gradients(QueryTokens([], x, y, [False] * len(x)))[0])
        return self._refiner

    def refined_rows(self, tokens: QueryTokens, grads: Mapping[str, torch.Tensor], method: str, damping: float,
                     layers: Sequence[str], refine: RefineConfig) -> dict[str, torch.Tensor]:
        """Query rows ``{layer: [Q, D]}`` refined under ``refine`` (cached per query and setting)."""
        return self.refiner.rows(tokens, grads, method, damping, list(layers), refine)

    def _refine_sample(self, cfg: RefineConfig) -> tuple[list[list[int]], list[list[int]]]:
        return training_sample(cfg, self.n, self.texts)
