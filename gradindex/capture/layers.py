"""Per-layer-type rules, registered by decorator (one function per type, as opacus does).

A rule turns a module into a :class:`LayerInfo`: its input and output widths, whether it has a
bias, and how to lay its weight (and bias) gradient out as the ``[N_o, N_i (+1)]`` matrix ``G``
that gradindex stores. Adding a layer type is one new registered function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D  # GPT-2 style linear layer: y = x W + b, W [N_i, N_o]


@dataclass(frozen=True)
class LayerInfo:
    """Shapes of one hooked layer, as the math of DESIGN.md names them."""

    n_in: int
    """``N_i``: input width, without the bias column."""
    n_out: int
    """``N_o``: output width."""
    bias: bool
    """Whether a column of ones is appended to the inputs for the bias."""
    kind: str
    """Name of the rule that produced it (``linear``, ``conv1d``)."""
    weight_grad_to_G: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    """Maps (weight grad, bias grad) in the module's own layout to ``G`` ``[N_o, N_i (+1)]``."""

    @property
    def n_in_total(self) -> int:
        return self.n_in + int(self.bias)


_RULES: dict[type, Callable[[nn.Module], LayerInfo]] = {}


def register_layer(cls: type) -> Callable:
    """Register a rule for modules of type ``cls`` (subclasses included)."""

    def deco(fn: Callable[[nn.Module], LayerInfo]) -> Callable[[nn.Module], LayerInfo]:
        _RULES[cls] = fn
        return fn

    return deco


def rule_for(module: nn.Module) -> Callable[[nn.Module], LayerInfo] | None:
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def layer_info(module: nn.Module) -> LayerInfo:
    rule = rule_for(module)
    if rule is None:
        raise TypeError(
            f"no capture rule for {type(module).__name__}; supported: "
            f"{sorted(c.__name__ for c in _RULES)} (add one with gradindex.capture.register_layer)"
        )
    return rule(module)


def _stack(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return w if b is None else torch.cat([w, b.unsqueeze(-1)], dim=-1)


@register_layer(nn.Linear)
def _linear(m: nn.Linear) -> LayerInfo:
    return LayerInfo(m.in_features, m.out_features, m.bias is not None, "linear", _stack)


@register_layer(Conv1D)
def _conv1d(m: nn.Module) -> LayerInfo:
    n_in, n_out = m.weight.shape
    return LayerInfo(n_in, n_out, m.bias is not None, "conv1d", lambda w, b: _stack(w.transpose(-1, -2), b))
