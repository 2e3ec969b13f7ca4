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
