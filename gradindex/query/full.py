"""Re-rank candidates in full (unprojected) space, for every method, without forming their gradients.

The projection preserves inner products only in expectation; for the candidates a lookup returns,
the query's full per-layer gradient ``G_q = Σ_t g_t a_tᵀ`` is rebuilt (one example: a dense
``[N_o, N_i(+1)]`` matrix per layer), preconditioned once, ``M = (H + δI)⁻¹ G_q`` with the
full-space curvature (:func:`gradindex.precondition.load_full_preconditioner`), and each candidate is
scored from its per-token factors (:class:`~gradindex.capture.visitors.FullTokens`, one forward +
backward per batch of candidates) as ``⟨M, G_t⟩ = Σ_t g_tᵀ M a_t``, never storing ``G_t`` (a batch's
dense ``G_t = Σ_t g_t a_tᵀ`` is formed a few examples at a time, dotted with every query's ``M`` at once,
then dropped):

* ``graddot``: ``M = G_q``; ``cosine``: divided by ``‖G_q‖ ‖G_t‖``, with
  ``‖G_t‖² = Σ_{t,s} (g_t·g_s)(a_t·a_s)`` from the factors;
* ``kfac`` / ``ekfac``: ``M = (H + δI)⁻¹ G_q``, ``δ = damping × mean(Λ)`` per layer;
* ``<method>-selfnorm``: divided by ``sqrt`` of the candidate's full-space self-influence
  (``‖G_t‖²`` for GradDot; ``Σ_ij R_ij² / (Λ_ij + δ)`` with ``R = Σ_t (Q_Sᵀ g_t)(Q_Aᵀ a_t)ᵀ`` otherwise).

A batch of queries (:func:`full_scores_batch`) recomputes the union of their candidates once: one
forward + backward per batch of that union, each candidate scored against every query's ``M`` (queries
in chunks of :data:`QUERY_CHUNK_BYTES` of ``M``).

Memory: the full-space curvature is streamed (:func:`~gradindex.precondition.load_full_preconditioner`), a
layer read when its hook runs, at most the preconditioner's cache budget held at once; a query's ``M`` is formed
a layer at a time in its backward hook (``G_q`` is never held whole) into one ``[Q, N_o, N_i(+1)]`` tensor per
layer (no stacked copy). What stays is the model, the chunk's ``M`` (float32, the hooked parameters' size per
query) and one forward + backward's activations.

The two stages of a batch's results (docs/query.md, "Two stages"): the first stage's label and, on a budget-bound
index, its note on the exact stage (:func:`rerank_plan`); the exact stage, each result's top ``C`` re-scored
(:class:`ExactStage`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from gradindex.capture import FullTokens, GradientCapture
from gradindex.capture.batch import batch_gradients
from gradindex.methods import DEFAULT_DAMPING, method_spec, parse_method
from gradindex.precondition import load_full_preconditioner
from gradindex.precondition.apply import damped
from gradindex.precondition.fullspace import budget_bound, stored_share
from gradindex.precondition.preconditioner import Preconditioner
from gradindex.query.inputs import QueryTokens
from gradindex.query.refine import RefineConfig, Refiner
from gradindex.query.search import QueryResult
from gradindex.query.texts import TrainingTexts
from gradindex.spec.build import DEFAULT_BATCH_SIZE

DEFAULT_RERANK = 0
"""Candidates the default query re-ranks in full space (``QueryEngine.query_batch(rerank_full=None)``): none,
the default query is the first stage. On a LoRA-fine-tuned SmolLM2-135M-Instruct (160 chat records, 24
LoRA retrainings) the first stage scored halves LDS 0.596, exhaustive full-space EK-FAC 0.520 (the first
stage higher on 17 of 20 queries), and the exact stage of the top 100 took 120-263 s a query on 2 CPU cores
against ~1.5 s (docs/query.md, "Two stages"). ``rerank_full=C`` asks for it."""
EXACT_STAGE_C = 30
"""The ``C`` the first stage's note suggests for ``--rerank-full C``, from the first stage's measured recall of
exhaustive full-space EK-FAC (``benchmarks/results/real-llm.json`` ``exact_stage_parts``): on a LoRA-fine-tuned
SmolLM2-135M (160 records, 21 queries) its top 30 held the exact stage's first result for 21 of 21 queries (top 10:
20 of 21) and 0.84 of its top 10 (0.91 at 50, 0.76 at 20); on GPT-2 4x256 (``width.json``) 0.96 of the top 10 at
20 and all of it at 50. Each candidate costs a forward + backward."""
QUERY_CHUNK_BYTES = 2 << 30
"""At most this many bytes of the queries' full-space matrices ``M`` (``Σ N_o N_i(+1)`` numbers a query) are
held at once: a batch of queries is scored in chunks, one pass over each chunk's union of candidates."""
DENSE_BYTES = 256 << 20
"""At most this many bytes of a candidate batch's dense per-layer gradients are formed at once."""
FULL_SPACE_METHODS = ("graddot", "cosine", "kfac", "ekfac")
"""Methods :func:`full_gradient_scores` answers (each also ``-selfnorm``)."""
T = TypeVar("T")
__all__ = ["DEFAULT_RERANK", "EXACT_STAGE_C", "FULL_SPACE_METHODS", "budget_bound", "full_gradient_scores",
           "full_query_gradient", "full_scores_batch", "full_scores_steps", "run_steps", "stored_share"]


