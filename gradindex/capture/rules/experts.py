"""Fused mixture-of-experts weights (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE in transformers 5).

The experts module holds ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` and is called
as ``experts(x [N, H], top_k_index [N, k], top_k_weights [N, k])`` on the ``N = B·T`` flattened tokens.
Expert ``e`` on its routed tokens ``t`` (weight ``w_te``) computes ``z = W_gu[e] x_t``, ``[gate, up] = z``,
``h = act(gate) ⊙ up`` and adds ``w_te · W_d[e] h`` to the output. With ``g_t`` the output gradient:

* ``down_proj[e]``: ``a_t = h``, ``g'_t = w_te g_t``;
* ``gate_up_proj[e]``: ``a_t = x_t``, ``g'_t = [act'(gate) ⊙ up ⊙ d, act(gate) ⊙ d]`` with ``d = W_d[e]ᵀ g'_t``;

and zero on the tokens not routed to ``e``. Each expert's two matrices are two layers
(``...experts.gate_up_proj.3``, ``...experts.down_proj.3``), projected and preconditioned alone. The
factors are recomputed from the hook's inputs in float32 (one extra expert forward), whatever the
model's dtype. A layout other than this one (transposed, with biases, interleaved gate/up, a norm after
the experts: gpt-oss for one) matches no rule and is refused by name (:func:`uncovered_fused`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from gradindex.capture.layers import GroupMember, GroupRule, LayerInfo, register_group, register_layer

SIDES = ("gate_up_proj", "down_proj")


class ExpertWeight(GroupMember):
    """Stand-in module for one expert's matrix (``side``, expert ``index``) of a fused experts module."""

    def __init__(self, experts: nn.Module, side: str, index: int):
        super().__init__(experts)
        self.side, self.index = side, index
        w = getattr(experts, side)
        self.n_out, self.n_in = int(w.shape[1]), int(w.shape[2])

    @property
    def fused(self) -> nn.Parameter:
        return getattr(self.group, self.side)


@register_layer(ExpertWeight)
def expert(m: ExpertWeight) -> LayerInfo:
    return LayerInfo(m.n_in, m.n_out, False, "expert", lambda w, b: w)


def _is_fused_experts(m: nn.Module) -> bool:
    gu, d = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(d, nn.Parameter) and gu.ndim == 3 and d.ndim == 3):
        return False
    E, two_i, H = gu.shape
    flags = (getattr(m, "has_gate", True) and getattr(m, "is_concatenated", True)
             and not getattr(m, "has_bias", False) and not getattr(m, "is_transposed", False)
             and not getattr(m, "has_post_expert_norm", False))
    gate = getattr(type(m), "_apply_gate", None)
    others = [n for n, p in m.named_parameters(recurse=False) if n not in SIDES]
    return bool(flags and tuple(d.shape) == (E, H, two_i // 2) and two_i % 2 == 0 and not others
                and callable(getattr(m, "act_fn", None))
                and (gate is None or getattr(gate, "__name__", "") == "_default_apply_gate"))


def _layers(name: str, m: nn.Module) -> dict[str, nn.Module]:
    E = m.gate_up_proj.shape[0]
    return {f"{name}.{side}.{e}": ExpertWeight(m, side, e) for e in range(E) for side in SIDES}


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
        W_gu, W_d = m.gate_up_proj[e].detach().float(), m.down_proj[e].detach().float()  # [2I, H], [H, I]
        z = x[tok] @ W_gu.T  # [n, 2I]
        gate, up = z.chunk(2, dim=-1)  # [n, I] each
        gw = g[tok] * top_w.reshape(N, -1)[tok, kpos].float().unsqueeze(1)  # [n, H]
        d = gw @ W_d  # [n, I]: gradient at h
        with torch.enable_grad():
            gt = gate.detach().requires_grad_()
            act = m.act_fn(gt)  # [n, I]
            (d_gate,) = torch.autograd.grad(act, gt, grad_outputs=d * up)
        act = act.detach()
        if "down_proj" in sides:
            a_d = x.new_zeros(N, W_d.shape[1]).index_copy_(0, tok, act * up)  # [N, I]
            yield sides["down_proj"], a_d, x.new_zeros(N, H).index_copy_(0, tok, gw)
        if "gate_up_proj" in sides:
            g_gu = x.new_zeros(N, W_gu.shape[0]).index_copy_(0, tok, torch.cat([d_gate, d * act], dim=-1))
            yield sides["gate_up_proj"], x.new_zeros(N, H).index_copy_(0, tok, x[tok]), g_gu


FUSED_EXPERTS = register_group(GroupRule("experts", _is_fused_experts, _layers, _factors,
                                         lambda m: [m.gate_up_proj, m.down_proj]))
