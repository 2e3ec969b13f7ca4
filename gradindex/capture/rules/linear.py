"""``nn.Linear``: ``y = W x + b``, ``W`` ``[N_o, N_i]`` (LoRA's ``lora_A``/``lora_B`` are ones too)."""

from __future__ import annotations

from torch import nn

from gradindex.capture.layers import LayerInfo, register_layer, stack


@register_layer(nn.Linear)
def linear(m: nn.Linear) -> LayerInfo:
    return LayerInfo(m.in_features, m.out_features, m.bias is not None, "linear", stack)
