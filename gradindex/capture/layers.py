"""The registry of layer rules (one small file per layer type in :mod:`gradindex.capture.rules`, as opacus does).

A rule says, for one module type, how the per-example weight gradient ``G = Σ_t g_t a_tᵀ`` of the
``[N_o, N_i (+1)]`` matrix gradindex stores comes from what a hook sees:

* a **layer rule** (:func:`register_layer`) turns a module into a :class:`LayerInfo` (widths, bias,
  the weight-gradient layout) and maps ``(module, inputs, grad_output)`` to the per-token factors
  ``(a [.., N_i], g [.., N_o])``; the default factors are the input and the output gradient;
* a **group rule** (:func:`register_group`) covers a module that holds several weight matrices in one
  parameter (a mixture-of-experts' fused experts): it names one virtual layer per matrix and maps
  the module's ``(inputs, grad_output)`` to each virtual layer's factors.

Adding a layer type is one new file in ``rules/`` (a registered function), its import in
``rules/__init__.py`` and its test. This module is the registry only and imports no rule: the rules
package registers the built-in ones and ``gradindex.capture`` imports it, so they are registered
before anything in ``gradindex.capture`` is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from gradindex.errors import UnsupportedLayerError

Factors = Callable[[nn.Module, tuple, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def input_and_grad(module: nn.Module, inputs: tuple, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of a layer that runs once per token: ``a`` = its input, ``g`` = its output gradient."""
    return inputs[0], grad_output


@dataclass(frozen=True)
class LayerInfo:
    """Shapes of one hooked layer, as the math of docs/design.md names them."""

    n_in: int
    """``N_i``: input width, without the bias column."""
    n_out: int
    """``N_o``: output width."""
    bias: bool
    """Whether a column of ones is appended to the inputs for the bias."""
    kind: str
    """Name of the rule that produced it (``linear``, ``conv1d``, ``expert``)."""
    weight_grad_to_G: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    """Maps (weight grad, bias grad) in the module's own layout to ``G`` ``[N_o, N_i (+1)]``."""
    factors: Factors = input_and_grad
    """``(module, inputs, grad_output)`` → per-token ``(a, g)``, tokens first or flattened."""

    @property
    def n_in_total(self) -> int:
        return self.n_in + int(self.bias)


@dataclass(frozen=True)
class GroupRule:
    """A module holding several weight matrices: its virtual layers and their per-token factors."""

    kind: str
    matches: Callable[[nn.Module], bool]
    """Whether this rule covers the module (its layout is exactly the one the rule computes)."""
    layers: Callable[[str, nn.Module], dict[str, nn.Module]]
    """``(name, module)`` → virtual layer name → a stand-in module whose layer rule gives its :class:`LayerInfo`."""
    factors: Callable[[nn.Module, tuple, torch.Tensor, dict[str, nn.Module]], Iterator[tuple[str, torch.Tensor,
                                                                                              torch.Tensor]]]
    """``(module, inputs, grad_output, wanted virtual layers)`` → ``(name, a [B*T, N_i], g [B*T, N_o])`` each."""
    weights: Callable[[nn.Module], list[nn.Parameter]]
    """The fused parameters it attributes (for the share of parameters attributed)."""


class GroupMember(nn.Module):
    """Stand-in module for one virtual layer of a group module (owns no parameter; hooks go on ``group``)."""

    def __init__(self, group: nn.Module):
        super().__init__()
        object.__setattr__(self, "group", group)  # not a submodule: the parameters stay the group's


_RULES: dict[type | str, Callable[[nn.Module], LayerInfo]] = {}
_GROUPS: list[GroupRule] = []


def some_names(names) -> str:
    """The first three of ``names`` (a sequence, or a dict's keys), quoted, ``...`` after them where there are more:
    how an error about a layer shows the ones there are."""
    shown = list(names)[:3]
    return ", ".join(repr(s) for s in shown) + (", ..." if len(names) > 3 else "")


def register_layer(cls: type | str) -> Callable:
    """Register a rule for modules of type ``cls`` (subclasses included); ``cls`` may be the class's dotted name
    (``"transformers.pytorch_utils.Conv1D"``), so that registering it imports nothing (a sharded index's ranks
    search rows and never load transformers)."""

    def deco(fn: Callable[[nn.Module], LayerInfo]) -> Callable[[nn.Module], LayerInfo]:
        _RULES[cls] = fn
        return fn

    return deco


def register_group(rule: GroupRule) -> GroupRule:
    """Register a group rule (tried in registration order)."""
    _GROUPS.append(rule)
    return rule


def rule_for(module: nn.Module) -> Callable[[nn.Module], LayerInfo] | None:
    for cls in type(module).__mro__:
        for key in (cls, f"{cls.__module__}.{cls.__qualname__}"):
            if key in _RULES:
                return _RULES[key]
    return None


def group_rule_for(module: nn.Module) -> GroupRule | None:
    return next((r for r in _GROUPS if r.matches(module)), None)


def layer_info(module: nn.Module) -> LayerInfo:
    rule = rule_for(module)
    if rule is None:
        names = sorted(c.rsplit(".", 1)[-1] if isinstance(c, str) else c.__name__ for c in _RULES)
        raise UnsupportedLayerError(
            f"no capture rule for {type(module).__name__}; supported: "
            f"{names} (add one with gradindex.capture.register_layer)"
        )
    return rule(module)


def stack(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A weight gradient and its bias gradient as one ``[N_o, N_i (+1)]`` matrix."""
    return w if b is None else torch.cat([w, b.unsqueeze(-1)], dim=-1)

