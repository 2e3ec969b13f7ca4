"""The query engine: open an index once, answer "which training examples made the model say this?"."""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gradindex.adapter import adapter_fingerprint
from gradindex.capture import GradientCapture, ProjectedRows, RowSpace
from gradindex.capture.adam import adam_capture_transforms
from gradindex.capture.batch import batch_gradients
from gradindex.chat import set_chat_template, template_of
from gradindex.fingerprint import check_index_tokenizer, model_fingerprint
from gradindex.index import IndexSet, OpenIndex, RowReader, open_index, query_vectors
from gradindex.index.tiers import CandidateRequest
from gradindex.manifest import IndexMismatchError, identity_differences
from gradindex.methods import (
    DEFAULT_DAMPING,
    REBUILD_RAW,
    default_method,
    index_row_base,
    method_spec,
    parse_method,
)
from gradindex.model import max_positions, resolve_pad_id, vocab_size
from gradindex.precondition import Preconditioner, load_full_preconditioner
from gradindex.precondition.preconditioner import CURVATURE_CACHE_BYTES
from gradindex.query import search as S
from gradindex.query.defaults import UNAVAILABLE, default_query_method, fallback_note
from gradindex.query.full import (
    DEFAULT_RERANK,
    EXACT_STAGE_C,
    FULL_SPACE_METHODS,
    budget_bound,
    full_query_gradient,
    full_scores_steps,
    run_steps,
    stored_share,
)
from gradindex.query.inputs import QueryTokens, as_record, as_records, tokenize_queries
from gradindex.query.refine import RefineConfig, Refiner, eigenbasis_curvature, preconditioner_curvature
from gradindex.query.scores import score_matrix
from gradindex.query.texts import TrainingTexts
from gradindex.spec.build import batch_size_of
from gradindex.spec.manifest import layer_identity
from gradindex.store.basis import capture_transforms, to_rows

log = logging.getLogger("gradindex")


@dataclass
class Hit:
    """One training example in a result."""

    id: int
    """Row of the example in the training data (0-based)."""
    score: float
    """Exact score under the query's method, summed over the chosen layers."""
    layer_scores: dict[str, float]
    """Each layer's contribution to ``score``."""
    text: str | None = None
    """The training text (``None`` when the data file is unavailable or changed)."""
    full_score: float | None = None
    """Score from full (unprojected) gradients, when re-ranked with them."""

    def to_dict(self) -> dict:
        d = {"id": self.id, "score": self.score, "text": self.text, "layer_scores": self.layer_scores}
        if self.full_score is not None:
            d["full_score"] = self.full_score
        return d


@dataclass
class QueryResult:
    """The answer to one query: most influential examples first, and optionally the lowest."""

    hits: list[Hit]
    lowest: list[Hit]
    method: str
    damping: float | None
    layers: list[str]
    num_tokens: int | None = None
    loss: float | None = None
    truncated: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    stage: str = ""
    """Which stage produced the scores of :attr:`hits`: ``index rows`` (exact on the stored rows, which
    hold the whole gradient), ``first stage`` (the stored rows are a budget-bound projection) or
    ``full-space re-rank of the top C`` (:attr:`Hit.full_score`; docs/query.md, "Two stages")."""
    reranked: int = 0
    """Candidates re-scored in full space (0: none)."""

    def to_dict(self) -> dict:
        return {"hits": [h.to_dict() for h in self.hits], "lowest": [h.to_dict() for h in self.lowest],
                "method": self.method, "damping": self.damping, "layers": self.layers,
                "num_tokens": self.num_tokens, "loss": self.loss, "truncated": self.truncated,
                "notes": self.notes, "seconds": self.seconds, "stage": self.stage, "reranked": self.reranked}


def _secs(x: float) -> str:
    """Seconds for a message: ``0.25 s``, ``3.1 s``, ``120 s``."""
    return f"{x:.0f} s" if x >= 10 else f"{x:.2g} s"


def check_damping(damping: float) -> None:
    """Refuse a damping that is not a finite number > 0 (``inf`` would answer all-zero scores)."""
    if not (isinstance(damping, int | float) and math.isfinite(damping) and damping > 0):
        raise ValueError(f"damping must be a finite number > 0 (a fraction of each layer's mean eigenvalue, "
                         f"e.g. {DEFAULT_DAMPING:g}), got {damping!r}")


