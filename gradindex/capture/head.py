"""The LM head and the per-example loss, fused with their backward (offline capture only).

The plain path (``model(...).logits`` → :func:`gradindex.data.per_example_loss`) keeps several
``[B, T, V]`` tensors alive (logits, a shifted copy, log-probabilities, and in the backward their
gradients), which at a vocabulary of thousands costs about half as much again as the head's two
matmuls. Here the head runs on the rows that have a target only, some hundreds of rows at a time:
each chunk's logits become log-probabilities, the token losses, and then, in place, the gradient
``softmax - onehot``, which is multiplied by the head weight at once. All of it runs in float32 for
any model dtype (a bf16 head weight is cast in blocks), so only the final ``[rows, d]`` gradient is
rounded to the model's dtype. The backward only scales
those saved ``[rows, d]`` gradients by the incoming per-example weights.

The head's parameters are constants here: capture differentiates with respect to hooked layer
outputs only, so no weight gradient is ever formed.
"""

from __future__ import annotations

import torch
from torch import nn

from gradindex.capture.sampling import sample_targets
from gradindex.data import IGNORE

PLAIN_HEAD_MODELS = frozenset({
    "BloomForCausalLM", "FalconForCausalLM", "GemmaForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM",
    "LlamaForCausalLM", "MistralForCausalLM", "OPTForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM",
    "Qwen2ForCausalLM", "Qwen3ForCausalLM",
})
"""Model classes whose logits are exactly ``head(base_model(...)[0])``: no scaling or capping."""

CHUNK_BYTES = {"cpu": 16 << 20}
"""Bytes of one chunk of fp32 logits per device type (elsewhere 256 MiB). On CPU, 16 MiB is
about the fastest measured: smaller chunks make the head's matmuls short and slow (128 rows cost
~30% more than 512 at vocab 8192, one or two threads), larger ones leave the cache."""
CAST_BYTES = 32 << 20
"""Bytes of one float32 block of a low-precision head weight (:func:`_weight_blocks`)."""
MIN_ROWS = 256
"""Fewest rows per chunk, whatever the vocabulary: below it the matmuls lose efficiency."""


def plain_head(model: nn.Module, hooked: set[nn.Module]) -> nn.Linear | None:
    """The output layer when the fused path applies to ``model``, else ``None``.

    It applies to the known plain models (:data:`PLAIN_HEAD_MODELS`, exact classes) whose head
    is an ``nn.Linear`` that is not itself hooked (a hooked head must run its own forward).
    """
    if type(model).__name__ not in PLAIN_HEAD_MODELS:
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head in hooked or model.base_model is model:
        return None
    return head


class _TokenLossWithGrad(torch.autograd.Function):
    """Token losses ``[N]`` of rows ``h`` ``[N, d]``; the gradient w.r.t. ``h`` is formed in forward.

    With uniforms ``u`` ``[N]``, each row's target is sampled from its own softmax
    (:func:`gradindex.capture.sampling.sample_targets`) instead of read from ``targets``.
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        N, V = h.shape[0], weight.shape[0]
        rows = max(MIN_ROWS, CHUNK_BYTES.get(h.device.type, 256 << 20) // (4 * V))
        loss = torch.empty(N, device=h.device, dtype=torch.float32)
        grad_h = torch.empty_like(h)  # [N, d]
        for s in range(0, N, rows):
            e = min(s + rows, N)
            logits = _logits_f32(h[s:e], weight, bias)  # [n, V] fp32
            logp = torch.log_softmax(logits, dim=-1)  # [n, V] fp32
            del logits
            if u is None:
                y = targets[s:e, None]  # [n, 1]
                loss[s:e] = -logp.gather(1, y).squeeze(1)
                dlogits = logp.exp_()  # softmax, in place
            else:
                dlogits = logp.exp()  # softmax
                y = sample_targets(dlogits, u[s:e])[:, None]  # [n, 1]
                loss[s:e] = -logp.gather(1, y).squeeze(1)
                del logp
            dlogits.scatter_add_(1, y, torch.full_like(y, -1, dtype=dlogits.dtype))  # - onehot
            grad_h[s:e] = _grad_f32(dlogits, weight)  # [n, d], rounded once to h's dtype
        ctx.save_for_backward(grad_h)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype).unsqueeze(1), None, None, None, None


def _weight_blocks(weight: torch.Tensor):
    """``(start, end, block as float32)`` over the vocabulary rows of ``weight`` ``[V, d]``: the whole
    matrix when it is float32 already, else blocks of :data:`CAST_BYTES` cast one at a time (a bf16
    model's head, computed in float32 without a float32 copy of it)."""
    V, d = weight.shape
    if weight.dtype == torch.float32:
        yield 0, V, weight
        return
    step = max(1, CAST_BYTES // (4 * d))
    for v in range(0, V, step):
        yield v, min(v + step, V), weight[v:v + step].float()


def _logits_f32(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h W^T + b`` ``[n, V]`` in float32 from ``h`` ``[n, d]`` of any dtype (the per-example math of a bf16
    model in float32: its loss and softmax gradient do not round through bf16 logits)."""
    h32 = h.float()
    out = torch.empty(h.shape[0], weight.shape[0], device=h.device, dtype=torch.float32)
    for v, w, W in _weight_blocks(weight):
        if bias is None:
            torch.mm(h32, W.t(), out=out[:, v:w])
        else:
            torch.addmm(bias[v:w].float(), h32, W.t(), out=out[:, v:w])
    return out


def _grad_f32(dlogits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``dlogits W`` ``[n, d]`` in float32 (``dlogits`` ``[n, V]`` float32)."""
    out = None
    for v, w, W in _weight_blocks(weight):
        part = dlogits[:, v:w] @ W  # [n, d]
        out = part if out is None else out.add_(part)
    return out


def fused_per_example_loss(
    hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, uniforms: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`gradindex.data.per_example_loss`, from the final hidden states ``[B, T, d]``.

    Returns ``[B]`` summed token losses (fp32; differentiable w.r.t. ``hidden``) and ``[B]``
    target counts. ``labels`` ``[B, T]`` are unshifted, ``IGNORE`` where there is no target.
    ``uniforms`` ``[B, T-1]`` (optional) sample each target from the model instead (true Fisher).
    """
    B, T, d = hidden.shape
    targets = labels[:, 1:]  # [B, T-1]
    has_target = targets != IGNORE  # [B, T-1]
    keep = has_target.reshape(-1).nonzero().squeeze(1)  # [N] flat rows with a target
    h = hidden[:, :-1].reshape(-1, d).index_select(0, keep)  # [N, d]
    y = targets.reshape(-1).index_select(0, keep)  # [N]
    weight = head.weight.detach()
    bias = None if head.bias is None else head.bias.detach()
    u = None if uniforms is None else uniforms.to(hidden.device).reshape(-1).index_select(0, keep)  # [N]
    tok = _TokenLossWithGrad.apply(h, weight, bias, y, u)  # [N]
    example = torch.div(keep, max(T - 1, 1), rounding_mode="floor")  # [N]
    loss = torch.zeros(B, device=hidden.device, dtype=torch.float32).index_add(0, example, tok)
    return loss, has_target.sum(dim=1)
