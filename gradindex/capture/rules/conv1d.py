"""GPT-2's ``Conv1D``: a linear layer stored transposed, ``y = x W + b``, ``W`` ``[N_i, N_o]``."""

from __future__ import annotations

from torch import nn

from gradindex.capture.layers import LayerInfo, register_layer, stack


@register_layer("transformers.pytorch_utils.Conv1D")  # (by name: registering it does not import transformers)
def conv1d(m: nn.Module) -> LayerInfo:
    n_in, n_out = m.weight.shape
    return LayerInfo(n_in, n_out, m.bias is not None, "conv1d", lambda w, b: stack(w.transpose(-1, -2), b))