class QueryEngine:
    """An index directory opened once: model, capture, preconditioners and indices in memory.

    ``model_dir`` defaults to the model the index was built with (``manifest['model_id']``);
    a model that differs from it (fingerprint, layers, projection) is refused. ``layers`` (glob
    patterns) keeps only some layers (and loads only their indices); ``data`` overrides where
    training texts are read; ``load_model=False`` opens a search-only engine (:meth:`search` or
    :meth:`scores` on given gradients). The FAISS indices are read at the first search
    (:attr:`indices`); exact :meth:`scores` never read them, so they work before `gradindex index`.
    ``index`` is a path or an :class:`~gradindex.index.OpenIndex` (then shared, not closed here).
    A ``model`` passed in needs a ``tokenizer`` only for text queries; token-id queries pad with
    ``pad_id`` (default: the tokenizer's, else the model config's). ``optimizer_state`` overrides
    where an Adam-preconditioned index's optimizer state is read (default: the path it was built
    with; its hash must match).
    """

    def __init__(self, index: str | os.PathLike | OpenIndex, model_dir: str | os.PathLike | None = None, *,
                 model=None, tokenizer=None, device: str = "auto", dtype: str | None = None,
                 data: str | os.PathLike | None = None, layers: Sequence[str] | None = None,
                 use_gpu: bool = True, load_model: bool = True, pad_id: int | None = None,
                 optimizer_state: str | os.PathLike | None = None, refine: RefineConfig | None = None):
        self.index, self._owns_index = open_index(index)
        self.refine = refine
        """The default query refinement (None: plain EK-FAC queries)."""
        self._refiner: Refiner | None = None
        self.announce: Callable[[str], None] = log.info
        """Where the exact stage says, before it starts, how long it will take (the CLI prints it)."""
        self._hinted = False  # (the first stage's note on the exact stage: logged once per engine)
        self._mean_tokens: float | None = None
        try:
            self.dir, self.manifest, self.store = self.index.dir, self.index.manifest, self.index.store
            self.n = self.index.n
            self.layer_names = list(self.index.layers)
            self.layers = self.select_layers(layers)
            """The layers this engine answers on (every indexed layer unless ``layers`` chose some), model order."""
            self._use_gpu = use_gpu
            self.rows = RowReader(self.store, self.layers)
            self.pre = self.index.pre
            self.basis = self.index.basis
            self._scales: dict[tuple, np.ndarray] = {}
            self._full_pre: dict[str, Preconditioner] = {}
            self.curvature_cache_bytes: int | None = CURVATURE_CACHE_BYTES
            """Bytes of full-space curvature the exact stage keeps at once (its layers are read from the full-space
            file when used, :func:`~gradindex.precondition.load_full_preconditioner`); None: every layer."""
            self.model, self.tokenizer, self.capture, self.space = model, tokenizer, None, None
            self.pad_id = pad_id
            if load_model:
                self._open_model(model_dir, device, dtype, optimizer_state)
            self.texts = TrainingTexts(self.manifest, self.store, self.tokenizer, data)
        except BaseException:
            self.close()
            raise

    # -- opening ------------------------------------------------------------------------------
    def _open_model(self, model_dir, device: str, dtype: str | None, optimizer_state=None) -> None:
        given = self.model is not None
        if not given:  # (load_causal_lm checks the tokenizer it loads against the index's fingerprint)
            from gradindex.adapter import is_adapter_dir
            from gradindex.model import index_model_options, load_causal_lm

            path = Path(model_dir or self.manifest.get("model_id") or "")
            if not str(path) or not path.exists():
                raise FileNotFoundError(f"the model that built this index, {str(path)!r}, is not there; "
                                        "pass its directory (model_dir= / --model)")
            dtype = dtype or self.manifest.get("dtype", "float32")
            options = index_model_options(self.manifest)
            if model_dir is not None and is_adapter_dir(path):  # the adapter given, not the index's: its
                options["adapter"] = None  # fingerprint is checked below (it was ignored: issue 33 item 2)
            self.model, self.tokenizer = load_causal_lm(path, dtype=dtype, device=device, **options)
        if self.manifest.get("chat_template") and self.tokenizer is not None and template_of(self.tokenizer) is None:
            set_chat_template(self.tokenizer, self.manifest["chat_template"])  # the template the build used
        if given:
            check_index_tokenizer(self.manifest, self.tokenizer, self.dir)
        build = self.manifest["build"]
        try:
            spec = self.index.projection
        except ValueError as e:
            raise IndexMismatchError(str(e)) from None
        route = self.manifest.get("config", {}).get("route", "auto")
        self.model.requires_grad_(False)
        transforms, optimizer = self._optimizer_transforms(optimizer_state)
        if transforms is None:  # the row basis's side maps (an Adam index has the raw basis)
            transforms = capture_transforms(self.basis)
        try:
            self.space = RowSpace(spec, transforms)  # (what the index's rows hold of each layer)
            self.capture = GradientCapture(self.model, self.layer_names, ProjectedRows(self.space, route))
        except ValueError as e:  # another architecture: the index's layers are not there
            raise IndexMismatchError(
                f"this model does not fit the index in {str(self.dir)!r}: the index's {e}; query with the model "
                "the index was built from, or rebuild the index"
            ) from None
        now = {"model_fingerprint": model_fingerprint(self.model), "projection": spec.to_dict(),
               "adapter_fingerprint": adapter_fingerprint(self.model),
               "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
               "optimizer": optimizer,
               "layers": layer_identity(self.space)}
        diffs = identity_differences(build, now)
        if diffs:
            raise IndexMismatchError(
                f"this model does not fit the index in {str(self.dir)!r}: " + "; ".join(diffs)
                + ". Query with the model the index was built from, or rebuild the index")
        if self.pad_id is None:
            self.pad_id = resolve_pad_id(self.model, self.tokenizer)

    def _optimizer_transforms(self, path) -> tuple[dict | None, dict | None]:
        """The Adam transforms the build applied to every row, so queries get the same (or none)."""
        rec = self.manifest["build"].get("optimizer")
        if not rec:
            return None, None
        path = Path(path or self.manifest.get("config", {}).get("optimizer_state", ""))
        if not path.is_file():
            raise FileNotFoundError(f"this index's rows are Adam-preconditioned and queries need the same optimizer "
                                    f"state, but {str(path)!r} is not there; pass it (optimizer_state= / "
                                    "--optimizer-state)")
        return adam_capture_transforms(path, rec["mode"], self.model, self.layer_names)

    def select_layers(self, patterns: Sequence[str] | str | None) -> list[str]:
        """Layer names matching glob ``patterns`` (all loaded layers when ``None``), model order."""
        have = getattr(self, "layers", self.layer_names)
        if not patterns:
            return have
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        out = [n for n in have if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not out:
            raise ValueError(f"layer patterns {patterns} match no indexed layer; layers look like "
                             f"{have[:2]} ({len(have)} in all, see `gradindex info {self.dir}`)")
        return out

    @property
    def indices(self) -> IndexSet:
        """The FAISS indices of :attr:`layers`, loaded on first use: :meth:`search` (and so :meth:`query`)
        needs them, exact :meth:`scores` do not (an index built with ``--no-index`` answers those)."""
        return self.index.load_indices(self.layers, self._use_gpu)

    def close(self) -> None:
        if self._owns_index:
            self.index.close()

    def __enter__(self) -> QueryEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- queries ------------------------------------------------------------------------------
    def tokenize(self, queries: list, text_field: str = "text") -> QueryTokens:
        """Records → tokens, truncated to the build's max length (flagged per query)."""
        self._need_model()
        recs = [as_record(q, text_field) if not isinstance(q, dict) else q for q in queries]
        max_length = int(self.manifest["build"]["max_length"])  # and no longer than the model's positions
        max_length = min(max_length, max_positions(self.model) or max_length)
        return tokenize_queries(recs, self.tokenizer, max_length, text_field, vocab_size=vocab_size(self.model))

    def gradients(self, tokens: QueryTokens) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
        """Per-layer projected query gradients ``{layer: [Q, D]}`` (CPU float32), losses, token counts."""
        self._need_model()
        B = batch_size_of(self.manifest)
        parts, loss, ntok = [], [], []
        with self.capture:
            for s in range(0, len(tokens), B):
                bg = batch_gradients(self.model, self.capture, tokens.input_ids[s:s + B],
                                     tokens.labels[s:s + B], self.pad_id)
                parts.append({n: v.float().cpu() for n, v in bg.grads.items()})
                loss.append(bg.loss.float().cpu().numpy())
                ntok.append(bg.num_tokens.cpu().numpy())
        shapes = {n: (v["rows"], v["cols"]) for n, v in self.manifest["build"]["layers"].items()}
        grads = {n: torch.from_numpy(to_rows(self.basis, n, torch.cat([p[n] for p in parts]).numpy(), shapes[n]))
                 for n in parts[0]}
        if not all(torch.isfinite(v).all() for v in grads.values()):
            raise ValueError("a query's gradient is not finite (overflow in the model); try dtype float32")
        return grads, np.concatenate(loss), np.concatenate(ntok)

    def query(self, query, **kwargs) -> QueryResult:
        """One query (text, ``(prompt, completion)``, token ids or record); see :meth:`query_batch`."""
        return self.query_batch([query], **kwargs)[0]

    def query_batch(self, queries, k: int = 10, method: str | None = None, damping: float = DEFAULT_DAMPING,
                    layers: Sequence[str] | str | None = None, lowest: int = 0, rerank_full: int | None = None,
                    candidates: int | None = None, shortlist: int | None = None, nprobe: int | None = None,
                    texts: bool = True, text_field: str = "text",
                    refine: RefineConfig | bool | None = None) -> list[QueryResult]:
        """Answer a batch of queries: capture, precondition, (refine), search and exact re-rank of the stored
        rows (the first stage), texts; the exact (full-space) stage only on request.

        ``k`` results per query (best first), ``lowest`` most negative ones on request,
        ``rerank_full=C``: the exact stage, the top ``C`` candidates of the index re-scored in full
        (unprojected) space under ``method`` (:mod:`gradindex.query.full`; ``kfac``/``ekfac`` need the
        full-space fit, ``gradindex precondition --space full``), the best ``k`` of them returned; the
        union of the batch's candidates is recomputed once (:func:`~gradindex.query.full.full_scores_batch`).
        ``None`` (default) or ``0``: the first stage answers (:data:`~gradindex.query.full.DEFAULT_RERANK`);
        on a budget-bound index a note says how to ask for the exact stage and what it costs (:meth:`rerank_plan`);
        ``candidates`` (ANN results per layer), ``shortlist`` (kept per layer after exact
        per-layer scoring) and the index's ``nprobe`` tune the ANN search (docs/query.md);
        ``refine``: a :class:`~gradindex.query.refine.RefineConfig` (``None``: the engine's default,
        ``False``: none) refines kfac/ekfac query vectors against the model's Gauss-Newton matrix
        (docs/query.md, "Refined queries"), in the exact stage's full space too.
        """
        t0 = time.perf_counter()
        check_damping(damping)
        self.index.check_current()  # before the gradient pass: refused at once when a build replaced the index
        asked, method = method, self.resolve_method(method)
        refine = self.refine_config(refine, method)
        rerank_full, hint = self.rerank_plan(method, rerank_full)
        full_pre = self.full_preconditioner(method) if rerank_full else None
        rerank_full = min(rerank_full, self.n)
        tokens = self.tokenize(as_records(queries, text_field), text_field)
        grads, loss, ntok = self.gradients(tokens)
        t_grad = time.perf_counter() - t0
        if refine is not None:
            grads = self.refined_rows(tokens, grads, method, damping, self.select_layers(layers), refine)
        t_refine = time.perf_counter() - t0 - t_grad
        results = self.search(grads, k=max(k, rerank_full), method=asked, damping=damping, layers=layers,
                              lowest=lowest, candidates=candidates, shortlist=shortlist, nprobe=nprobe,
                              texts=texts)  # (asked: None lets the search fall back from the default, with a note)
        for j, r in enumerate(results):
            r.num_tokens, r.loss, r.truncated = int(ntok[j]), float(loss[j]), tokens.truncated[j]
            r.seconds["gradient"] = t_grad
            if refine is not None:
                r.seconds["refine"] = t_refine
                r.notes.append(f"query refined: {refine.method}, {refine.steps} steps, Gauss-Newton products over "
                               f"{min(refine.sample, self.n)} training examples")
            if r.truncated:
                r.notes.append(f"query {j} was longer than the index's max length "
                               f"({self.manifest['build']['max_length']} tokens) and was truncated")
                log.info(r.notes[-1])
        per_token = t_grad / max(1, sum(map(len, tokens.input_ids)))  # (this batch's gradient pass, a token)
        if rerank_full:
            run_steps(self._exact_stage(results, tokens, rerank_full, full_pre, damping, refine, per_token))
        else:
            q_mean = sum(map(len, tokens.input_ids)) / max(1, len(tokens))
            self._first_stage(results, hint, per_token * (self._example_tokens() or q_mean) if hint else 0.0)
        for r in results:
            r.hits = r.hits[:k]
        return results

    def _first_stage(self, results: list[QueryResult], hint: str | None, per_candidate: float) -> None:
        """Label the results as the first stage's; on a budget-bound index, the note on the exact stage (with
        its cost here: a forward + backward per candidate, ``per_candidate`` seconds: this batch's own gradient
        seconds per token times a training example's tokens), logged once."""
        stage = "first stage" if stored_share(self.manifest) < 1 else "index rows"
        if hint:
            cost = EXACT_STAGE_C * per_candidate
            hint += (f"; it costs a forward + backward per candidate, about {_secs(cost)} a query here for "
                     f"C = {EXACT_STAGE_C} (docs/query.md, \"Two stages\")")
            if not self._hinted:
                self._hinted = True
                log.info(hint)
        for r in results:
            r.stage = stage
            if hint:
                r.notes.append(hint)

    def _example_tokens(self) -> float:
        """Mean tokens of a training example (the first shard's, read once; 0 where unknown)."""
        if self._mean_tokens is None:
            try:
                got = self.store.shard_columns(0, ["num_tokens"], 0, self.store.sizes[0])["num_tokens"]
            except (AttributeError, IndexError, KeyError):  # (a store without the column)
                got = np.zeros(0)
            self._mean_tokens = float(np.mean(got)) + 1 if len(got) else 0.0
        return self._mean_tokens

    def rerank_plan(self, method: str, rerank_full: int | None) -> tuple[int, str | None]:
        """``(C, note)``: the candidates to re-rank in full space (the exact stage), and, when the default
        (``None``: :data:`DEFAULT_RERANK`, none) leaves a budget-bound index's first stage to answer, the note
        saying how to ask for the exact stage and what it needs.

        An explicit ``C`` is taken as asked (what it needs missing is an error at the re-rank). The
        note goes with an index whose rows are a budget-bound projection
        (:func:`~gradindex.query.full.budget_bound`) and a method with a full-space form."""
        if rerank_full is not None:
            if rerank_full < 0:
                raise ValueError(f"rerank_full must be >= 0 (candidates to re-rank in full space), got {rerank_full}")
            return rerank_full, None
        base, _ = parse_method(method)
        if not budget_bound(self.manifest) or base not in FULL_SPACE_METHODS:
            return DEFAULT_RERANK, None
        needs = "the training data"
        if method_spec(base).fitted is not None and base not in self.manifest.get("full_space", {}):
            needs = (f"the full-space {base} fit (`gradindex precondition {self.dir} --method {base} --space full`) "
                     f"and {needs}")
        if self.texts.unavailable():
            needs += f" (not found: {self.texts.problem}; pass --data)"
        return DEFAULT_RERANK, (
            f"first-stage scores: this index stores {stored_share(self.manifest):.2%} of each example's gradient "
            f"(a budget-bound projection). The exact stage re-scores the top C in full space on request, "
            f"--rerank-full {EXACT_STAGE_C} (rerank_full={EXACT_STAGE_C}); it needs {needs}")

    def resolve_method(self, method: str | None = None) -> str:
        """``method``, or when None the index's default query method (``ekfac-selfnorm`` where it answers
        ``ekfac``, else its :meth:`base_method`: :func:`~gradindex.query.defaults.default_query_method`)."""
        return method or default_query_method(self.manifest, self.dir)

    def base_method(self, method: str | None = None) -> str:
        """``method``, or when None the index's default base method (``ekfac`` where it answers it, else ``kfac``,
        ``adam``, ``graddot``): what the commands built on the method itself use (explain, the audit report)."""
        return method or default_method(self.manifest, self.dir)

    def full_preconditioner(self, method: str) -> Preconditioner:
        """The full-space preconditioner of ``method`` (identity for graddot/cosine), loaded once."""
        base, _ = parse_method(method)
        if base not in self._full_pre:
            self._full_pre[base] = load_full_preconditioner(self.dir, base, self.curvature_cache_bytes)
        pre = self._full_pre[base]
        if pre.cache.budget != self.curvature_cache_bytes:  # (the budget changed since it was loaded)
            pre.cache.budget = self.curvature_cache_bytes
            pre.cache.clear()
        return pre

    def check_exact(self, method: str) -> None:
        """Refuse at once an exact stage of ``method`` that would fail: no full-space fit, no training data."""
        self.full_preconditioner(method)
        if self.texts.unavailable():
            raise ValueError("the exact stage (full-space re-rank) needs the training data the index was built "
                             f"from ({self.texts.problem}); pass data= / --data")

    def scores(self, queries, method: str | None = None, damping: float = DEFAULT_DAMPING,
               layers: Sequence[str] | str | None = None, text_field: str = "text",
               refine: RefineConfig | bool | None = None) -> np.ndarray:
        """``[Q, N]`` float64 exact scores of every query against every training example.

        Column ``j`` is training example ``j``; row ``i`` is query ``i``. ``queries``: a batch as
        :meth:`query_batch` takes it, or per-layer projected gradients ``{layer: [Q, D]}``.
        The same numbers as the hits of :meth:`query_batch` (which ranks them), computed without
        the FAISS indices by streaming the store (:func:`gradindex.query.scores.score_matrix`).
        ``refine`` as in :meth:`query_batch` (queries given as gradients are scored as they are).
        """
        self.index.check_current()
        asked, method = method, self.resolve_method(method)
        chosen = self.select_layers(layers)
        if isinstance(queries, Mapping):
            grads = queries
        else:
            tokens = self.tokenize(as_records(queries, text_field), text_field)
            grads, _, _ = self.gradients(tokens)
            refine = self.refine_config(refine, method)
            if refine is not None:
                grads = self.refined_rows(tokens, grads, method, damping, chosen, refine)
        out = score_matrix(self.index, grads, asked, damping, chosen)  # (None: the default, with its fallback)
        note = self.baked_note(parse_method(method)[0], damping)
        if note:  # (an array has no notes: the log says it, once a call)
            log.warning(note)
        return out

    def baked_note(self, base: str, damping: float) -> str | None:
        """What a call is told when its ``damping`` is not the one behind ``base``'s scores here: rows whitened
        at build (:func:`gradindex.manifest.baked_damping`) answer with the damping they bake in, whatever the
        query's (:meth:`RowBasis.damping_used`); ``None`` where the query's damping is the one used."""
        used = self.basis.damping_used(base, damping)
        if used is None or used == damping:
            return None
        raw = REBUILD_RAW.get(self.basis.kind, "--transcode none")
        return (f"the rows of this index bake in damping {used:g} (whitened at build; a query's damping does not "
                f"change them): damping {damping:g} has no effect on --method {base} here (build with {raw} to "
                "choose the damping per query)")

    # -- refinement ---------------------------------------------------------------------------
    def refine_config(self, refine: RefineConfig | bool | None, method: str) -> RefineConfig | None:
        """The refinement a call asked for, checked against ``method``: ``None`` takes the engine's default
        (skipped for methods without an inverse curvature), ``True`` the default settings, ``False`` none."""
        asked = refine is not None
        cfg = RefineConfig() if refine is True and self.refine is None else (
            self.refine if refine is None or refine is True else (refine or None))
        if cfg is None:
            return None
        base, _ = parse_method(method)
        on_rows = index_row_base(self.manifest, self.dir, base, method)
        whitened_ekfac = base == "ekfac" and self.basis.kind == "ekfac"
        if method_spec(base).fitted is None or (on_rows != base and not whitened_ekfac):
            if not asked:
                return None
            raise ValueError(f"query refinement improves an EK-FAC/K-FAC inverse-curvature product; method "
                             f"{method!r} on this index's {self.basis.kind!r} rows has none (use --method ekfac, or "
                             "drop --refine)")
        return cfg

    @property
    def refiner(self) -> Refiner:
        """The engine's :class:`~gradindex.query.refine.Refiner` (training sample, curvature, cache), made once."""
        self._need_model()
        if self._refiner is None:
            self._refiner = Refiner(self.model, self.capture, self.space, self.pad_id, self._refine_sample,
                                    self._row_curvature, gradients=self._sample_gradients)
        return self._refiner

    def refined_rows(self, tokens: QueryTokens, grads: Mapping[str, torch.Tensor], method: str, damping: float,
                     layers: Sequence[str], refine: RefineConfig) -> dict[str, torch.Tensor]:
        """Query rows ``{layer: [Q, D]}`` refined under ``refine`` (cached per query and setting)."""
        return self.refiner.rows(tokens, grads, method, damping, list(layers), refine)

    def _refine_sample(self, cfg: RefineConfig) -> tuple[list[list[int]], list[list[int]]]:
        """The training sample of the curvature products: ``cfg.sample`` rows drawn with ``cfg.seed``."""
        rng = np.random.default_rng(cfg.seed)
        ids = np.sort(rng.choice(self.n, min(cfg.sample, self.n), replace=False)).astype(np.int64)
        x, y, ok = self.texts.tokens(ids)
        if len(x) != len(ids) or not ok.all():
            why = self.texts.problem or "its rows changed since the build"
            raise ValueError(f"query refinement takes curvature products on training examples and needs the data the "
                             f"index was built from ({why}); pass data= / --data")
        return x, y

    def _sample_gradients(self, ids: list[list[int]], labels: list[list[int]]) -> dict[str, torch.Tensor]:
        """Stored-basis rows of training examples captured as a query's are (Fisher refinement's sample)."""
        grads, _, _ = self.gradients(QueryTokens([], ids, labels, [False] * len(ids)))
        return grads

    def _row_curvature(self, base: str, damping: float, layer: str):
        if self.basis.kind == "ekfac":
            b = self.basis
            return eigenbasis_curvature(b.Q_S[layer], b.Q_A[layer], b.scale[layer], b.damping)
        return preconditioner_curvature(self.pre.get(base), layer, damping)

    def search(self, grads: dict[str, torch.Tensor | np.ndarray], k: int = 10, method: str | None = None,
               damping: float = DEFAULT_DAMPING, layers: Sequence[str] | str | None = None, lowest: int = 0,
               candidates: int | None = None, shortlist: int | None = None, nprobe: int | None = None,
               texts: bool = True) -> list[QueryResult]:
        """Search with given per-layer query rows ``{layer: [Q, D]}`` (as :meth:`gradients` gives them)."""
        t0 = time.perf_counter()
        check_damping(damping)
        self.index.check_current()
        defaulted, method = method is None, self.resolve_method(method)
        asked, selfnorm = parse_method(method)
        base = index_row_base(self.manifest, self.dir, asked, method)  # the operation on stored rows
        self.pre.check(base, selfnorm)
        used = self.basis.damping_used(asked, damping)
        chosen = self.select_layers(layers)
        missing = [n for n in chosen if n not in grads]
        if missing:
            raise ValueError(f"query gradients lack layers {missing[:3]}; pass rows for every chosen layer")
        notes = [note for note in [self.baked_note(asked, damping)] if note]
        scale = None
        if selfnorm:
            try:
                scale = self._selfnorm_scale(base, damping, chosen)
            except UNAVAILABLE as exc:  # the default's self-influence: fall back to the base method, saying so
                if not defaulted:
                    raise
                notes.append(fallback_note(method, asked, exc))
                log.warning(notes[-1])
                method, selfnorm = asked, False
        if notes:
            log.info(notes[-1])
        if k < 1 or lowest < 0:
            raise ValueError(f"k must be >= 1 and lowest >= 0, got k={k}, lowest={lowest}")
        if k > self.n or lowest > self.n:
            notes.append(f"k={max(k, lowest)} is larger than the index ({self.n} examples); "
                         f"returning {self.n}")
            log.info(notes[-1])
            k, lowest = min(k, self.n), min(lowest, self.n)
        q = {n: torch.as_tensor(grads[n]).float().cpu() for n in chosen}
        m, u, _ = query_vectors(self.indices.space, self.pre, base, damping, q)
        t1 = time.perf_counter()
        cosine = base == "cosine"
        want = max(k, lowest)

        def exact(pos: list[int]) -> list[np.ndarray]:  # an approximate tier's fallback: every example scored
            return self._exact_candidates({n: v[pos] for n, v in q.items()}, method, damping, chosen, k, lowest)

        found = self.indices.candidates(CandidateRequest(chosen, u, m, k, lowest, cosine, scale, candidates,
                                                         shortlist, nprobe, exact))
        cands, short = found.ids, found.widened
        notes += found.notes
        t2 = time.perf_counter()
        ranked = S.rerank(self.rows, chosen, m, cosine, cands, k, lowest, scale)
        t3 = time.perf_counter()
        out = []
        for (top, low), widened in zip(ranked, short, strict=True):
            res = QueryResult(self._hits(top, chosen), self._hits(low, chosen), method, used, chosen,
                              notes=list(notes))
            if widened:
                res.notes.append(f"the approximate search found fewer than {want} candidates; every example "
                                 "was scored exactly instead")
            res.seconds = {"precondition": t1 - t0, "search": t2 - t1, "rerank": t3 - t2}
            out.append(res)
        if texts and self.tokenizer is not None:
            self._attach_texts(out)
        return out

    # -- internals ----------------------------------------------------------------------------
    def _attach_texts(self, out: list[QueryResult]) -> None:
        """Each hit's training text (read once per distinct id), its time, and any note on the texts."""
        t4 = time.perf_counter()
        ids = np.unique(np.concatenate([[h.id for h in r.hits + r.lowest] for r in out]).astype(np.int64))
        by_id = dict(zip(ids.tolist(), self.texts.texts(ids), strict=True))
        for r in out:
            for h in r.hits + r.lowest:
                h.text = by_id.get(h.id)
            r.seconds["texts"] = time.perf_counter() - t4
            if self.texts.problem and self.texts.problem not in r.notes:
                r.notes.append(self.texts.problem)

    @staticmethod
    def _hits(r: S.Ranked, layers: list[str]) -> list[Hit]:
        return [Hit(int(i), float(s), {n: float(v) for n, v in zip(layers, ls, strict=True)})
                for i, s, ls in zip(r.ids, r.scores, r.layer_scores, strict=True)]

    def _exact_candidates(self, q: dict[str, torch.Tensor], method: str, damping: float, layers: list[str],
                          k: int, lowest: int) -> list[np.ndarray]:
        """Candidates from exact scores of every example, streamed from the store (memory: a block)."""
        return S.top_and_bottom(score_matrix(self.index, q, method, damping, layers), k, lowest)

    def _selfnorm_scale(self, base: str, damping: float, layers: list[str]) -> np.ndarray:
        """``[N]`` ``1/sqrt(self-influence)`` (0 for a zero row), computed once per setting."""
        key = (base, damping, tuple(layers))
        if key not in self._scales:
            si = self.index.self_influence(base, damping, layers)
            self._scales[key] = np.where(si > 0, 1.0 / np.sqrt(np.where(si > 0, si, 1.0)), 0.0)
        return self._scales[key]

    def exact_steps(self, results: list[QueryResult], queries, top: int, damping: float = DEFAULT_DAMPING,
                    refine: RefineConfig | bool | None = None,
                    text_field: str = "text") -> Generator[tuple[int, int], None, list[QueryResult]]:
        """The exact stage of first-stage ``results`` (of :meth:`query_batch` with ``rerank_full=0`` and ``k >=
        top``) for the same ``queries``, one forward + backward a step: a generator that yields ``(candidate
        passes done, total)`` and returns the results re-ranked as ``query_batch(rerank_full=top)`` would
        (``gradindex serve`` answers the first stage at once and runs these steps between other requests).
        What the stage needs is checked here, at the call, not at the first step."""
        def steps(work):
            yield from work
            return results

        if not results:
            return steps(())
        method = results[0].method
        refine = self.refine_config(refine, method)
        top = min(top, self.n)
        if any(len(r.hits) < top for r in results):
            raise ValueError(f"the exact stage of the top {top} needs first-stage results with at least {top} hits "
                             f"(query with k >= {top})")
        self.check_exact(method)
        pre = self.full_preconditioner(method)
        tokens = self.tokenize(as_records(queries, text_field), text_field)
        # (the batch's gradient seconds, which every result of one query_batch carries, per query token)
        per_token = results[0].seconds.get("gradient", 0.0) / max(1, sum(map(len, tokens.input_ids)))
        return steps(self._exact_stage(results, tokens, top, pre, damping, refine, per_token))

    def _exact_stage(self, results: list[QueryResult], tokens: QueryTokens, top: int, pre: Preconditioner,
                     damping: float, refine: RefineConfig | None,
                     per_token: float) -> Generator[tuple[int, int], None, None]:
        """Re-score each result's top ``top`` in full space, the union of the batch's candidates recomputed
        once, one forward + backward a step; announce its estimated time first (:attr:`announce`), record the
        seconds it took."""
        t0 = time.perf_counter()
        heads = [r.hits[:top] for r in results]
        union = np.unique(np.concatenate([[h.id for h in hs] for hs in heads]).astype(np.int64))
        ids, labels, ok = self.texts.tokens(union)
        if len(ids) != len(union) or not ok.all():
            why = self.texts.problem or "its rows changed since the build"
            raise ValueError("the exact stage (full-space re-rank) needs the training data the index was built "
                             f"from ({why}); pass data= / --data")
        queries = [(tokens.input_ids[j], tokens.labels[j]) for j in range(len(results))]
        layers = results[0].layers
        refined = None
        if refine is not None and refine.steps:
            refined = [self.refiner.full_space(full_query_gradient(self.model, layers, q, self.pad_id), pre,
                                               damping, layers, refine) for q in queries]
        many = f" (the union of {sum(map(len, heads))} for {len(queries)} queries)" if len(queries) > 1 else ""
        work = sum(map(len, ids)) + sum(map(len, tokens.input_ids))
        self.announce(f"exact stage: {len(union)} candidates{many} re-scored in full space, about "
                      f"{_secs(work * per_token)} ({len(union) + len(queries)} forward + backward passes, {work:,} "
                      "tokens at this batch's own gradient seconds per token)")
        scores = yield from full_scores_steps(self.model, layers, queries, (ids, labels),
                                              [np.searchsorted(union, [h.id for h in hs]) for hs in heads],
                                              self.pad_id, results[0].method, batch_size_of(self.manifest),
                                              pre, damping, query_matrices=refined, on_batch=self._first_batch_rate())
        secs = time.perf_counter() - t0
        for r, hs, sc in zip(results, heads, scores, strict=True):
            for h, s in zip(hs, sc, strict=True):
                h.full_score = float(s)
            r.hits = sorted(hs, key=lambda h: (-h.full_score, h.id)) + r.hits[top:]
            r.seconds["rerank_full"] = secs
            r.reranked = len(hs)
            r.stage = f"full-space re-rank of the top {r.reranked}"
            r.notes.append(f"exact stage: {len(union)} candidates re-scored in full space in {secs:.1f} s"
                           + (f" (for {len(queries)} queries, their candidates' union)" if len(queries) > 1 else ""))
            if len(r.hits) > top:
                r.notes.append(f"results below rank {top} carry first-stage scores (raise --rerank-full)")

    def _first_batch_rate(self):
        """``on_batch`` of the exact stage: after its first batch, announce the measured time left (if over 5 s)."""
        said = [False]

        def on_batch(done: int, total: int, seconds: float) -> None:
            if not said[0] and done < total:
                said[0] = True
                left = seconds / done * (total - done)
                if left > 5:
                    self.announce(f"exact stage: {_secs(seconds / done)} a candidate on the first batch, about "
                                  f"{_secs(left)} to go ({total - done} candidates)")

        return on_batch

    def _need_model(self) -> None:
        if self.capture is None:
            raise RuntimeError("this engine was opened with load_model=False; it answers search(grads) only")
