"""Width fidelity: how faithful budget-bound rows stay to exhaustive full-space EK-FAC (issue 16).

For models whose hooked gradient is many times the 256 KiB per-example budget, on real local text
(``fidelity.py``'s corpora and planted facts), per model shape:

1. train the model on the corpus (AdamW, ``fidelity.train_model``) until its held-out loss is well
   below the corpus's unigram loss (both reported);
2. build the library's **default** index (``gradindex build`` with no options: ``--projection auto``
   at the ``auto`` budget, EK-FAC fitted on the projected rows, int4 codes in its whitened eigenbasis)
   and score the queries with the library (``score_matrix``);
3. fit the library's **full-space** EK-FAC on it (``FitConfig(method="ekfac", space="full")``): the
   reference is exhaustive full-space EK-FAC, ``Σ_l ⟨R_q ⊘ (Λ* + δ), R_t⟩`` with
   ``R = Q_Sᵀ G Q_A`` rotated from each example's per-token factors
   (:class:`~gradindex.capture.visitors.FullTokens`) by the library's fitted eigenbases at
   ``δ = damping × mean(Λ*)`` per layer;
4. score the same queries with **alternative stored rows** at the same number of int4 numbers
   per example as the default (one float32 scale per row and layer, as the store codes them;
   query rows unquantized, as the library's are), all built in the full-space EK-FAC eigenbasis:

   * ``eig-block``: per layer the top ``k_g × k_a`` block of the Kronecker eigenbasis (the
     eigenvectors of ``S`` and ``A`` with the largest eigenvalues), the default's per-layer sizes;
     ``eig-block-reldamp`` is the same rows at the damping a fit on them alone would use
     (``0.001 × mean`` of their own ``Λ*``, larger than the full-space one);
   * ``eig-select``: per layer the individual eigen-coordinates ``(i, j)`` of largest ``Λ*``, the
     default's per-layer counts; ``eig-select-global``: the same, with one threshold on
     ``Λ*_ij / δ_l`` over all layers (budget follows the influence, not the width);
   * ``sketch``: a seeded CountSketch of each layer's whole whitened row, per-layer sizes ∝ the
     layer's effective dimension ``Σ Λ*/(Λ*+δ)``;
   * ``select+sketch``: half the numbers to ``eig-select-global``, half to a sketch of the rest.

Metrics against the reference, over held-out queries: mean Spearman over the training set and
top-10 overlap; over the planted-fact queries: the share whose planted example ranks first (and
the same for the reference itself). Bytes per example and seconds (build; rows) per scheme.

    python -m benchmarks.width                    # both shapes; writes benchmarks/results/width.json
    python -m benchmarks.width --shapes gpt2-4x256 --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.common import example_losses, query_gradients, spearman_rows, train_model  # noqa: E402
from benchmarks.fidelity import FidelityConfig, make_setup  # noqa: E402
from fixtures.tiny import tiny_gpt2  # noqa: E402
from gradindex.capture import (  # noqa: E402
    FullTokens,
    GradientCapture,
    ProjectionSpec,  # noqa: E402
)
from gradindex.capture.allocation import influence_share  # noqa: E402
from gradindex.capture.batch import batch_gradients  # noqa: E402
from gradindex.data import Tokenized  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402
from gradindex.precondition import FitConfig, fit_preconditioner, load_full_preconditioner  # noqa: E402
from gradindex.precondition.factors import projection_from_manifest  # noqa: E402
from gradindex.query.scores import score_matrix  # noqa: E402
from gradindex.spec.manifest import read_manifest  # noqa: E402
from gradindex.store import codes  # noqa: E402
from gradindex.store.basis import capture_transforms, index_basis, read_basis, to_rows  # noqa: E402
from gradindex.store.sizing import kept_share  # noqa: E402

DAMPING = 0.001


@dataclass(frozen=True)
class Shape:
    """One benchmark model: its architecture and the data/training recipe."""

    name: str
    arch: str
    """``gpt2`` or ``qwen2``."""
    n_layer: int
    hidden: int
    heads: int
    kv_heads: int = 0
    intermediate: int = 0
    data: FidelityConfig = FidelityConfig()


SHAPES = {
    "gpt2-4x256": Shape("gpt2-4x256", "gpt2", 4, 256, 4, data=FidelityConfig(
        n_train=1024, n_query=16, max_tokens=64, vocab=512, n_facts=8, steps=400, batch=16, lr=3e-3,
        corpora=("stdlib",))),
    "qwen2.5-0.5b-block": Shape("qwen2.5-0.5b-block", "qwen2", 1, 896, 14, 2, 4864, data=FidelityConfig(
        n_train=512, n_query=16, max_tokens=48, vocab=4096, n_facts=8, steps=120, batch=16, lr=2e-3,
        corpora=("stdlib",))),
}
"""GPT-2 4x256: 1024 training examples, so that C = 200 candidates are a fifth of the set. The Qwen
block (one decoder layer of Qwen2.5-0.5B's widths, its vocabulary cut to 4096): 512 examples of at
most 48 tokens, what one shared CPU core fits in the time (its full-space fit and reference rotate
every token by the 4864-wide eigenbasis); C = 100 is a fifth of that set. Its 120 steps leave the
held-out loss only a little below the unigram's; training longer on these 512 examples overfits (at 480
steps the held-out loss rose above the unigram's), so a better-trained block needs more examples."""
QUICK = {k: replace(s, n_layer=1, data=replace(s.data, n_train=48, n_query=4, steps=20, n_facts=2, vocab=512))
         for k, s in SHAPES.items()}
TIMED = {"gpt2-4x256": (16, (100,)), "qwen2.5-0.5b-block": (16, (100,))}
"""Per shape: held-out queries run through the engine (plus every fact query) and the ``rerank_full``
sizes C they run at (besides 0): a re-rank costs C forward+backward passes per query, on a CPU core
shared with other jobs here."""


def new_model(shape: Shape, vocab: int) -> torch.nn.Module:
    if shape.arch == "gpt2":
        return tiny_gpt2(vocab_size=vocab, n_layer=shape.n_layer, n_embd=shape.hidden, n_head=shape.heads,
                         n_positions=128, seed=0)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.n_layer, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


def unigram_loss(train: Tokenized, query: Tokenized, vocab: int) -> float:
    """Mean per-token cross-entropy of the query tokens under the training set's (add-one) unigram."""
    counts = np.ones(vocab)
    for s in train.input_ids:
        np.add.at(counts, s[1:], 1)
    logp = np.log(counts / counts.sum())
    toks = np.concatenate([s[1:] for s in query.input_ids])
    return float(-logp[toks].mean())


def mean_token_loss(model, data: Tokenized) -> float:
    return float(example_losses(model, data).sum() / sum(len(s) - 1 for s in data.input_ids))


# -- the library's indices --------------------------------------------------------------------------
def default_config(batch: int) -> BuildConfig:
    """What ``gradindex build`` with no options builds (cli/build.py)."""
    return BuildConfig(projection=ProjectionSpec(), batch_size=batch, storage="int4", precondition="ekfac",
                       damping=DAMPING, budget="auto", transcode="ekfac")


def eigen_config(batch: int) -> BuildConfig:
    """What ``gradindex build`` with no options builds now where the budget projects (``--projection-basis auto``)."""
    return BuildConfig(projection=ProjectionSpec(), batch_size=batch, storage="int4", damping=DAMPING, budget="auto",
                       basis="eigen")


def library_rows_scores(model, setup, idx: Path, queries: Tokenized, bcfg: BuildConfig) -> np.ndarray:
    """``[Q, N]`` the library's scores of ``queries`` on the index ``idx`` (method ekfac)."""
    man = read_manifest(idx)
    shapes = {n: (v["rows"], v["cols"]) for n, v in man["build"]["layers"].items()}
    qcfg = replace(bcfg, projection=projection_from_manifest(man))
    basis = index_basis(idx, man)
    q = query_gradients(model, setup.tokenizer, queries, qcfg, transforms=capture_transforms(basis))
    q = {n: to_rows(basis, n, v, shapes[n]) for n, v in q.items()}
    return np.asarray(score_matrix(idx, q, "ekfac", damping=DAMPING, device="cpu"), np.float64)


def row_bytes(man: dict) -> int:
    st = man["build"]["storage"]
    return sum(codes.row_bytes(st, v["rows"] * v["cols"]) for v in man["build"]["layers"].values())


# -- full-space rows ----------------------------------------------------------------------------------
def token_factors(model, layers: list[str], data: Tokenized, pad: int, batch: int) -> dict[str, list]:
    """layer → list of per-batch ``(a [B, T, N_i(+1)], g [B, T, N_o])`` float16 (padding zeroed)."""
    out: dict[str, list] = {n: [] for n in layers}

    def visit(name, a, g):
        out[name].append((a.half(), g.half()))

    model.requires_grad_(False)
    with GradientCapture(model, layers, FullTokens(visit)) as cap:
        for s in range(0, len(data), batch):
            batch_gradients(model, cap, data.input_ids[s:s + batch], data.labels[s:s + batch], pad)
    return out


def rotated(a: torch.Tensor, g: torch.Tensor, Q_S: torch.Tensor, Q_A: torch.Tensor) -> torch.Tensor:
    """``[B, N_o, N_i]`` ``Q_Sᵀ G Q_A`` from per-token factors, float32."""
    return (g.float() @ Q_S).transpose(1, 2) @ (a.float() @ Q_A)


# -- stored-row schemes (one layer at a time) ---------------------------------------------------------
@dataclass
class LayerRows:
    """One scheme's rows of one layer: the flat coordinates kept, their scale, and a sketch (if any)."""

    keep: torch.Tensor | None
    """``[d]`` flat indices of ``R`` kept exactly, or ``None``."""
    scale: torch.Tensor
    """``[N_o·N_i]`` the per-coordinate whitening ``(Λ* + δ)^{-1/2}`` this scheme uses."""
    sk_index: torch.Tensor | None = None
    """``[D']`` flat indices of the sketched coordinates; ``sk_bucket``/``sk_sign`` their bucket and sign."""
    sk_bucket: torch.Tensor | None = None
    sk_sign: torch.Tensor | None = None
    sk_size: int = 0

    @property
    def numbers(self) -> int:
        return (0 if self.keep is None else len(self.keep)) + self.sk_size

    def rows(self, R: torch.Tensor) -> torch.Tensor:
        W = R.reshape(len(R), -1) * self.scale  # [B, D]
        parts = [] if self.keep is None else [W[:, self.keep]]
        if self.sk_size:
            sk = torch.zeros(len(W), self.sk_size)
            sk.index_add_(1, self.sk_bucket, W[:, self.sk_index] * self.sk_sign)
            parts.append(sk)
        return torch.cat(parts, 1) if parts else W[:, :0]


def top_block(Lam: np.ndarray, k_g: int, k_a: int) -> np.ndarray:
    """Flat indices of the ``k_g × k_a`` block of rows/columns with the largest ``Λ*`` sums."""
    rows = np.argsort(-Lam.sum(1))[:k_g]
    cols = np.argsort(-Lam.sum(0))[:k_a]
    return (rows[:, None] * Lam.shape[1] + cols[None, :]).ravel()


def countsketch(flat: np.ndarray, size: int, seed: int) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(seed)
    return (torch.from_numpy(flat), torch.from_numpy(rng.integers(0, size, len(flat))),
            torch.from_numpy(rng.choice(np.array([-1.0, 1.0], np.float32), len(flat))))


def influence_blocks(shares: Mapping[str, np.ndarray], cap_numbers: int, steps: int = 64) -> dict[str, tuple[int, int]]:
    """layer → ``(k_a, k_g)``: the leading ``k_g × k_a`` block of each layer's eigen-coordinates, chosen
    greedily over all layers to keep the most influence share within ``cap_numbers`` numbers per example.

    ``shares``: layer → ``[n_g, n_a]`` shares (:func:`influence_share`) with both axes sorted by
    eigenvalue, largest first. Each step grows one layer's block by about ``1/steps`` of a side,
    the move with the most share per added number anywhere; the block's sides are returned as sizes
    (0 = the whole side, stored exactly, as :func:`allocate` does). Every layer keeps at least 1x1.
    """
    if cap_numbers < len(shares):
        raise ValueError(f"{cap_numbers} numbers per example cannot hold one number per layer for "
                         f"{len(shares)} layers; raise --budget")
    C = {n: np.pad(np.cumsum(np.cumsum(f, 0), 1), ((1, 0), (1, 0))) for n, f in shares.items()}  # [n_g+1, n_a+1]
    state = {n: [1, 1] for n in shares}  # [k_g, k_a]
    used = len(shares)

    def best_move(n: str) -> tuple[float, int, int, int] | None:
        kg, ka = state[n]
        n_g, n_a = shares[n].shape
        moves = []
        dg, da = min(max(1, n_g // steps), n_g - kg), min(max(1, n_a // steps), n_a - ka)
        if dg > 0:
            moves.append(((C[n][kg + dg, ka] - C[n][kg, ka]) / (dg * ka), dg * ka, dg, 0))
        if da > 0:
            moves.append(((C[n][kg, ka + da] - C[n][kg, ka]) / (da * kg), da * kg, 0, da))
        fits = [m for m in moves if m[1] <= cap_numbers - used]
        return max(fits) if fits else None

    moves = {n: best_move(n) for n in shares}
    while True:
        live = {n: m for n, m in moves.items() if m is not None}
        if not live:
            break
        n = max(live, key=lambda k: live[k][0])
        gain, cost, dg, da = live[n]
        if gain <= 0:
            break
        state[n][0] += dg
        state[n][1] += da
        used += cost
        moves = {k: best_move(k) for k in shares}
    out = {}
    for n, (kg, ka) in state.items():
        n_g, n_a = shares[n].shape
        out[n] = (0 if ka >= n_a else ka, 0 if kg >= n_g else kg)
    return out


def block_plans(lam: dict, kron: dict, delta: dict, scale: dict, total: int) -> dict[str, dict]:
    """The ``eig-block-*`` schemes: leading blocks sized over all layers by influence share
    (:func:`~gradindex.capture.allocation.influence_blocks`), from ``Λ*`` or from K-FAC's ``λ_S λ_Aᵀ``."""
    out: dict[str, dict] = {"eig-block-global": {}, "eig-block-kfac": {}, "eig-block-kfac-reldamp": {},
                            "eig-select-kfac-global": {}}
    for name, spec in (("eig-block-global", lam), ("eig-block-kfac", kron)):
        order = {n: (np.argsort(-spec[n].sum(1)), np.argsort(-spec[n].sum(0))) for n in spec}
        shares = {n: influence_share(spec[n], DAMPING)[r][:, c] for n, (r, c) in order.items()}
        sizes = influence_blocks(shares, total)
        for n, (k_a, k_g) in sizes.items():
            r, c = order[n]
            k_g, k_a = k_g or len(r), k_a or len(c)
            blk = torch.from_numpy((r[:k_g, None] * len(c) + c[None, :k_a]).ravel())
            out[name][n] = LayerRows(blk, scale[n])
            if name == "eig-block-kfac":
                L = lam[n]
                d2 = DAMPING * float(L.ravel()[blk.numpy()].mean())
                s2 = torch.from_numpy((1.0 / np.sqrt(np.maximum(L + d2, d2 / 2))).ravel().astype(np.float32))
                out["eig-block-kfac-reldamp"][n] = LayerRows(blk, s2)
    ratio = np.concatenate([(kron[n] / kron[n].mean()).ravel() for n in kron])
    thr = np.partition(ratio, len(ratio) - total)[len(ratio) - total]
    out["eig-select-kfac-estdamp"] = {}
    for n in kron:
        keep = np.flatnonzero((kron[n] / kron[n].mean()).ravel() >= thr)
        out["eig-select-kfac-global"][n] = LayerRows(torch.from_numpy(keep), scale[n])
        # what a build without the full correction pass can know: Λ* on the kept coordinates (the mean
        # square of the stored rows) and K-FAC's share of the mean there, so δ ≈ damping × mean_kept(Λ*) ×
        # mean(λ_S λ_A) / mean_kept(λ_S λ_A)
        d2 = DAMPING * float(lam[n].ravel()[keep].mean()) * float(kron[n].mean() / kron[n].ravel()[keep].mean())
        DAMP_CHECK[n] = {"exact": delta[n], "estimate": d2}
        s2 = torch.from_numpy((1.0 / np.sqrt(np.maximum(lam[n] + d2, d2 / 2))).ravel().astype(np.float32))
        out["eig-select-kfac-estdamp"][n] = LayerRows(torch.from_numpy(keep), s2)
    return out


DAMP_CHECK: dict[str, dict] = {}
"""layer → exact full-space δ and the estimate ``eig-select-kfac-estdamp`` uses (reported)."""


def plan_schemes(curv: dict, default_sizes: dict[str, tuple[int, int]], kron: dict, seed: int = 0) -> dict[str, dict]:
    """scheme → layer → :class:`LayerRows`, each scheme at (about) the default's numbers per example;
    ``kron``: layer → K-FAC's ``λ_S λ_Aᵀ`` in the same eigenbasis."""
    lam = {n: np.clip(c["Lambda"], 0, None) for n, c in curv.items()}
    delta = {n: DAMPING * float(v.mean()) for n, v in lam.items()}
    scale = {n: torch.from_numpy((1.0 / np.sqrt(np.maximum(lam[n] + delta[n], delta[n] / 2))).ravel()
                                 .astype(np.float32)) for n in lam}
    numbers = {n: k_g * k_a for n, (k_g, k_a) in default_sizes.items()}
    total = sum(numbers.values())
    out: dict[str, dict] = {s: {} for s in ("eig-block", "eig-block-reldamp", "eig-select", "eig-select-global",
                                            "sketch", "select+sketch")}
    ratio = np.concatenate([(lam[n] / delta[n]).ravel() for n in lam])
    thr_all = np.partition(ratio, len(ratio) - total)[len(ratio) - total] if total < len(ratio) else 0.0
    thr_half = np.partition(ratio, len(ratio) - total // 2)[len(ratio) - total // 2]
    eff = {n: float((lam[n] / (lam[n] + delta[n])).sum()) for n in lam}
    for li, (n, (k_g, k_a)) in enumerate(default_sizes.items()):
        L = lam[n]
        blk = top_block(L, k_g, k_a)
        out["eig-block"][n] = LayerRows(torch.from_numpy(blk), scale[n])
        d2 = DAMPING * float(L.ravel()[blk].mean())
        s2 = torch.from_numpy((1.0 / np.sqrt(np.maximum(L + d2, d2 / 2))).ravel().astype(np.float32))
        out["eig-block-reldamp"][n] = LayerRows(torch.from_numpy(blk), s2)
        sel = np.argsort(-L.ravel())[: numbers[n]]
        out["eig-select"][n] = LayerRows(torch.from_numpy(np.sort(sel)), scale[n])
        r = (L / delta[n]).ravel()
        out["eig-select-global"][n] = LayerRows(torch.from_numpy(np.flatnonzero(r >= thr_all)), scale[n])
        k = max(1, round(total * eff[n] / sum(eff.values())))
        out["sketch"][n] = LayerRows(None, scale[n], *countsketch(np.arange(L.size), k, seed + li), sk_size=k)
        keep = np.flatnonzero(r >= thr_half)
        rest = np.flatnonzero(r < thr_half)
        eff_rest = {m: float((lam[m] / (lam[m] + delta[m])).ravel()[(lam[m] / delta[m]).ravel() < thr_half].sum())
                    for m in [n]}
        out["select+sketch"][n] = (keep, rest, eff_rest[n])
    # the sketch half of select+sketch: sizes ∝ the effective dimension left outside the kept coordinates
    parts = out["select+sketch"]
    left = total - sum(len(k) for k, _, _ in parts.values())
    e_sum = sum(e for _, _, e in parts.values()) or 1.0
    for li, (n, (keep, rest, e)) in enumerate(list(parts.items())):
        k = max(1, round(left * e / e_sum)) if len(rest) else 0
        sk = countsketch(rest, k, seed + 100 + li) if k else (None, None, None)
        parts[n] = LayerRows(torch.from_numpy(keep), scale[n], *sk, sk_size=k)
    return out | block_plans(lam, {n: np.clip(v, 0, None) for n, v in kron.items()}, delta, scale, total)


def scheme_scores(factors_q: dict, factors_t: dict, curv: dict, plans: dict[str, dict],
                  storage: str = "int4") -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
    """``(reference [Q, N], scheme → [Q, N], scheme → seconds)``; train rows coded as ``storage``."""
    ref = None
    out: dict[str, np.ndarray] = {}
    secs = dict.fromkeys(plans, 0.0)
    for n, c in curv.items():
        Q_S = torch.from_numpy(c["Q_S"]).float()
        Q_A = torch.from_numpy(c["Q_A"]).float()
        lam = np.clip(c["Lambda"], 0, None)
        delta = DAMPING * float(lam.mean())
        ref_scale = torch.from_numpy((1.0 / np.sqrt(np.maximum(lam + delta, delta / 2))).ravel().astype(np.float32))
        Rq = torch.cat([rotated(a, g, Q_S, Q_A) for a, g in factors_q[n]])  # [Q, N_o, N_i]
        Wq = Rq.reshape(len(Rq), -1) * ref_scale
        q_rows = {s: plans[s][n].rows(Rq) for s in plans}
        del Rq
        cols, srows = [], {s: [] for s in plans}
        for a, g in factors_t[n]:
            R = rotated(a, g, Q_S, Q_A)
            cols.append((Wq @ (R.reshape(len(R), -1) * ref_scale).T).double())
            for s in plans:
                t0 = time.perf_counter()
                x = plans[s][n].rows(R).numpy()
                secs[s] += time.perf_counter() - t0
                xd = torch.from_numpy(codes.decode(*codes.encode(x, storage), storage, x.shape[1]))
                srows[s].append((q_rows[s] @ xd.T).double())
        part = torch.cat(cols, 1).numpy()
        ref = part if ref is None else ref + part
        for s in plans:
            p = torch.cat(srows[s], 1).numpy()
            out[s] = p if s not in out else out[s] + p
        print(f"    {n}: {tuple(c['Lambda'].shape)}", flush=True)
    return ref, out, secs


# -- metrics ----------------------------------------------------------------------------------------
def agreement(score: np.ndarray, ref: np.ndarray, k: int = 10) -> dict:
    top = np.argsort(-score, 1)[:, :k]
    rtop = np.argsort(-ref, 1)[:, :k]
    overlap = [len(set(a) & set(b)) / k for a, b in zip(top, rtop, strict=True)]
    return {"spearman": float(spearman_rows(score, ref).mean()), f"top{k}": float(np.mean(overlap))}


def fact_rank1(score: np.ndarray, rows: tuple[int, ...]) -> float:
    return float(np.mean([int(np.argmax(s)) == r for s, r in zip(score, rows, strict=True)])) if rows else float("nan")


CANDIDATES = (10, 20, 50, 100, 200)
"""First-stage sizes C whose recall of the reference top 10 is reported (an exact full-space re-rank
of those C returns exactly the reference's scores for them, so its final top-10 agreement is that recall)."""


def recall(scores: np.ndarray, ref: np.ndarray, k: int = 10) -> dict[str, float]:
    rtop = np.argsort(-ref, 1)[:, :k]
    order = np.argsort(-scores, 1)
    return {str(c): float(np.mean([len(set(o[:c]) & set(r)) / k for o, r in zip(order, rtop, strict=True)]))
            for c in CANDIDATES if c <= scores.shape[1]}


def measure(scores: np.ndarray, ref: np.ndarray, n_held: int, fact_rows) -> dict:
    return {**agreement(scores[:n_held], ref[:n_held]), "fact_rank1": fact_rank1(scores[n_held:], fact_rows),
            "top10_with_facts": agreement(scores, ref)["top10"],
            "recall_of_top10_at_C": recall(scores[:n_held], ref[:n_held])}


# -- one shape ----------------------------------------------------------------------------------------
def timed_build(model, tok, data: Tokenized, path: Path, bcfg: BuildConfig, data_id: str) -> tuple[float, dict]:
    """Build ``path`` afresh with ``bcfg`` (store, fit, transcode; no FAISS); ``(seconds, manifest)``."""
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    build_index(model, tok, data, path, bcfg, model_id="width", data_id=data_id, progress=False)
    return round(time.perf_counter() - t0, 1), read_manifest(path)


FACTOR_BYTES = 1536 << 20
"""At most this many bytes of float16 per-token factors are held at once (:func:`layer_groups`)."""


def layer_groups(layers: list[str], widths: dict[str, tuple[int, int]], tokens: int) -> list[list[str]]:
    """Whole transformer blocks (``...h.3.`` / ``...layers.3.``) packed into groups whose float16 factors
    over ``tokens`` tokens fit :data:`FACTOR_BYTES`: one factor capture (model pass) per group."""
    blocks: dict[str, list[str]] = {}
    for n in layers:
        m = re.match(r"^(.*?\.\d+)\.", n)
        blocks.setdefault(m.group(1) if m else n, []).append(n)
    groups: list[list[str]] = []
    used = FACTOR_BYTES + 1
    for names in blocks.values():
        size = 2 * tokens * sum(sum(widths[n]) for n in names)
        if used + size > FACTOR_BYTES:
            groups.append([])
            used = 0
        groups[-1] += names
        used += size
    return groups


def streamed_scores(model, layers: list[str], queries: Tokenized, train: Tokenized, pad: int, curv: dict,
                    plans: dict[str, dict]) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float], float]:
    """:func:`scheme_scores` one block of layers at a time (its per-token factors only in memory);
    also returns the factor capture's seconds."""
    ref, sims, secs, cap_s = None, {}, dict.fromkeys(plans, 0.0), 0.0
    widths = _full_shapes(model, layers)
    tokens = sum(len(x) for x in train.input_ids) + sum(len(x) for x in queries.input_ids)
    for group in layer_groups(layers, widths, tokens):
        t0 = time.perf_counter()
        fq, ft = token_factors(model, group, queries, pad, 8), token_factors(model, group, train, pad, 8)
        cap_s += time.perf_counter() - t0
        r, s, sec = scheme_scores(fq, ft, {n: curv[n] for n in group}, plans)
        del fq, ft
        ref = r if ref is None else ref + r
        for k, v in s.items():
            sims[k] = v if k not in sims else sims[k] + v
            secs[k] += sec[k]
    return ref, sims, secs, cap_s


def first_stage(scores: np.ndarray, ref: np.ndarray, n_held: int, fact_rows) -> dict:
    """Per query: recall of the reference top 10 in the first stage's top C, and (planted facts) the
    first-stage rank of the planted example (1 = first)."""
    rtop = np.argsort(-ref, 1)[:, :10]
    order = np.argsort(-scores, 1)
    per = {str(c): [round(len(set(o[:c]) & set(r)) / 10, 2) for o, r in zip(order, rtop, strict=True)]
           for c in CANDIDATES if c <= scores.shape[1]}
    fact_rank = [int(np.flatnonzero(order[n_held + j] == row)[0]) + 1 for j, row in enumerate(fact_rows)]
    return {"per_query_recall_at_C": {c: v[:n_held] for c, v in per.items()},
            "fact_query_recall_at_C": {c: float(np.mean(v[n_held:])) if fact_rows else None for c, v in per.items()},
            "fact_first_stage_rank": fact_rank,
            "min_recall_at_C": {c: float(np.min(v[:n_held])) for c, v in per.items()}}


def engine_rerank(model, tok, idx: Path, queries: Tokenized, ref: np.ndarray, n_held: int, fact_rows,
                  cands: tuple[int, ...], timed: int, log=print) -> dict:
    """The library's two stages through :class:`QueryEngine` (``rerank_full=C``, EK-FAC) on ``idx``
    (its full-space EK-FAC fitted): final top-10 agreement with the reference and seconds per query,
    next to the plain query's (``rerank_full=0``). ``timed``: held-out queries run through the engine per C
    and fact queries each (the first ``timed`` of both)."""
    from gradindex.index import IndexConfig, build_indices
    from gradindex.query import QueryEngine

    build_indices(idx, IndexConfig(), progress=False)
    rtop = np.argsort(-ref, 1)[:, :10]
    pick = sorted(set(range(min(timed, n_held))) | set(range(n_held, min(n_held + timed, len(queries)))))
    out: dict = {"queries": len(pick)}
    with QueryEngine(idx, model=model, tokenizer=tok) as e:
        recs = [{"input_ids": queries.input_ids[j], "labels": queries.labels[j]} for j in pick]
        e.query(recs[0], k=10, method="ekfac", damping=DAMPING, rerank_full=10, texts=False)  # warm-up
        for C in (0, *cands):
            top10, secs, exact, facts = [], [], [], []
            for j, rec in zip(pick, recs, strict=True):
                t0 = time.perf_counter()
                r = e.query(rec, k=10, method="ekfac", damping=DAMPING, rerank_full=C, texts=False)
                secs.append(time.perf_counter() - t0)
                got = [h.id for h in r.hits]
                if j < n_held:
                    top10.append(len(set(got) & set(rtop[j].tolist())) / 10)
                else:
                    facts.append(got[0] == fact_rows[j - n_held])
                if C:  # the re-ranked scores against the reference's (relative)
                    fs = np.array([h.full_score for h in r.hits])
                    exact.append(float(np.max(np.abs(fs - ref[j, got]) / np.abs(ref[j]).max())))
            row = {"top10": float(np.mean(top10)), "fact_rank1": float(np.mean(facts)) if facts else None,
                   "p50_s": round(float(np.percentile(secs, 50)), 3), "p95_s": round(float(np.percentile(secs, 95)), 3)}
            if exact:
                row["max_rel_score_diff"] = float(np.max(exact))
            out[str(C)] = row
            log(f"  engine rerank_full={C}: top10 {row['top10']:.3f} facts@1 {row['fact_rank1']} "
                f"p50 {row['p50_s']} s p95 {row['p95_s']} s", flush=True)
    return out


def load_or_train(shape: Shape, setup, vocab: int, work: Path) -> tuple[torch.nn.Module, float]:
    cfg = shape.data
    model = new_model(shape, vocab)
    dims = f"{shape.n_layer}x{shape.hidden}x{shape.intermediate}v{vocab}"
    ckpt = work / f"{shape.name}-{dims}-{cfg.retrain_key(cfg.corpora[0])}-{cfg.steps}.pt"
    t0 = time.perf_counter()
    if ckpt.exists():
        model.load_state_dict(torch.load(ckpt))
    else:
        train_model(model, setup.train.input_ids, cfg, seed=1000)
        torch.save(model.state_dict(), ckpt)
    return model.eval(), time.perf_counter() - t0


def file_data(setup, tok, max_tokens: int, work: Path, name: str) -> tuple[Tokenized, str]:
    """The training set as a JSONL file (what the engine reads texts and re-rank tokens from), tokenized back."""
    from gradindex.data import load_records, tokenize_records

    path = work / f"{name}-train.jsonl"
    path.write_text("".join(json.dumps({"text": tok.decode(x)}) + "\n" for x in setup.train.input_ids))
    return tokenize_records(load_records(path), tok, max_tokens), str(path)


def run_shape(shape: Shape, work: Path, log=print, eigen: bool = True, schemes: bool = True, reuse: bool = False,
              timed: tuple[int, tuple[int, ...]] = (1000, (50, 100, 200))) -> dict:
    cfg = shape.data
    setup = make_setup(cfg, cfg.corpora[0])
    tok = setup.tokenizer
    vocab = len(tok)
    model, train_s = load_or_train(shape, setup, vocab, work)
    train, data_id = file_data(setup, tok, cfg.max_tokens, work, shape.name)
    res: dict = {"shape": shape.__dict__ | {"data": cfg.__dict__}, "vocab": vocab,
                 "train_seconds": round(train_s, 1), "examples": len(train),
                 "query_token_loss": mean_token_loss(model, setup.query),
                 "unigram_token_loss": unigram_loss(train, setup.query, vocab)}
    log(f"[{shape.name}] trained ({train_s:.0f} s): held-out token loss {res['query_token_loss']:.3f}, "
        f"unigram {res['unigram_token_loss']:.3f}", flush=True)
    queries = Tokenized(setup.query.input_ids + setup.fact_query.input_ids,
                        setup.query.labels + setup.fact_query.labels, 0, setup.query.field)
    n_held = len(setup.query)
    idx = work / f"{shape.name}-default"
    bcfg = default_config(8)
    old = read_manifest(idx) if reuse and (idx / "manifest.json").exists() else {}
    if old.get("status") == "complete" and "ekfac" in old.get("full_space", {}):
        res["default_build_seconds"], man = None, old  # (--reuse: built by an earlier run, not timed here)
        res["reused_index"] = True
    else:
        res["default_build_seconds"], man = timed_build(model, tok, train, idx, bcfg, data_id)
    sizes = {n: (v["rows"], v["cols"]) for n, v in man["build"]["layers"].items()}
    res["hooked_numbers"] = int(sum(np.prod(v) for v in _full_shapes(model, list(sizes)).values()))
    res["default_numbers"] = int(sum(a * b for a, b in sizes.values()))
    res["default_sizes"] = {n: list(v) for n, v in sizes.items()}
    log(f"  default build {res['default_build_seconds']} s: {res['default_numbers']} numbers "
        f"({row_bytes(man)} B) of {res['hooked_numbers']}", flush=True)
    default_scores = library_rows_scores(model, setup, idx, queries, bcfg)
    if eigen:
        eig_idx = work / f"{shape.name}-eigen"
        ecfg = eigen_config(8)
        res["eigen_build_seconds"], eig_man = timed_build(model, tok, train, eig_idx, ecfg, data_id)
        eigen_scores = library_rows_scores(model, setup, eig_idx, queries, ecfg)
        log(f"  eigen build {res['eigen_build_seconds']} s: {row_bytes(eig_man)} B", flush=True)
    t0 = time.perf_counter()
    if "ekfac" in man.get("full_space", {}):  # (a --rerank-fit build fits it; the default build no longer does)
        res["full_fit_seconds"] = round(man["full_space"]["ekfac"]["seconds"], 1)
        res["full_fit_in_build"] = True
    else:
        fit_preconditioner(idx, FitConfig(method="ekfac", space="full", damping=DAMPING), model=model,
                           tokenizer=tok, data=train)
        res["full_fit_seconds"] = round(time.perf_counter() - t0, 1)
    log(f"  full-space fit {res['full_fit_seconds']} s", flush=True)
    curv = load_full_preconditioner(idx, "ekfac").curvature
    kron = {n: c["Lambda"] for n, c in load_full_preconditioner(idx, "kfac").curvature.items()}
    DAMP_CHECK.clear()
    plans = plan_schemes(curv, sizes, kron) if schemes else {}
    ref, sims, secs, res["factor_capture_seconds"] = streamed_scores(model, list(sizes), queries, train,
                                                                      tok.pad_token_id, curv, plans)
    del curv, kron
    res["reference"] = {"fact_rank1": fact_rank1(ref[n_held:], setup.fact_rows)}
    rows = {"default": {"bytes_per_example": row_bytes(man), "numbers": res["default_numbers"],
                        **measure(default_scores, ref, n_held, setup.fact_rows),
                        "build_seconds": res["default_build_seconds"]}}
    res["default_first_stage"] = first_stage(default_scores, ref, n_held, setup.fact_rows)
    if eigen:
        rows["eigen (library)"] = {
            "bytes_per_example": row_bytes(eig_man),
            "numbers": int(sum(v["rows"] * v["cols"] for v in eig_man["build"]["layers"].values())),
            **measure(eigen_scores, ref, n_held, setup.fact_rows), "build_seconds": res["eigen_build_seconds"],
            "kept_share": eig_man["build"]["basis"].get("kept_share"),
            "layer_numbers": {n: v["cols"] for n, v in eig_man["build"]["layers"].items()}}
    for s, sc in sims.items():
        nums = sum(p.numbers for p in plans[s].values())
        rows[s] = {"bytes_per_example": sum(codes.row_bytes("int4", p.numbers) for p in plans[s].values()),
                   "numbers": nums, **measure(sc, ref, n_held, setup.fact_rows),
                   "build_seconds": round(res["full_fit_seconds"] + res["factor_capture_seconds"] + secs[s], 1),
                   "layer_numbers": {n: p.numbers for n, p in plans[s].items()}}
    res["rows"] = rows
    extra = {"eigen": eigen_scores} if eigen else {}
    np.savez_compressed(work / f"{shape.name}-scores.npz", reference=ref, default=default_scores, **extra,
                        **{k.replace("+", "_"): v for k, v in sims.items()})
    res["damping_estimate"] = {n: dict(v) for n, v in DAMP_CHECK.items()}
    for s, r in rows.items():
        log(f"  {s:20s} {r['bytes_per_example']:>8d} B  spearman {r['spearman']:.3f}  top10 {r['top10']:.2f}  "
            f"facts@1 {r['fact_rank1']:.2f}  recall@C {r['recall_of_top10_at_C']}", flush=True)
    res["engine"] = engine_rerank(model, tok, idx, queries, ref, n_held, setup.fact_rows, timed[1], timed[0], log)
    return res


def _full_shapes(model, layers: list[str]) -> dict[str, tuple[int, int]]:
    from gradindex.capture.layers import layer_info

    mods = dict(model.named_modules())
    return {n: (layer_info(mods[n]).n_out, layer_info(mods[n]).n_in_total) for n in layers}


def plot(out: dict, path: Path) -> None:
    """Spearman and top-10 overlap with full-space EK-FAC per scheme, one panel per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = out["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (name, res) in zip(axes[0], shapes.items(), strict=True):
        rows = res["rows"]
        names = list(rows)
        x = np.arange(len(names))
        ax.bar(x - 0.2, [rows[n]["spearman"] for n in names], 0.4, label="Spearman")
        ax.bar(x + 0.2, [rows[n]["top10"] for n in names], 0.4, label="top-10 overlap")
        ax.axhline(0.9, color="k", lw=0.6, ls="--")
        ax.set_xticks(x, names, rotation=60, ha="right", fontsize=8)
        ax.set_ylim(0.0, 1.0)
        ax.set_title(f"{name}: {res['hooked_numbers']:,} numbers, {rows['default']['bytes_per_example'] // 1024} KiB",
                     fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("agreement with exhaustive full-space EK-FAC at the default budget", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work-dir", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "gradindex" / "width")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "width.json")
    ap.add_argument("--merge", action="store_true", help="keep the other shapes already in --out")
    ap.add_argument("--no-eigen", action="store_true", help="skip the --projection-basis eigen build")
    ap.add_argument("--no-schemes", action="store_true",
                    help="skip the alternative stored-row schemes (the reference and the library's rows only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reuse", action="store_true",
                    help="keep a complete default index (with its full-space fit) from an earlier run in --work-dir")
    ap.add_argument("--train-only", action="store_true",
                    help="train and cache the shapes' models, then stop (training needs no big memory)")
    ap.add_argument("--what", help="the results file's description (kept from the file with --merge otherwise)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    table = QUICK if args.quick else SHAPES
    out = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                       "threads": args.threads, "loadavg_before": os.getloadavg()},
           "damping": DAMPING, "shapes": {}}
    if args.merge and args.out.exists():  # the other shapes, their runs and any notes kept
        out = json.loads(args.out.read_text()) | {"machine": out["machine"], "damping": DAMPING}
    out.setdefault("shapes", {})
    if args.what:
        out["what"] = args.what
    t0 = time.perf_counter()
    if args.train_only:
        for name in args.shapes.split(","):
            setup = make_setup(table[name].data, table[name].data.corpora[0])
            _, secs = load_or_train(table[name], setup, len(setup.tokenizer), args.work_dir)
            print(f"[{name}] trained in {secs:.0f} s", flush=True)
        return 0
    for name in args.shapes.split(","):
        t1, load1 = time.perf_counter(), os.getloadavg()
        out["shapes"][name] = run_shape(table[name], args.work_dir, eigen=not args.no_eigen,
                                        schemes=not args.no_schemes, reuse=args.reuse,
                                        timed=TIMED.get(name, (1000, (50, 100, 200))))
        out.setdefault("runs", {})[name] = {
            "machine": out["machine"] | {"loadavg_before": load1, "loadavg_after": os.getloadavg()},
            "seconds": round(time.perf_counter() - t1, 1),
            "command": "python -m benchmarks.width " + " ".join(sys.argv[1:])}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    for name, res in out["shapes"].items():  # (results merged from a run before the share was recorded)
        row = res["rows"].get("eigen (library)", {})
        if row.get("kept_share") is None and (args.work_dir / f"{name}-eigen").exists():
            row["kept_share"] = round(kept_share(read_basis(args.work_dir / f"{name}-eigen"), DAMPING), 4)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["machine"]["loadavg_after"] = os.getloadavg()
    args.out.write_text(json.dumps(out, indent=1))
    plot(out, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(math.floor(main()))
