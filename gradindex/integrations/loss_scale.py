"""The loss scale of an in-loop capture (step 3 of :mod:`gradindex.integrations.live`): whatever the training loop's
reduction, the gradient its loss sends to the target logit of token ``t`` is ``c · (p_t − 1)``, so ``c`` is a
least-squares fit over a few target tokens of the micro-batch; a fused LM head's target log-probabilities get
``−c`` directly. :class:`LossScaleFit` hooks the tensor the loss is computed from and fits ``c`` per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gradindex.data import IGNORE

FIT_TOKENS = 4
"""Target tokens per example whose logit gradient measures the loss scale."""
SCALE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest residual of the loss-scale fit, relative to its largest term (bf16/fp16 gradients: 5e-2)."""


@dataclass
class MicroBatch:
    """One forward and backward of the training loop, as the capture keeps it until its rows are written."""

    rows: np.ndarray
    step: int
    epoch: float
    lr: float
    input_ids: torch.Tensor
    labels: torch.Tensor | None
    mask: torch.Tensor | None
    fit: list = field(default_factory=list)
    """Per backward through the output: ``(gradient at the targets, what it is c times, its dtype)``."""
    loss: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None


def _field(output, name: str):
    if isinstance(output, dict):
        return output.get(name)
    return getattr(output, name, None)


class LossScaleFit:
    """The loss's factor ``c`` on each example's summed token loss, per micro-batch: :meth:`hook` the model's output,
    then :meth:`scale` after the backward. ``given``: the factor, told (nothing is measured); ``record_loss``: the
    hooks also sum each example's token loss over every position (:attr:`MicroBatch.loss`)."""

    def __init__(self, given: float | None, record_loss: bool):
        self.given, self.record_loss = given, record_loss

    def hook(self, mb: MicroBatch, output) -> None:
        """Hook the tensor the loss is computed from: ``logits``, or the per-token ``log_probs`` of a fused head."""
        logits, log_probs = _field(output, "logits"), _field(output, "log_probs")
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            self._hook_logits(mb, logits)
        elif isinstance(log_probs, torch.Tensor) and log_probs.requires_grad:
            self._hook_log_probs(mb, log_probs, _field(output, "label_mask"))

    def _hook_logits(self, mb: MicroBatch, logits: torch.Tensor) -> None:
        """The loss's gradient at the target logit of token ``t`` is ``c · (p_t − 1)``.

        Each such equation gives ``c`` exactly, so a few target tokens per example suffice
        (:data:`FIT_TOKENS`, spread over the example): a softmax over every position would cost
        about half the LM head's matmul. ``record_loss`` takes every position (for the loss column).
        """
        with torch.no_grad():
            y = mb.labels.to(logits.device)[:, 1:]  # [B, T-1]
            valid = y != IGNORE
            if self.record_loss:
                pick = valid
            else:
                rank = valid.cumsum(1) - 1  # index of each target among its example's targets
                stride = (valid.sum(1, keepdim=True) + FIT_TOKENS - 1) // FIT_TOKENS
                pick = valid & (rank % stride.clamp(min=1) == 0)
            b, t = pick.nonzero(as_tuple=True)  # [M] chosen target tokens
            yt = y[b, t].unsqueeze(1)  # [M, 1]
            lg = logits[b, t].float()  # [M, V]
            tok = torch.logsumexp(lg, dim=-1) - lg.gather(1, yt).squeeze(1)  # [M] token losses
            pm1 = torch.expm1(-tok)  # p_y - 1
            if self.record_loss:
                mb.loss = torch.zeros(y.shape[0], device=tok.device).index_add_(0, b, tok)
            mb.num_tokens = valid.sum(1)

        def grad_hook(g: torch.Tensor) -> None:
            with torch.no_grad():
                mb.fit.append((g[b, t].gather(1, yt).squeeze(1).float(), pm1, g.dtype))

        logits.register_hook(grad_hook)

    @staticmethod
    def _hook_log_probs(mb: MicroBatch, log_probs: torch.Tensor, mask: torch.Tensor | None) -> None:
        """A fused LM head (TRL) returns target log-probabilities ``[B, T-1]``: their gradient is ``−c``."""
        with torch.no_grad():
            valid = (mb.labels.to(log_probs.device)[:, 1:] != IGNORE) if mask is None else mask.bool()
            w = -valid.float()
            mb.loss, mb.num_tokens = -(log_probs.float() * valid).sum(1), valid.sum(1)
        log_probs.register_hook(lambda g: mb.fit.append((g.float() * valid, w, g.dtype)))

    def scale(self, mb: MicroBatch) -> float:
        """The loss's factor ``c`` on each example's summed token loss, fitted on the head's gradient."""
        if self.given is not None:
            return float(self.given)
        if not mb.fit:
            raise ValueError(
                "the model's output logits (or a fused head's log_probs) received no gradient, so the loss scale "
                "cannot be measured (is the loss computed from the model's output?); pass loss_scale= explicitly"
            )
        gy = sum(f[0] for f in mb.fit)
        pm1, dtype = mb.fit[0][1], mb.fit[0][2]
        den = float((pm1 * pm1).sum())
        if den == 0.0:
            return float("nan")  # no target token with p < 1: nothing to learn from this batch
        c = float((gy * pm1).sum()) / den
        resid = float((gy - c * pm1).abs().max())
        tol = SCALE_TOLERANCE.get(dtype, 5e-2)
        if resid > tol * abs(c) * float(pm1.abs().max()) + 1e-30:
            raise ValueError(
                f"the training loss is not a uniformly scaled sum of token cross-entropies (fit residual "
                f"{resid:.3g} against {abs(c) * float(pm1.abs().max()):.3g}: label smoothing, per-token or "
                "per-example weights?); gradindex stores gradients of the summed token loss: pass loss_scale= "
                "if the loss is one, or turn the weighting off while capturing"
            )
        return c
