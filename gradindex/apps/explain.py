"""Token-level explanations: which tokens of a training example (and of the query) make its score.

A layer's per-example gradient is a sum over tokens, ``Ĝ = Σ_t ḡ_t ā_tᵀ`` (``ḡ_t = P_g g_t``,
``ā_t = P_a a_t``), so the score ``⟨M q, Ĝ⟩`` of a training example splits exactly into one term
per training token::

    score_t = Σ_layers ⟨M q, ḡ_t ā_tᵀ⟩ = Σ_layers ḡ_tᵀ (M q) ā_t

with ``M`` the method's ``H⁻¹`` (identity for graddot and adam), applied to the query as the engine does.
The factors are rebuilt on demand by re-running the example through the model with the engine's
own capture (:class:`gradindex.capture.TokenFactors`). The query side is the same
decomposition over the query's tokens against the training example's stored vector ``t``:
``Σ_layers ḡ_sᵀ (M t) ā_s`` (``M`` is symmetric, so ``⟨q, M t⟩ = ⟨M q, t⟩``). Both sides sum to
the example's score (up to the storage code's rounding when the store is not float32).

Token ``t``'s term is the part of the score carried by the layers' inputs at position ``t``;
``g_t`` there collects the losses of every later target token (attention mixes positions), so a
prompt token with no loss of its own can still carry score.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradindex.capture import TokenFactors
from gradindex.capture.batch import batch_gradients
from gradindex.data import IGNORE
from gradindex.index.space import query_vectors
from gradindex.methods import DEFAULT_DAMPING, all_methods, index_row_base, parse_method
from gradindex.query import QueryEngine
from gradindex.query.full import full_gradient_scores
from gradindex.query.inputs import as_records
from gradindex.spec.build import batch_size_of
from gradindex.spec.manifest import Manifest
from gradindex.store.basis import rows_dual, to_rows

METHODS = all_methods("explain", selfnorm=False)
"""Methods whose score splits per token (``adam``: an index built with factored Adam preconditioning): the
registry's ``explain`` methods (:data:`gradindex.methods.REGISTRY`; read again at each call)."""

# per layer, one (ḡ [T, rows], ā [T, cols]) pair per call of the layer
Factors = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass
class TokenScores:
    """One sequence's tokens with the score each carries."""

    ids: list[int]
    tokens: list[str]
    """Each token decoded on its own (joined, they give the text back)."""
    scores: list[float]
    """Each token's term of the score, summed over layers."""
    target: list[bool]
    """Whether the loss is taken on the token (prompt and first tokens are not targets)."""
    layer_totals: dict[str, float]
    """Each layer's sum over tokens."""

    @property
    def total(self) -> float:
        return float(np.sum(self.scores, dtype=np.float64))

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "ids": self.ids, "scores": self.scores, "target": self.target,
                "total": self.total, "layer_totals": self.layer_totals}


@dataclass
class Explanation:
    """Why training example ``id`` scores what it does for a query."""

    id: int
    score: float
    """The example's exact score from its stored vector (what the engine ranks by)."""
    method: str
    damping: float | None
    layers: list[str]
    train: TokenScores
    """The training example's tokens; they sum to ``score``."""
    query: TokenScores
    """The query's tokens against the example's stored vector; they sum to ``score``."""
    residual_cause: str = ""
    """Why ``score`` and the training tokens' sum differ (:attr:`residual`)."""
    full_score: float | None = None
    """With ``full_space``: the example's exact full-space score, what the exact stage (``--rerank-full C``)
    ranks by (docs/query.md, "Two stages"); ``score`` and the token terms are the stored rows'."""

    @property
    def residual(self) -> float:
        """``score`` minus the sum of the training tokens' terms: the stored row is the score's, the terms
        are of the gradient re-captured now (they differ by the storage code's rounding)."""
        return self.score - self.train.total

    def to_dict(self) -> dict:
        return {"id": self.id, "score": self.score, "method": self.method, "damping": self.damping,
                "layers": self.layers, "train": self.train.to_dict(), "query": self.query.to_dict(),
                "residual": self.residual, "residual_cause": self.residual_cause, "full_score": self.full_score}


