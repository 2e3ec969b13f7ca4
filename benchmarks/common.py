"""What several benchmarks share: the shared workload, the training recipe, query gradients, and
the LDS / rank-agreement statistics. Imported as ``benchmarks.common``; run benchmarks from the
repository root as ``python -m benchmarks.<name>``.

The shared workload (benchmarks/README.md, "Shared workload"): GPT-2 built from a config (4 layers,
width 256, 4 heads, vocab 8192), 512 training sequences of 128 random token ids (seed 0), batch 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fixtures.tiny import tiny_gpt2
from gradindex.capture import GradientCapture, ProjectedRows, RowSpace
from gradindex.capture.batch import batch_gradients
from gradindex.data import IGNORE, Tokenized, per_example_loss
from gradindex.pipeline import BuildConfig


# -- the shared workload -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The model and data every method runs on (module docstring)."""

    layers: int = 4
    """GPT-2 blocks."""
    width: int = 256
    """Embedding width."""
    heads: int = 4
    """Attention heads."""
    vocab: int = 8192
    """Vocabulary size."""
    seq_len: int = 128
    """Tokens per training sequence (also the model's positions, at least 128)."""
    sequences: int = 512
    """Training sequences."""
    batch_size: int = 8
    """Sequences per forward/backward."""
    projection: str = "16x16"
    """``K``, ``KAxKG`` or ``none``."""
    seed: int = 0
    """Seed of the random token ids and of the model's weights."""


def make_model(w: Workload, positions: int) -> nn.Module:
    """The workload's GPT-2, built from a config with ``positions`` positions."""
    return tiny_gpt2(vocab_size=w.vocab, n_layer=w.layers, n_embd=w.width, n_head=w.heads,
                     n_positions=positions, seed=w.seed)


def make_sequences(w: Workload, n: int, length: int) -> list[list[int]]:
    """``n`` sequences of ``length`` random token ids (seed ``w.seed``)."""
    g = torch.Generator().manual_seed(w.seed)
    return torch.randint(w.vocab, (n, length), generator=g).tolist()


# -- training --------------------------------------------------------------------------------------
def padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [n, T] padded with ``pad``, lengths [n])``."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    lens = torch.tensor([len(s) for s in seqs])
    return ids, lens


def train_model(model: torch.nn.Module, seqs: list[list[int]], cfg,
                seed: int, optimizer_out: list | None = None, keep=None) -> torch.nn.Module:
    """AdamW on the mean token loss, epochs of shuffled batches, warm-up then linear decay to zero
    (``cfg``: anything with ``lr``, ``steps`` and ``batch``, e.g. ``fidelity.FidelityConfig``).

    ``optimizer_out``, when given, receives the optimizer (its final state: benchmarks/adam_lds.py).
    ``keep`` (``[n]`` bools), when given: train on the kept rows only, in the full set's shuffled order
    with the left-out rows skipped (benchmarks/refine.py's retrainings)."""
    ids, lens = padded(seqs, 0)
    mask = torch.arange(ids.shape[1])[None, :] < lens[:, None]  # [n, T]
    labels = ids.masked_fill(~mask, IGNORE)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    warm = max(1, cfg.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * min(1.0, (cfg.steps - s) / max(1, cfg.steps - warm)))
    model.train()
    order: list[int] = []
    for _ in range(cfg.steps):
        while len(order) < cfg.batch:
            order += [i for i in torch.randperm(len(seqs), generator=g).tolist() if keep is None or keep[i]]
        idx, order = order[: cfg.batch], order[cfg.batch:]
        T = int(lens[idx].max())
        out = model(input_ids=ids[idx, :T], attention_mask=mask[idx, :T].long(), labels=labels[idx, :T])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        sched.step()
    if optimizer_out is not None:
        optimizer_out.append(opt)
    return model.eval()


@torch.no_grad()
def example_losses(model: torch.nn.Module, data: Tokenized) -> np.ndarray:
    """``[n]`` summed next-token loss of each example (the library's per-example loss)."""
    ids, lens = padded(data.input_ids, 0)
    mask = torch.arange(ids.shape[1])[None, :] < lens[:, None]
    lab, _ = padded(data.labels, IGNORE)
    lab = lab.masked_fill(~mask, IGNORE)
    logits = model(input_ids=ids, attention_mask=mask.long()).logits
    return per_example_loss(logits, lab)[0].double().numpy()



