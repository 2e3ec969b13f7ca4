"""benchmarks/width_lds.py's scores: full-space GradDot from per-token factors against brute-force
autograd per-example gradients, and the two-stage result's scores for every example."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks import width_lds as L
from fixtures.tiny import tiny_gpt2
from gradindex.data import IGNORE, Tokenized

LAYERS = ["transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_proj"]


def _data(seed: int, n: int) -> Tokenized:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 60, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n)]
    return Tokenized(ids, [list(x) for x in ids], 0, "text")


def _brute(model, data: Tokenized) -> torch.Tensor:
    """``[n, D]`` per-example gradients of the summed next-token loss w.r.t. the layers' weight and bias."""
    mods = dict(model.named_modules())
    params = [p for n in LAYERS for p in (mods[n].weight, mods[n].bias)]
    rows = []
    for x, y in zip(data.input_ids, data.labels, strict=True):
        logits = model(input_ids=torch.tensor([x])).logits[0, :-1].double()
        lab = torch.tensor(y[1:])
        loss = torch.nn.functional.cross_entropy(logits, lab, ignore_index=IGNORE, reduction="sum")
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def test_full_space_graddot_matches_autograd_per_example_gradients():
    torch.manual_seed(0)
    model = tiny_gpt2(vocab_size=64, n_layer=1, n_embd=16, n_head=2, n_positions=16)
    q, t = _data(1, 3), _data(2, 7)
    got = L.graddot_scores(model, LAYERS, q, t, pad=0)
    model.requires_grad_(True)
    want = (_brute(model, q) @ _brute(model, t).T).numpy()
    assert got.shape == (3, 7)
    assert np.allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())  # (float16 factors)


def test_two_stage_scores_exact_head_and_a_least_squares_scaled_tail():
    rng = np.random.default_rng(0)
    first = rng.normal(size=(2, 30))
    ids = np.argsort(-first, 1)[:, :5]
    exact = 3.0 * np.take_along_axis(first, ids, 1) + rng.normal(scale=0.01, size=(2, 5))
    s = L.two_stage_scores(first, ids, exact)
    for q in range(2):
        f, x = first[q, ids[q]], exact[q]
        a = f @ x / (f @ f)
        rest = np.setdiff1d(np.arange(30), ids[q])
        assert np.allclose(s[q, ids[q]], x) and np.allclose(s[q, rest], a * first[q, rest])
        assert abs(a - 3.0) < 0.05
    head = L.two_stage_scores(first, ids, exact, tail=False)
    assert np.count_nonzero(head) == 10 and np.allclose(np.take_along_axis(head, ids, 1), exact)
