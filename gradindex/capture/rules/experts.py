"""Fused mixture-of-experts weights (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss in transformers 5).

The experts module holds ``gate_up_proj`` and ``down_proj``, one matrix per expert, and is called as
``experts(x [N, H], top_k_index [N, k], top_k_weights [N, k])`` on the ``N = B·T`` flattened tokens.
transformers' ``use_experts_implementation`` flags say how they are stored: ``[E, 2I, H]`` and
``[E, H, I]`` (Mixtral, Qwen2/3-MoE, OLMoE), or transposed, ``[E, H, 2I]`` and ``[E, I, H]``, with
biases ``gate_up_proj_bias [E, 2I]`` and ``down_proj_bias [E, H]`` (gpt-oss, whose gate and up
columns are interleaved and clamped by its own ``_apply_gate``). Expert ``e`` on its routed tokens
``t`` (weight ``w_te``) computes ``z = W_gu[e] x_t (+ b_gu[e])``, ``h = gate(z)`` (the module's
``_apply_gate``: ``act(z_gate) ⊙ z_up`` by default) and adds ``w_te · (W_d[e] h + b_d[e])`` to the
output. With ``g_t`` the output gradient:

* ``down_proj[e]``: ``a_t = [h, 1]``, ``g'_t = w_te g_t``;
* ``gate_up_proj[e]``: ``a_t = [x_t, 1]``, ``g'_t = (∂h/∂z)ᵀ W_d[e]ᵀ w_te g_t`` (autograd through the gate);

(the ``1`` only with biases: the bias gradient is the last column of ``G = Σ_t g'_t a_tᵀ``, so
``G`` is ``[2I, H+1]`` whatever the storage's orientation) and zero on the tokens not routed to
``e``, the bias column included, so covariance factors count routed tokens only. Each expert's two
matrices are two layers (``...experts.gate_up_proj.3``, ``...experts.down_proj.3``), projected and
preconditioned alone. The factors are recomputed from the hook's inputs in float32 (one extra
expert forward), whatever the model's dtype. A layout other than these (no gate, a norm after the
experts) matches no rule and is refused by name (:func:`gradindex.capture.hooks.uncovered_fused`).
The router (a weight used through ``F.linear``, not an ``nn.Linear``) is not attributed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from gradindex.capture.layers import GroupMember, GroupRule, LayerInfo, register_group, register_layer, stack

SIDES = ("gate_up_proj", "down_proj")


def _transposed(m: nn.Module) -> bool:
    return bool(getattr(m, "is_transposed", False))


def _biased(m: nn.Module) -> bool:
    return bool(getattr(m, "has_bias", False))


class ExpertWeight(GroupMember):
    """Stand-in module for one expert's matrix (``side``, expert ``index``) of a fused experts module.

    ``n_in`` counts the bias column when the experts have biases (the group rule appends it to the
    factors itself, on routed tokens only)."""

    def __init__(self, experts: nn.Module, side: str, index: int):
        super().__init__(experts)
        self.side, self.index = side, index
        w = getattr(experts, side)
        n_out, n_in = (int(w.shape[2]), int(w.shape[1])) if _transposed(experts) else (int(w.shape[1]),
                                                                                        int(w.shape[2]))
        self.n_out, self.n_in = n_out, n_in + int(_biased(experts))

    @property
    def fused(self) -> list[nn.Parameter]:
        """The fused parameters this matrix is a slice of (its weight, and its bias if any)."""
        bias = getattr(self.group, f"{self.side}_bias", None) if _biased(self.group) else None
        return [getattr(self.group, self.side)] + ([bias] if bias is not None else [])


@register_layer(ExpertWeight)
def expert(m: ExpertWeight) -> LayerInfo:
    transposed = _transposed(m.group)

    def to_G(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # (one expert's slices)
        return stack(w.T if transposed else w, b)

    return LayerInfo(m.n_in, m.n_out, False, "expert", to_G)


def _is_fused_experts(m: nn.Module) -> bool:
    gu, d = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(d, nn.Parameter) and gu.ndim == 3 and d.ndim == 3):
        return False
    E = gu.shape[0]
    H, two_i = (gu.shape[1], gu.shape[2]) if _transposed(m) else (gu.shape[2], gu.shape[1])
    d_shape = (E, two_i // 2, H) if _transposed(m) else (E, H, two_i // 2)
    biases = {"gate_up_proj_bias": (E, two_i), "down_proj_bias": (E, H)} if _biased(m) else {}
    params = dict(m.named_parameters(recurse=False))
    if set(params) != set(SIDES) | set(biases) or any(tuple(params[n].shape) != s for n, s in biases.items()):
        return False
    gated = getattr(m, "has_gate", True) and not getattr(m, "has_post_expert_norm", False)
    concatenated = getattr(m, "is_concatenated", True) or callable(getattr(type(m), "_apply_gate", None))
    return bool(gated and concatenated and two_i % 2 == 0 and tuple(d.shape) == d_shape
                and (callable(getattr(m, "act_fn", None)) or callable(getattr(type(m), "_apply_gate", None))))


def _gate(m: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``h = gate(z)`` ``[n, I]`` from ``z`` ``[n, 2I]``: the module's own gate, else ``act(gate) ⊙ up``."""
    if callable(getattr(type(m), "_apply_gate", None)):
        return m._apply_gate(z)
    gate, up = z.chunk(2, dim=-1)
    return m.act_fn(gate) * up