def residual_cause(manifest: Manifest) -> str:
    """Why an explanation's training-token terms do not sum exactly to its score, for this index's rows."""
    storage = manifest.storage
    if storage in ("fp32", "float32"):
        return ("float round-off: the score is the query against the stored float32 row, the terms are of the "
                "example's gradient re-captured now")
    return (f"the stored row is {storage}-coded: the score (what the index ranks by) is the query against that "
            f"coded row, the training tokens' terms are of the example's exact gradient re-captured now, so they "
            f"differ by the {storage} code's rounding (the query tokens' terms are against the coded row and sum "
            "to the score)")


class Explainer:
    """Token-level explanations on an open :class:`QueryEngine` (model and preconditioners resident).

    Training examples' factors are cached (``cache`` examples, least recently used dropped), so a
    report that explains the same example for many queries re-runs it once. Not thread-safe (the
    engine is not).
    """

    def __init__(self, engine: QueryEngine, cache: int = 256):
        if engine.capture is None:
            raise ValueError("token explanations re-run examples through the model: open the engine with it "
                             "(load_model=True)")
        self.engine = engine
        self.cache = cache
        self._factors: OrderedDict[int, tuple[list[int], list[int], Factors]] = OrderedDict()

    # -- factors ------------------------------------------------------------------------------
    def factors(self, ids: list[list[int]], labels: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[Factors]]:
        """Per-layer projected gradients ``{layer: [B, D]}`` and each example's per-token factors."""
        e = self.engine
        cap = e.capture
        B = batch_size_of(e.manifest)
        grads: list[dict[str, torch.Tensor]] = []
        out: list[Factors] = []
        with cap, cap.visiting(TokenFactors(e.space)) as tokens:
            for s in range(0, len(ids), B):
                bg = batch_gradients(e.model, cap, ids[s:s + B], labels[s:s + B], e.pad_id)
                parts = tokens.take()
                grads.append({n: v.float().cpu() for n, v in bg.grads.items()})
                for j, x in enumerate(ids[s:s + B]):
                    T = len(x)
                    out.append({n: [(gb[j, :T].cpu(), ab[j, :T].cpu()) for gb, ab in calls]
                                for n, calls in parts.items()})
        return {n: torch.cat([g[n] for g in grads]) for n in grads[0]}, out

    def _train_factors(self, ids: list[int]) -> list[tuple[list[int], list[int], Factors]]:
        todo = [i for i in dict.fromkeys(ids) if i not in self._factors]
        if todo:
            tok_ids, labels = self.engine.texts.require("explaining a training example re-runs it, which needs the "
                                                        "training data", np.array(todo, dtype=np.int64))
            _, facs = self.factors(tok_ids, labels)
            for i, x, y, f in zip(todo, tok_ids, labels, facs, strict=True):
                self._factors[i] = (x, y, f)
        out = []
        for i in ids:
            self._factors.move_to_end(i)
            out.append(self._factors[i])
        while len(self._factors) > max(self.cache, len(set(ids))):
            self._factors.popitem(last=False)
        return out

    # -- explanations -------------------------------------------------------------------------
    def explain(self, query, ids: Sequence[int] | int, method: str | None = None, damping: float = DEFAULT_DAMPING,
                layers: Sequence[str] | str | None = None, text_field: str = "text",
                full_space: bool = False) -> list[Explanation]:
        """One explanation per training row in ``ids`` for ``query`` (any form ``QueryEngine.query`` takes);
        ``full_space``: also each example's exact full-space score (:attr:`Explanation.full_score`: a forward +
        backward per example; kfac/ekfac need the full-space fit)."""
        e = self.engine
        e.index.check_current()
        method = e.base_method(method)  # (the default: ekfac itself, not the query default ekfac-selfnorm)
        base, selfnorm = parse_method(method)
        usable = all_methods("explain", selfnorm=False)
        if selfnorm or base not in usable:
            raise ValueError(f"token explanations split a score linear in both gradients: method is one of "
                             f"{', '.join(usable)}, not {method!r}")
        on_rows = index_row_base(e.manifest, e.dir, base, method)  # whitened rows: e.g. ekfac = graddot on them
        e.pre.check(on_rows)
        ids = [ids] if isinstance(ids, int | np.integer) else [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < e.n]
        if bad:
            raise ValueError(f"training ids {bad[:3]} are not in the index (0..{e.n - 1})")
        chosen = e.select_layers(layers)
        if not ids:
            return []
        tokens = e.tokenize(as_records([query], text_field), text_field)
        q_ids, q_labels = tokens.input_ids[0], tokens.labels[0]
        q_grads, (q_fac,) = self.factors([q_ids], [q_labels])
        shapes = {n: e.space.dims(n) for n in chosen}
        q_rows = {n: torch.from_numpy(to_rows(e.basis, n, q_grads[n].numpy(), shapes[n])) for n in chosen}
        refine = e.refine_config(None, method)  # the engine's refinement (--refine), where the method has one
        if refine is not None:  # the training side splits the refined score; the query side stays EK-FAC's
            q_rows = e.refined_rows(tokens, q_rows, method, damping, chosen, refine)
        m, _, _ = query_vectors(e.indices.space, e.pre, on_rows, damping, q_rows)
        stored = e.store.read_rows(np.array(ids, dtype=np.int64), chosen)
        mt = {n: e.pre.apply(on_rows, n, torch.from_numpy(stored[n].astype(np.float64)), -1.0, damping).numpy()
              for n in chosen}  # M t of every example, [n, D] per layer

        def captured(vec: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # against stored → against captured rows
            return {n: rows_dual(e.basis, n, v, shapes[n]) for n, v in vec.items()}

        out = []
        for j, (i, (x, y, fac)) in enumerate(zip(ids, self._train_factors(ids), strict=True)):
            train = self._scores(x, y, fac, captured({n: m[n][0] for n in chosen}))
            query_side = self._scores(q_ids, q_labels, q_fac, captured({n: mt[n][j] for n in chosen}))
            score = float(sum(float(np.dot(m[n][0], stored[n][j].astype(np.float64))) for n in chosen))
            out.append(Explanation(i, score, base, e.basis.damping_used(base, damping), chosen, train, query_side,
                                   residual_cause(e.index.described)))
        if full_space:
            self._full_scores(out, (q_ids, q_labels), method, damping, chosen)
        return out

    def _full_scores(self, out: list[Explanation], query: tuple[list[int], list[int]], method: str, damping: float,
                     layers: list[str]) -> None:
        """Fill :attr:`Explanation.full_score` (the exact stage's score of each example)."""
        e = self.engine
        if not out:
            return
        ids, labels = e.texts.require("the full-space score re-runs the example, which needs the training data",
                                      np.array([x.id for x in out], dtype=np.int64))
        scores = full_gradient_scores(e.model, layers, query, (ids, labels), e.pad_id, method,
                                      batch_size_of(e.manifest),
                                      e.full_preconditioner(method), damping)
        for x, s in zip(out, scores, strict=True):
            x.full_score = float(s)

    def _scores(self, ids: list[int], labels: list[int], fac: Factors, vec: dict[str, np.ndarray]) -> TokenScores:
        """Per-token terms ``Σ_layers ḡ_tᵀ V ā_t`` of one sequence against per-layer vectors ``V``."""
        T = len(ids)
        total = np.zeros(T, dtype=np.float64)
        layer_totals = {}
        for n, v in vec.items():
            rows, cols = self.engine.space.dims(n)
            V = torch.from_numpy(np.asarray(v, dtype=np.float64).reshape(rows, cols))
            s = torch.zeros(T, dtype=torch.float64)
            for gb, ab in fac[n]:
                s += ((gb.double() @ V) * ab.double()).sum(dim=1)
            total += s.numpy()
            layer_totals[n] = float(s.sum())
        tok = self.engine.tokenizer
        return TokenScores(list(ids), [tok.decode([t], clean_up_tokenization_spaces=False) for t in ids],
                           total.tolist(), [t > 0 and lab != IGNORE for t, lab in enumerate(labels)], layer_totals)


def explain(engine: QueryEngine, query, ids: Sequence[int] | int, method: str | None = None,
            damping: float = DEFAULT_DAMPING, layers: Sequence[str] | str | None = None,
            text_field: str = "text", full_space: bool = False) -> list[Explanation]:
    """Token-level explanations of training rows ``ids`` for ``query`` (see :class:`Explainer`)."""
    return Explainer(engine).explain(query, ids, method, damping, layers, text_field, full_space)