# -- query gradients ----------------------------------------------------------------------------
def query_gradients(model: torch.nn.Module, tokenizer, query: Tokenized, bcfg: BuildConfig,
                    transforms: dict | None = None) -> dict[str, np.ndarray]:
    """layer → ``[Q, D]`` query gradients, captured exactly as the build captured training gradients
    (``transforms``: the build's capture transforms, e.g. Adam's, when it had any)."""
    model.requires_grad_(False)
    cap = GradientCapture(model, bcfg.layers, ProjectedRows(RowSpace(bcfg.projection, transforms), bcfg.route))
    out: dict[str, list[np.ndarray]] = {}
    with cap:
        for s in range(0, len(query), bcfg.batch_size):
            bg = batch_gradients(model, cap, query.input_ids[s: s + bcfg.batch_size],
                                 query.labels[s: s + bcfg.batch_size], tokenizer.pad_token_id)
            for n, v in bg.grads.items():
                out.setdefault(n, []).append(v.cpu().numpy())
    return {n: np.concatenate(v) for n, v in out.items()}



# -- LDS and rank agreement ----------------------------------------------------------------------
def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks along the last axis, ties given their average rank."""
    out = np.empty_like(x, dtype=np.float64)
    for i, row in enumerate(x.reshape(-1, x.shape[-1])):
        _, inv, counts = np.unique(row, return_inverse=True, return_counts=True)
        ends = np.cumsum(counts)
        out.reshape(-1, x.shape[-1])[i] = (ends - (counts - 1) / 2.0)[inv]
    return out


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[Q]`` Spearman correlation between rows of ``x`` and ``y`` ``[Q, M]``."""
    rx, ry = _ranks(x), _ranks(y)
    rx -= rx.mean(1, keepdims=True)
    ry -= ry.mean(1, keepdims=True)
    den = np.sqrt((rx**2).sum(1) * (ry**2).sum(1))
    return np.where(den > 0, (rx * ry).sum(1) / np.where(den > 0, den, 1.0), 0.0)


def lds_per_query(score: np.ndarray, masks: np.ndarray, losses: np.ndarray) -> np.ndarray:
    """``[Q]`` LDS: Spearman over subsets of ``Σ_{i∈S} score`` against ``-loss`` (``losses`` ``[M, Q]``)."""
    pred = score @ masks.T.astype(np.float64)  # [Q, M]
    return spearman_rows(pred, -losses.T)


def noise_ceiling(losses: np.ndarray) -> float | None:
    """Mean over queries and seed pairs of the Spearman correlation between two seeds' losses."""
    R = losses.shape[1]
    if R < 2:
        return None
    vals = [spearman_rows(-losses[:, a].T, -losses[:, b].T).mean() for a in range(R) for b in range(a + 1, R)]
    return float(np.mean(vals))


def evaluate(score: np.ndarray, masks: np.ndarray, losses: np.ndarray) -> dict:
    """LDS per query against the seed-averaged losses, and the mean LDS against each seed alone."""
    per_q = lds_per_query(score, masks, losses.mean(axis=1))
    per_seed = [float(lds_per_query(score, masks, losses[:, r]).mean()) for r in range(losses.shape[1])]
    return {"per_query": per_q, "per_seed": per_seed}



def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho of two score vectors (ties given their average rank)."""
    return float(spearman_rows(np.asarray(a, dtype=np.float64)[None], np.asarray(b, dtype=np.float64)[None])[0])


def overlap_at_k(top: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``[Q]`` ``|top_q ∩ ref_q| / k`` for top-k index rows ``top``, ``ref`` ``[Q, k]``."""
    k = ref.shape[1]
    return np.array([len(set(a) & set(b)) / k for a, b in zip(top, ref, strict=True)])


def top_indices(score: np.ndarray, k: int) -> np.ndarray:
    """``[Q, k]`` column indices of the k largest scores per row, best first (ties: lower index)."""
    return np.argsort(-score, axis=1, kind="stable")[:, :k]


def fact_recall(score: np.ndarray, rows: tuple[int, ...]) -> float:
    """Share of fact queries (rows of ``score`` ``[F, N]``) whose planted training row ranks first."""
    return float(np.mean(top_indices(score, 1)[:, 0] == np.asarray(rows)))