def full_query_gradient(model: nn.Module, layers: list[str], query: tuple[list[int], list[int]], pad_id: int,
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """layer → the query's full gradient ``G_q`` ``[N_o, N_i(+1)]`` (summed token loss), in ``dtype``."""
    out: dict[str, torch.Tensor] = {}

    def visit(name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        G = g[0].to(dtype).T @ a[0].to(dtype)
        out[name] = out[name] + G if name in out else G

    with GradientCapture(model, layers, FullTokens(visit)) as cap:
        batch_gradients(model, cap, [query[0]], [query[1]], pad_id)
    return out


def full_gradient_scores(model: nn.Module, layers: list[str], query: tuple[list[int], list[int]],
                         train: tuple[list[list[int]], list[list[int]]], pad_id: int, method: str = "graddot",
                         batch_size: int = DEFAULT_BATCH_SIZE, pre: Preconditioner | None = None,
                         damping: float = DEFAULT_DAMPING, dtype: torch.dtype = torch.float32,
                         query_matrices: dict[str, torch.Tensor] | None = None) -> np.ndarray:
    """``[n]`` float64 full-space scores of one query against ``n`` training examples (module docstring).

    ``pre``: the full-space preconditioner of a ``kfac``/``ekfac`` method (ignored for
    ``graddot``/``cosine``). Arithmetic in ``dtype`` (float32 by default; float64 for references).
    ``query_matrices``: layer → ``M`` to score with instead of ``(H + δI)⁻¹ G_q`` (a refined query,
    :meth:`gradindex.query.refine.Refiner.full_space`).
    """
    every = np.arange(len(train[0]))
    return full_scores_batch(model, layers, [query], train, [every], pad_id, method, batch_size, pre, damping,
                             dtype, None if query_matrices is None else [query_matrices])[0]


def full_scores_batch(*args, **kwargs) -> list[np.ndarray]:
    """Per query ``q``, float64 full-space scores of the training examples ``wanted[q]``: :func:`full_scores_steps`
    (the same arguments) run to the end."""
    return run_steps(full_scores_steps(*args, **kwargs))


def run_steps(steps: Generator[Any, None, T]) -> T:
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def full_scores_steps(model: nn.Module, layers: list[str], queries: Sequence[tuple[list[int], list[int]]],
                      train: tuple[list[list[int]], list[list[int]]], wanted: Sequence[np.ndarray], pad_id: int,
                      method: str = "graddot", batch_size: int = DEFAULT_BATCH_SIZE, pre: Preconditioner | None = None,
                      damping: float = DEFAULT_DAMPING, dtype: torch.dtype = torch.float32,
                      query_matrices: Sequence[dict[str, torch.Tensor] | None] | None = None,
                      on_batch: Callable[[int, int, float], None] | None = None
                      ) -> Generator[tuple[int, int], None, list[np.ndarray]]:
    """Per query ``q``, float64 full-space scores of the training examples ``wanted[q]`` (positions in ``train``,
    the union of every query's candidates), in that order, returned by a generator that does one forward +
    backward per step and yields ``(candidate passes done, total)`` after each (the model's hooks are off
    between steps: other work may use the model, as ``gradindex serve`` does between an exact stage's steps).

    One forward + backward per batch of the union (per chunk of queries, :data:`QUERY_CHUNK_BYTES`), each
    candidate scored against every query's ``M``; the per-candidate norms of ``cosine`` / ``-selfnorm`` once
    per candidate. ``query_matrices[q]``: layer → ``M`` instead of ``(H + δI)⁻¹ G_q``. ``on_batch(done,
    total, seconds)`` after each candidate batch (``done`` of ``total`` candidate passes, their seconds so far).
    """
    base, selfnorm = parse_method(method)
    fitted = method_spec(base).fitted is not None
    if fitted and (pre is None or pre.is_identity or pre.method != base):
        raise ValueError(f"full-space {base} scores need the full-space {base} preconditioner "
                         "(gradindex.precondition.load_full_preconditioner)")
    if not queries:
        return []
    wanted = [np.asarray(w, dtype=np.int64) for w in wanted]
    given = list(query_matrices) if query_matrices is not None else [None] * len(queries)
    out: list[np.ndarray] = [np.zeros(0)] * len(queries)
    chunks = _chunks(list(range(len(queries))), _chunk_size(model, layers, dtype))
    passes = _Passes(on_batch, sum(len(np.unique(np.concatenate([wanted[q] for q in c]))) for c in chunks))
    for chunk in chunks:
        M: dict[str, torch.Tensor] = {}  # layer → [Qc, N_o, N_i(+1)], each query's filled in place
        q_norms = []
        for j, q in enumerate(chunk):
            q_norms.append(_query_matrix(model, layers, queries[q], pad_id, base, pre, damping, dtype, given[q],
                                         M, j, len(chunk)))
            yield passes.done, passes.total
        union = np.unique(np.concatenate([wanted[q] for q in chunk]))
        dots, sq = yield from _candidate_pass(model, layers, train, union, pad_id, batch_size, M, len(chunk),
                                              _norm_kind(base, selfnorm, fitted), pre, damping, dtype, passes)
        for j, q in enumerate(chunk):
            at = np.searchsorted(union, wanted[q])
            out[q] = _finish(dots[at, j], sq[at], base, selfnorm, q_norms[j])
        del M
    return out


def _chunks(items: list, size: int) -> list[list]:
    return [items[s:s + size] for s in range(0, len(items), size)]


def _chunk_size(model: nn.Module, layers: list[str], dtype: torch.dtype) -> int:
    """Queries whose full-space ``M`` fit in :data:`QUERY_CHUNK_BYTES` together (at least one)."""
    numbers = sum(i.n_out * i.n_in_total for i in GradientCapture(model, layers).infos.values())  # (no hooks)
    per_query = max(1, numbers * torch.finfo(dtype).bits // 8)
    return max(1, QUERY_CHUNK_BYTES // per_query)


def _query_matrix(model, layers, query, pad_id, base: str, pre, damping: float, dtype: torch.dtype,
                  given: dict[str, torch.Tensor] | None, M: dict[str, torch.Tensor], j: int, count: int) -> float:
    """Query ``j``'s ``M`` (``given``, else ``(H + δI)⁻¹ G_q``; ``G_q`` for graddot/cosine) into ``M[layer][j]``
    (``[count, N_o, N_i(+1)]``, allocated on first use); its ``‖G_q‖`` (cosine, else 0).

    ``(H + δI)⁻¹ G_q`` is formed a layer at a time in the backward hook (linear: a layer visited twice adds
    two terms), each layer's curvature read only then (a streamed preconditioner), so neither the whole
    ``G_q`` nor every layer's curvature is held beside ``M``."""
    fitted = method_spec(base).fitted is not None
    if given is not None:
        q_norm = 0.0
        if base == "cosine":
            Gq = full_query_gradient(model, layers, query, pad_id, dtype)
            q_norm = float(torch.sqrt(sum(G.double().square().sum() for G in Gq.values())))
            del Gq
        device = next(model.parameters()).device
        for n in layers:
            X = given[n].to(device, dtype)
            _slot(M, n, count, X)[j] = X
        return q_norm

    def visit(name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        G = g[0].to(dtype).T @ a[0].to(dtype)
        X = pre.apply(name, G.reshape(1, -1), -1.0, damping).reshape(G.shape) if fitted else G
        _slot(M, name, count, X)[j] += X

    with GradientCapture(model, layers, FullTokens(visit)) as cap:
        batch_gradients(model, cap, [query[0]], [query[1]], pad_id)
    if base != "cosine":
        return 0.0
    return float(torch.sqrt(sum(M[n][j].double().square().sum() for n in layers)))


def _slot(M: dict[str, torch.Tensor], layer: str, count: int, like: torch.Tensor) -> torch.Tensor:
    """``M[layer]``, allocated (zeros ``[count, *like.shape]``, ``like``'s device and dtype) on first use."""
    if layer not in M:
        M[layer] = torch.zeros((count, *like.shape), dtype=like.dtype, device=like.device)
    return M[layer]


def _norm_kind(base: str, selfnorm: bool, fitted: bool) -> str:
    """What a candidate's norm is: ``gram`` (``‖G_t‖²``), ``eig`` (full-space self-influence) or ``none``."""
    if base == "cosine" or (selfnorm and not fitted):
        return "gram"
    return "eig" if selfnorm and fitted else "none"


class _Passes:
    """Counts candidate passes across chunks and their seconds (the queries' own passes not counted), and
    reports each batch (``on_batch``)."""

    def __init__(self, on_batch, total: int):
        self.on_batch, self.total, self.done, self.seconds = on_batch, total, 0, 0.0

    def add(self, n: int, seconds: float) -> None:
        self.done += n
        self.seconds += seconds
        if self.on_batch is not None:
            self.on_batch(self.done, self.total, self.seconds)


def _dense_dots(a: torch.Tensor, g: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``[B, Q]``: ``⟨M_q, G_b⟩`` with ``G_b = g[b]ᵀ a[b]``, formed a few examples at a time (:data:`DENSE_BYTES`)."""
    Mf = M.reshape(M.shape[0], -1)
    step = max(1, DENSE_BYTES // max(1, Mf.shape[1] * a.element_size()))
    parts = []
    for s in range(0, a.shape[0], step):
        G = torch.bmm(g[s:s + step].transpose(1, 2), a[s:s + step])  # [b, N_o, N_i(+1)]
        parts.append(G.reshape(G.shape[0], -1) @ Mf.T)
    return torch.cat(parts)


def _candidate_pass(model, layers: list[str], train, rows: np.ndarray, pad_id: int, batch_size: int,
                    M: dict[str, torch.Tensor], count: int, norm: str, pre, damping: float, dtype: torch.dtype,
                    passes: _Passes) -> Generator[tuple[int, int], None, tuple[np.ndarray, np.ndarray]]:
    """``([n, count] dots, [n] squared norms)`` of training examples ``rows`` against the ``count`` queries' ``M``,
    one batch a step (hooked for that batch only); a layer's curvature (``eig`` norms) is read in its hook."""
    t_ids, t_labels = train
    dots = np.zeros((len(rows), count))
    norms = np.zeros(len(rows))
    cur: dict[str, torch.Tensor] = {}

    def visit(name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        a, g = a.to(dtype), g.to(dtype)
        d = _dense_dots(a, g, M[name])  # [B, Q]: Σ_t g_tᵀ M_q a_t
        if norm == "gram":
            sq = ((g @ g.transpose(1, 2)) * (a @ a.transpose(1, 2))).sum(dim=(1, 2))  # ‖G_t‖²
        elif norm == "eig":
            Q_S, Q_A, Lam = pre._tensors(name, a.device, dtype)
            R = torch.bmm((g @ Q_S).transpose(1, 2), a @ Q_A)  # [B, N_o, N_i(+1)]
            sq = (R.square() * damped(Lam, pre.delta(name, damping), -1.0)).sum(dim=(1, 2))
        else:
            sq = torch.zeros(d.shape[0], dtype=d.dtype, device=d.device)
        cur["dot"] = cur["dot"] + d if "dot" in cur else d
        cur["sq"] = cur["sq"] + sq if "sq" in cur else sq

    for s in range(0, len(rows), batch_size):
        t0 = time.perf_counter()
        cur.clear()
        idx = rows[s:s + batch_size]
        with GradientCapture(model, layers, FullTokens(visit)) as cap:
            batch_gradients(model, cap, [t_ids[i] for i in idx], [t_labels[i] for i in idx], pad_id)
        e = s + len(cur["dot"])
        dots[s:e] = cur["dot"].double().cpu().numpy()
        norms[s:e] = cur["sq"].double().cpu().numpy()
        passes.add(len(idx), time.perf_counter() - t0)
        yield passes.done, passes.total
    return dots, norms


def _finish(dots: np.ndarray, norms: np.ndarray, base: str, selfnorm: bool, q_norm: float) -> np.ndarray:
    """The method's scores from the dots and the candidates' squared norms."""
    if base == "cosine":
        denom = q_norm * np.sqrt(np.maximum(norms, 0.0))
        return np.where(denom > 0, dots / np.where(denom > 0, denom, 1.0), 0.0)
    if selfnorm:
        return np.where(norms > 0, dots / np.sqrt(np.where(norms > 0, norms, 1.0)), 0.0)
    return dots


# -- the two stages on a batch's results ---------------------------------------------------------------
def secs(x: float) -> str:
    """Seconds for a message: ``0.25 s``, ``3.1 s``, ``120 s``."""
    return f"{x:.0f} s" if x >= 10 else f"{x:.2g} s"


def per_token(results: list[QueryResult], tokens: QueryTokens) -> float:
    """The batch's gradient seconds (which every result of one query batch carries) per query token."""
    return results[0].seconds.get("gradient", 0.0) / max(1, sum(map(len, tokens.input_ids)))


def rerank_plan(manifest: dict, index_dir, texts: TrainingTexts, method: str,
                rerank_full: int | None) -> tuple[int, str | None]:
    """``(C, note)``: the candidates to re-rank in full space (an explicit ``C`` as asked), and where the default
    (:data:`DEFAULT_RERANK`) leaves a budget-bound index (:func:`budget_bound`) with a full-space method to its first
    stage, the note saying how to ask for the exact stage and what it needs."""
    if rerank_full is not None:
        if rerank_full < 0:
            raise ValueError(f"rerank_full must be >= 0 (candidates to re-rank in full space), got {rerank_full}")
        return rerank_full, None
    base, _ = parse_method(method)
    if not budget_bound(manifest) or base not in FULL_SPACE_METHODS:
        return DEFAULT_RERANK, None
    needs = "the training data"
    if method_spec(base).fitted is not None and base not in manifest.get("full_space", {}):
        needs = (f"the full-space {base} fit (`gradindex precondition {index_dir} --method {base} --space full`) "
                 f"and {needs}")
    if texts.unavailable():
        needs += f" (not found: {texts.problem}; pass --data)"
    return DEFAULT_RERANK, (
        f"first-stage scores: this index stores {stored_share(manifest):.2%} of each example's gradient "
        f"(a budget-bound projection). The exact stage re-scores the top C in full space on request, "
        f"--rerank-full {EXACT_STAGE_C} (rerank_full={EXACT_STAGE_C}: on a real fine-tune its top {EXACT_STAGE_C} held "
        f"the exact stage's first result for every query measured, 0.84 of its top 10); it needs {needs}")


def label_first_stage(results: list[QueryResult], tokens: QueryTokens, manifest: dict, hint: str | None,
                      example_tokens: float | None) -> str | None:
    """Label the results as the first stage's, with the note on the exact stage (``hint``) and its cost: this batch's
    gradient seconds per token times ``example_tokens`` (else a query's) a candidate; the note returned."""
    stage = "first stage" if stored_share(manifest) < 1 else "index rows"
    if hint:
        q_mean = sum(map(len, tokens.input_ids)) / max(1, len(tokens))
        per_candidate = per_token(results, tokens) * (example_tokens or q_mean)
        hint += (f"; it costs a forward + backward per candidate, about {secs(EXACT_STAGE_C * per_candidate)} a query "
                 f"here for C = {EXACT_STAGE_C} (docs/query.md, \"Two stages\")")
    for r in results:
        r.stage = stage
        if hint:
            r.notes.append(hint)
    return hint


def example_tokens(store) -> float:
    """Mean tokens of a training example (the first shard's; 0 where unknown)."""
    try:
        got = store.shard_columns(0, ["num_tokens"], 0, store.sizes[0])["num_tokens"]
    except (AttributeError, IndexError, KeyError):  # (a store without the column)
        got = np.zeros(0)
    return float(np.mean(got)) + 1 if len(got) else 0.0


def check_heads(results: list[QueryResult], top: int) -> None:
    """Refuse first-stage results too short for an exact stage of the top ``top``."""
    if any(len(r.hits) < top for r in results):
        raise ValueError(f"the exact stage of the top {top} needs first-stage results with at least {top} hits "
                         f"(query with k >= {top})")


def full_fit(loaded: dict[str, Preconditioner], index, method: str, budget: int | None) -> Preconditioner:
    """``method``'s full-space preconditioner, loaded once into ``loaded``, ``budget`` bytes of curvature held."""
    base, _ = parse_method(method)
    if base not in loaded:
        loaded[base] = load_full_preconditioner(index, base, budget)
    pre = loaded[base]
    if pre.cache.budget != budget:  # (the budget changed since it was loaded)
        pre.cache.budget = budget
        pre.cache.clear()
    return pre


def returning(results: list[QueryResult], work=()) -> Generator[tuple[int, int], None, list[QueryResult]]:
    """``work``'s steps, then ``results``."""
    yield from work
    return results


@dataclass
class ExactStage:
    """The exact stage of one method's first-stage results: full-space ``pre`` at ``damping``, with refinement."""

    model: nn.Module
    pad_id: int
    texts: TrainingTexts
    batch_size: int
    pre: Preconditioner
    damping: float
    announce: Callable[[str], None]
    refiner: Refiner | None = None
    refine: RefineConfig | None = None

    def run(self, results: list[QueryResult], tokens: QueryTokens,
            top: int) -> Generator[tuple[int, int], None, list[QueryResult]]:
        """Steps re-scoring each result's top ``top`` (yielding ``(passes done, total)``), returning the results."""
        return returning(results, self._steps(results, tokens, top, per_token(results, tokens)))

    def _steps(self, results: list[QueryResult], tokens: QueryTokens, top: int,
               per_token: float) -> Generator[tuple[int, int], None, None]:
        """The union of the results' top ``top`` re-scored once, its time announced first and recorded."""
        t0 = time.perf_counter()
        heads = [r.hits[:top] for r in results]
        union = np.unique(np.concatenate([[h.id for h in hs] for hs in heads]).astype(np.int64))
        ids, labels = self.texts.require("the exact stage (full-space re-rank) needs the training data", union)
        queries = [(tokens.input_ids[j], tokens.labels[j]) for j in range(len(results))]
        layers = results[0].layers
        refined = None
        if self.refiner is not None:
            refined = [self.refiner.full_space(full_query_gradient(self.model, layers, q, self.pad_id), self.pre,
                                               self.damping, layers, self.refine) for q in queries]
        many = f" (the union of {sum(map(len, heads))} for {len(queries)} queries)" if len(queries) > 1 else ""
        work = sum(map(len, ids)) + sum(map(len, tokens.input_ids))
        self.announce(f"exact stage: {len(union)} candidates{many} re-scored in full space, about "
                      f"{secs(work * per_token)} ({len(union) + len(queries)} forward + backward passes, {work:,} "
                      "tokens at this batch's own gradient seconds per token)")
        scores = yield from full_scores_steps(self.model, layers, queries, (ids, labels),
                                              [np.searchsorted(union, [h.id for h in hs]) for hs in heads],
                                              self.pad_id, results[0].method, self.batch_size, self.pre,
                                              self.damping, query_matrices=refined, on_batch=self._first_batch_rate())
        secs_taken = time.perf_counter() - t0
        for r, hs, sc in zip(results, heads, scores, strict=True):
            for h, s in zip(hs, sc, strict=True):
                h.full_score = float(s)
            r.hits = sorted(hs, key=lambda h: (-h.full_score, h.id)) + r.hits[top:]
            r.seconds["rerank_full"] = secs_taken
            r.reranked = len(hs)
            r.stage = f"full-space re-rank of the top {r.reranked}"
            r.notes.append(f"exact stage: {len(union)} candidates re-scored in full space in {secs_taken:.1f} s"
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
                    self.announce(f"exact stage: {secs(seconds / done)} a candidate on the first batch, about "
                                  f"{secs(left)} to go ({total - done} candidates)")

        return on_batch
