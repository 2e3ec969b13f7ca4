"""Attribution baselines the field reports beside gradient methods: BM25, representation similarity,
TrackStar. Each returns a ``[Q, N]`` score matrix (higher: more influential), as ``score_matrix`` does.

* **BM25** (``bm25s``, Okapi BM25 with its defaults k1=1.5, b=0.75): word overlap on the *same tokens*
  the model reads (each token id is a term; a query's terms are its target tokens' ids), as DATE-LM and
  Bergson's board use it.
* **Rep-Sim** (DATE-LM's representation similarity): cosine of the model's final hidden states,
  mean-pooled over each sequence's tokens.
* **TrackStar** (arXiv 2410.17413): per-example gradients normalised by the optimizer's second moment
  (``G ⊘ (√v + ε)``, Adam's final ``exp_avg_sq``), projected per layer with a seeded Gaussian
  (``P_g G P_aᵀ``), concatenated and unit-normalised; the score is their cosine.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.common import padded
from gradindex.data import IGNORE


def bm25_scores(train_ids: list[list[int]], query_ids: list[list[int]],
                query_labels: list[list[int]] | None = None) -> np.ndarray:
    """``[Q, N]`` BM25 of each query's tokens (its target tokens when ``query_labels`` are given) against
    each training sequence's tokens."""
    import bm25s

    def terms(ids):
        return [f"t{t}" for t in ids]

    retriever = bm25s.BM25()
    corpus = [terms(x) for x in train_ids]
    vocab = {w for doc in corpus for w in doc}
    retriever.index(corpus, show_progress=False)
    out = np.zeros((len(query_ids), len(train_ids)))
    for j, q in enumerate(query_ids):
        lab = query_labels[j] if query_labels is not None else q
        words = [w for w in terms([t for t in lab if t != IGNORE]) if w in vocab]
        if words:
            out[j] = retriever.get_scores(words)
    return out


@torch.no_grad()
def _pooled(model: torch.nn.Module, seqs: list[list[int]], batch: int = 32) -> np.ndarray:
    """``[n, d]`` final hidden states mean-pooled over each sequence's tokens."""
    out = []
    for s in range(0, len(seqs), batch):
        ids, lens = padded(seqs[s:s + batch], 0)
        mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).float()  # [B, T]
        h = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states[-1]
        out.append(((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).double().numpy())
    return np.concatenate(out)


def repsim_scores(model: torch.nn.Module, train_ids: list[list[int]], query_ids: list[list[int]]) -> np.ndarray:
    """``[Q, N]`` cosine of mean-pooled final hidden states (Rep-Sim)."""
    t, q = _pooled(model, train_ids), _pooled(model, query_ids)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return q @ t.T


def adam_second_moments(model: torch.nn.Module, optimizer, layers: list[str]) -> dict[str, np.ndarray]:
    """layer → ``[N_o, N_i+1]`` Adam ``exp_avg_sq`` of a Conv1D layer in the stacked gradient layout."""
    mods = dict(model.named_modules())
    out = {}
    for n in layers:
        m = mods[n]
        w = optimizer.state[m.weight]["exp_avg_sq"].double().T  # Conv1D weight is [N_i, N_o]
        b = optimizer.state[m.bias]["exp_avg_sq"].double()[:, None]
        out[n] = torch.cat([w, b], 1).numpy()
    return out


def trackstar_scores(G_train: dict[str, np.ndarray], G_query: dict[str, np.ndarray], v: dict[str, np.ndarray],
                     k: int = 32, eps: float = 1e-8, seed: int = 0) -> np.ndarray:
    """``[Q, N]`` TrackStar cosines from full per-example gradients ``layer → [n, N_o, N_i+1]``."""
    rng = np.random.default_rng(seed)
    parts_t, parts_q = [], []
    for n in G_train:
        N_o, N_i = G_train[n].shape[1:]
        P_g = rng.standard_normal((min(k, N_o), N_o)) / np.sqrt(min(k, N_o))
        P_a = rng.standard_normal((min(k, N_i), N_i)) / np.sqrt(min(k, N_i))
        scale = 1.0 / (np.sqrt(v[n]) + eps)
        for G, parts in ((G_train[n], parts_t), (G_query[n], parts_q)):
            parts.append((P_g @ (G * scale) @ P_a.T).reshape(len(G), -1))
    t, q = np.concatenate(parts_t, 1), np.concatenate(parts_q, 1)
    t /= np.maximum(np.linalg.norm(t, axis=1, keepdims=True), 1e-300)
    q /= np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-300)
    return q @ t.T


def refined_scores(index_dir, model, tokenizer, data_path, ids: list[list[int]], labels: list[list[int]],
                   damping: float, refine, method: str = "ekfac") -> np.ndarray:
    """``[Q, N]`` refined EK-FAC scores of token-id queries through the library's engine (``refine``: a
    :class:`~gradindex.query.refine.RefineConfig`; ``data_path``: the training texts the index was built from)."""
    from gradindex.query import QueryEngine
    from gradindex.query.inputs import QueryTokens

    with QueryEngine(index_dir, model=model, tokenizer=tokenizer, device="cpu", data=data_path) as e:
        tokens = QueryTokens([{}] * len(ids), list(ids), list(labels), [False] * len(ids))
        grads, _, _ = e.gradients(tokens)
        rows = e.refined_rows(tokens, grads, method, damping, e.layers, refine)
        return e.scores(rows, method=method, damping=damping)


def baseline_scores(model: torch.nn.Module, optimizer, train_ids: list[list[int]], train_labels: list[list[int]],
                    query_ids: list[list[int]], query_labels: list[list[int]], pad_id: int) -> dict[str, np.ndarray]:
    """``{"bm25", "repsim", "trackstar"}`` → ``[Q, N]`` (TrackStar from the Conv1D layers' full gradients)."""
    from benchmarks._study import capture_full

    out = {"bm25": bm25_scores(train_ids, query_ids, query_labels),
           "repsim": repsim_scores(model, train_ids, query_ids)}
    grad_before = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(True)
    try:
        G, _, _, _ = capture_full(model, train_ids, train_labels, pad_id)
        Gq, _, _, _ = capture_full(model, query_ids, query_labels, pad_id)
    finally:
        for p, r in zip(model.parameters(), grad_before, strict=True):
            p.requires_grad_(r)
    out["trackstar"] = trackstar_scores(G, Gq, adam_second_moments(model, optimizer, list(G)))
    return out
