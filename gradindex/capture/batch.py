"""One batch in, per-example projected gradients out: the step shared by builds and queries."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradindex.capture import GradientCapture
from gradindex.capture.head import fused_per_example_loss, plain_head
from gradindex.capture.sampling import sample_targets
from gradindex.data import IGNORE, collate, per_example_loss


@dataclass
class BatchGradients:
    grads: dict[str, torch.Tensor]
    """layer → ``[B, D]`` float32 per-example projected gradients."""
    loss: torch.Tensor | None
    """``[B]`` per-example summed token loss (``None`` when the head was skipped)."""
    num_tokens: torch.Tensor | None
    """``[B]`` target-token counts (``None`` when the head was skipped)."""
    head_grad: torch.Tensor | None = None
    """With ``keep_head_grad``: ``[B, T, d]`` gradient of the summed loss w.r.t. the final hidden states."""


def batch_gradients(
    model: nn.Module,
    capture: GradientCapture,
    ids: list[list[int]],
    labels: list[list[int]],
    pad_id: int,
    uniforms: torch.Tensor | None = None,
    head_grad: torch.Tensor | None = None,
    keep_head_grad: bool = False,
) -> BatchGradients:
    """Forward, summed per-example loss, weight-free backward, per-example gradients.

    ``uniforms`` ``[B, T-1]`` (:func:`gradindex.capture.sampling.label_uniforms`) replace the
    observed targets by targets sampled from the model (the true Fisher's labels; factors only).

    For the plain LM heads of :func:`gradindex.capture.head.plain_head` the head and the loss run fused
    (:func:`gradindex.capture.head.fused_per_example_loss`); other models go through their own logits.
    With such a head, ``keep_head_grad`` also returns the gradient w.r.t. the final hidden states
    (``head_grad``), and passing it back as ``head_grad`` for the same batch skips the head and the
    loss (a second pass over the same examples: the same gradients, the loss is not computed).
    """
    return tensor_batch_gradients(model, capture, collate(ids, labels, pad_id), uniforms, head_grad, keep_head_grad)


def tensor_batch_gradients(
    model: nn.Module,
    capture: GradientCapture,
    batch: dict[str, torch.Tensor],
    uniforms: torch.Tensor | None = None,
    head_grad: torch.Tensor | None = None,
    keep_head_grad: bool = False,
) -> BatchGradients:
    """:func:`batch_gradients` of an already collated batch: ``input_ids``, ``attention_mask`` and
    unshifted ``labels`` ``[B, T]`` (``IGNORE`` where there is no target), moved to the model's device."""
    device = next(model.parameters()).device
    batch = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
    capture.set_mask(batch["attention_mask"])
    head = plain_head(model, set(capture.modules.values()))
    if head is None and (head_grad is not None or keep_head_grad):
        raise ValueError(f"{type(model).__name__} has no plain LM head to skip (plain_head)")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
    loss = ntok = kept = None
    with torch.enable_grad():
        if head is not None:
            hidden = model.base_model(**inputs)[0]  # [B, T, d]
            if head_grad is not None:
                capture.backward(hidden, grad_output=head_grad.to(hidden.device, hidden.dtype))
            else:
                loss, ntok = fused_per_example_loss(hidden, head, batch["labels"], uniforms)
                if keep_head_grad:
                    (kept,) = capture.backward(loss.sum(), inputs=(hidden,))
                else:
                    capture.backward(loss.sum())
        else:
            logits = model(**inputs).logits  # [B, T, V]
            labels = batch["labels"] if uniforms is None else sampled_labels(logits, batch["labels"], uniforms)
            loss, ntok = per_example_loss(logits, labels)
            capture.backward(loss.sum())
    grads = capture.pop()
    capture.set_mask(None)
    return BatchGradients(grads, None if loss is None else loss.detach(), ntok, kept)


def sampled_labels(logits: torch.Tensor, labels: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` unshifted labels whose targets are drawn from ``softmax(logits)`` where ``labels`` has one."""
    out = labels.clone()
    has = labels[:, 1:] != IGNORE  # [B, T-1]
    probs = torch.softmax(logits[:, :-1].detach().float(), dim=-1)[has]  # [N, V]
    out[:, 1:][has] = sample_targets(probs, uniforms.to(logits.device)[has])
    return out


def finite_rows(grads: dict[str, np.ndarray]) -> np.ndarray:
    """``[B]`` bool: whether every layer's row of an example is finite."""
    ok = None
    for v in grads.values():
        f = np.isfinite(v).all(axis=1)
        ok = f if ok is None else ok & f
    return ok
