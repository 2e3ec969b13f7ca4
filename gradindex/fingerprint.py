"""Fingerprints that tie an index to the model, data and settings that built it."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

_SAMPLE = 1 << 16


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the config, parameter names and shapes, and a strided sample of every parameter.

    Values are rounded to bfloat16 first, so fp32, bf16 and fp16 loads of one checkpoint agree.
    """
    h = hashlib.blake2b(digest_size=16)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        skip = ("torch_dtype", "dtype", "_name_or_path", "transformers_version")
        d = {k: v for k, v in cfg.to_dict().items() if k not in skip}
        h.update(json.dumps(d, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}".encode())
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE)
        sample = flat[::step][:_SAMPLE].to("cpu", torch.bfloat16).float()
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


def digest_bytes(chunks) -> str:
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(c)
    return h.hexdigest()
