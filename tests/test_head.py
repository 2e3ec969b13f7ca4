"""The fused LM head + loss equals the plain logits → per_example_loss path."""

from __future__ import annotations

import pytest
import torch

from fixtures.tiny import tiny_gpt2
from gradindex.capture import head as head_mod
from gradindex.capture.head import fused_per_example_loss, plain_head
from gradindex.data import IGNORE, collate, per_example_loss


@pytest.mark.parametrize("rows", [16, 4096])  # several chunks; one chunk
def test_fused_loss_and_its_gradient_equal_the_plain_path(monkeypatch, rows):
    monkeypatch.setitem(head_mod.CHUNK_BYTES, "cpu", 0)
    monkeypatch.setattr(head_mod, "MIN_ROWS", rows)
    model = tiny_gpt2(vocab_size=300, n_layer=1, n_embd=32)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(300, (n,), generator=g).tolist() for n in (40, 7, 1, 33)]
    labels = [list(x) for x in ids]
    labels[0][:10] = [IGNORE] * 10  # a masked prompt
    b = collate(ids, labels, 0)
    hidden = model.transformer(input_ids=b["input_ids"], attention_mask=b["attention_mask"])[0].detach()
    weights = torch.tensor([1.0, -2.0, 3.0, 0.5])  # per-example upstream gradients
    got, want = {}, {}
    for out, fn in ((got, lambda h: fused_per_example_loss(h, model.lm_head, b["labels"])),
                    (want, lambda h: per_example_loss(model.lm_head(h), b["labels"]))):
        h = hidden.clone().requires_grad_()
        loss, ntok = fn(h)
        (out["grad"],) = torch.autograd.grad((loss * weights).sum(), h)
        out["loss"], out["ntok"] = loss.detach(), ntok
    assert torch.equal(got["ntok"], want["ntok"])
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["grad"], want["grad"], rtol=1e-5, atol=1e-6)
    assert model.lm_head.weight.grad is None


def test_fused_path_applies_only_to_plain_unhooked_heads():
    model = tiny_gpt2(vocab_size=64, n_layer=1, n_embd=16)
    assert plain_head(model, set()) is model.lm_head
    assert plain_head(model, {model.lm_head}) is None  # a hooked head must run its own forward
    assert plain_head(model.transformer, set()) is None  # not a known LM class


def test_replayed_head_gradient_gives_the_same_per_token_factors():
    """A second pass given the first pass's gradient w.r.t. the final hidden states skips the head and the loss
    and hands the visitor the same per-token factors, bit for bit (padding and masked prompts included)."""
    from gradindex.capture import FullTokens, GradientCapture
    from gradindex.capture.batch import batch_gradients

    model = tiny_gpt2(vocab_size=300, n_layer=2, n_embd=32).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (40, 7, 33)]
    labels = [list(x) for x in ids]
    labels[0][:10] = [IGNORE] * 10
    seen: list[dict] = [{}, {}]
    for k in range(2):
        visit = FullTokens(lambda n, a, gr, k=k: seen[k].__setitem__(n, (a.clone(), gr.clone())))
        with GradientCapture(model, None, visit) as cap:
            if k == 0:
                first = batch_gradients(model, cap, ids, labels, 0, keep_head_grad=True)
                assert first.head_grad.shape == (3, 40, 32) and first.loss is not None
            else:
                again = batch_gradients(model, cap, ids, labels, 0, head_grad=first.head_grad)
                assert again.loss is None and again.head_grad is None
    assert seen[0].keys() == seen[1].keys() and len(seen[0]) == 8
    for n in seen[0]:
        for x, y in zip(seen[0][n], seen[1][n], strict=True):
            assert torch.equal(x, y), n
    with pytest.raises(ValueError, match="no plain LM head"):
        with GradientCapture(model.transformer, None, FullTokens(lambda *a: None)) as cap:
            batch_gradients(model.transformer, cap, ids, labels, 0, keep_head_grad=True)
