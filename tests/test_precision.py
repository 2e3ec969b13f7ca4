"""bf16 capture of a bf16 model (the per-example math in float32) and gradient checkpointing with the hooks."""

from __future__ import annotations

import copy

import pytest
import torch

from fixtures.tiny import tiny_qwen2
from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.batch import batch_gradients
from gradindex.data import collate, per_example_loss

SEQS = [[5, 9, 12, 40, 7, 3, 22], [8, 1, 30], [14, 2, 2, 9, 60]]
EXACT = ProjectionSpec(kind="none", k_a=0, k_g=0)


def _rows(model, weight_free: bool) -> dict[str, torch.Tensor]:
    with GradientCapture(model, None, ProjectedRows(RowSpace(EXACT)), weight_free=weight_free) as cap:
        if weight_free:
            rows = batch_gradients(model, cap, SEQS, SEQS, pad_id=0).grads
            assert not cap._records  # nothing left over from a recomputed forward
            return rows
        b = collate(SEQS, SEQS, 0)
        cap.set_mask(b["attention_mask"])
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
        per_example_loss(out.logits, b["labels"])[0].sum().backward()
        return cap.pop()


@pytest.mark.parametrize("weight_free", [True, False])
def test_gradient_checkpointing_gives_the_same_rows(weight_free):
    model = tiny_qwen2(vocab_size=64)
    plain = _rows(model.train(), weight_free)  # train mode (dropout is 0): checkpointing only acts there
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ckpt.model.gradient_checkpointing
    again = _rows(ckpt.train(), weight_free)
    assert sorted(plain) == sorted(again)
    for n in plain:
        assert torch.allclose(plain[n], again[n], rtol=1e-5, atol=1e-7), n


def test_bf16_capture_rows_are_float32_and_near_the_float32_model():
    model = tiny_qwen2(vocab_size=64)
    ref = _rows(model, True)
    low = _rows(copy.deepcopy(model).to(torch.bfloat16), True)
    for n in ref:
        assert low[n].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(low[n], ref[n], dim=1)
        assert (cos > 0.98).all(), (n, cos)


def test_a_bf16_heads_loss_and_gradient_are_float32_math():
    """The fused head of a bf16 model computes its logits, softmax and hidden-state gradient in float32
    from the bf16 values (only the final gradient is rounded to bf16), in blocks of the vocabulary."""
    from gradindex.capture import head as fused

    torch.manual_seed(0)
    d, V = 32, 700
    h = (3 * torch.randn(2, 9, d)).bfloat16().requires_grad_()
    lin = torch.nn.Linear(d, V).bfloat16()
    labels = torch.randint(0, V, (2, 9))
    labels[1, 6:] = -100
    ref_h = h.detach().float().requires_grad_()
    logits = ref_h @ lin.weight.float().T + lin.bias.float()  # [B, T, V], float32 math on the bf16 values
    ref_loss, _ = per_example_loss(logits, labels)
    (ref_grad,) = torch.autograd.grad(ref_loss.sum(), ref_h)
    saved = fused.CAST_BYTES
    try:
        fused.CAST_BYTES = 4 * d * 256  # three vocabulary blocks
        loss, _ = fused.fused_per_example_loss(h, lin, labels)
        (grad,) = torch.autograd.grad(loss.sum(), h)
    finally:
        fused.CAST_BYTES = saved
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.allclose(grad.float(), ref_grad.bfloat16().float(), rtol=0, atol=1e-2 * ref_grad.abs().max())
    # the bf16 logits of the unfused head are off by far more (what the float32 math avoids)
    bf16_loss, _ = per_example_loss(h.detach() @ lin.weight.T + lin.bias, labels)
    assert (bf16_loss - ref_loss).abs().max() > 20 * (loss - ref_loss).abs().max().clamp_min(1e-6)