def _layers(name: str, m: nn.Module) -> dict[str, nn.Module]:
    E = m.gate_up_proj.shape[0]
    return {f"{name}.{side}.{e}": ExpertWeight(m, side, e) for e in range(E) for side in SIDES}


def _expert(m: nn.Module, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Expert ``e``'s ``W_gu [2I, H]``, ``W_d [H, I]`` (the math's orientation) and biases, float32 constants."""
    W_gu, W_d = m.gate_up_proj[e].detach().float(), m.down_proj[e].detach().float()
    if _transposed(m):
        W_gu, W_d = W_gu.T, W_d.T
    if not _biased(m):
        return W_gu, W_d, None, None
    return W_gu, W_d, m.gate_up_proj_bias[e].detach().float(), m.down_proj_bias[e].detach().float()


def _factors(m: nn.Module, inputs: tuple, grad_output: torch.Tensor,
             wanted: dict[str, nn.Module]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    x, top_i, top_w = inputs[0], inputs[1], inputs[2]
    H = x.shape[-1]
    x = x.reshape(-1, H).float()  # [N, H]
    g = grad_output.reshape(-1, H).float()  # [N, H]
    N = x.shape[0]
    by_expert: dict[int, dict[str, str]] = {}
    for name, w in wanted.items():
        by_expert.setdefault(w.index, {})[w.side] = name
    for e, sides in sorted(by_expert.items()):
        tok, kpos = (top_i.reshape(N, -1) == e).nonzero(as_tuple=True)  # [n] routed tokens (each at most once)
        W_gu, W_d, b_gu, _ = _expert(m, e)  # [2I, H], [H, I], [2I] | None
        z = x[tok] @ W_gu.T if b_gu is None else torch.addmm(b_gu, x[tok], W_gu.T)  # [n, 2I]
        gw = g[tok] * top_w.reshape(N, -1)[tok, kpos].float().unsqueeze(1)  # [n, H]
        d = gw @ W_d  # [n, I]: gradient at h
        with torch.enable_grad():
            zt = z.requires_grad_()
            h = _gate(m, zt)  # [n, I]
            (d_z,) = torch.autograd.grad(h, zt, grad_outputs=d)  # [n, 2I]
        h = h.detach()
        one = [x.new_ones(len(tok), 1)] if b_gu is not None else []
        if "down_proj" in sides:
            a_d = torch.cat([h, *one], dim=1)  # [n, I(+1)]
            yield sides["down_proj"], _scatter(a_d, tok, N), _scatter(gw, tok, N)
        if "gate_up_proj" in sides:
            a_gu = torch.cat([x[tok], *one], dim=1)  # [n, H(+1)]
            yield sides["gate_up_proj"], _scatter(a_gu, tok, N), _scatter(d_z, tok, N)


def _scatter(rows: torch.Tensor, tok: torch.Tensor, N: int) -> torch.Tensor:
    """``[N, n]`` with ``rows`` at the routed tokens ``tok`` and zeros elsewhere."""
    return rows.new_zeros(N, rows.shape[1]).index_copy_(0, tok, rows)


def _weights(m: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in m.named_parameters(recurse=False)]


FUSED_EXPERTS = register_group(GroupRule("experts", _is_fused_experts, _layers, _factors, _weights))
