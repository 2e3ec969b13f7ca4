"""Fingerprints that tie an index to the model, data and settings that built it."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

_CHUNK = 1 << 24
"""Bytes hashed per step (the only copy a GPU parameter makes on the host)."""


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the config and of every parameter's name, dtype, shape and every byte of its values.

    Every value counts: one changed weight anywhere changes the fingerprint. Values are hashed in
    the dtype they are loaded in, so a float32 and a bfloat16 load of one checkpoint differ (their
    gradients do too); the build identity records that dtype separately, so a mismatch is named.
    Costs one streaming read of the weights (``benchmarks/fingerprint.py``). Under FSDP2 every rank
    must call it (each sharded parameter is gathered in turn); ``DistributedDataParallel``'s wrapper
    is looked through, so a wrapped and a plain model hash alike.
    """
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    h = hashlib.blake2b(digest_size=16)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        # runtime settings, not the function the weights compute: use_cache; the special token ids, which TRL's
        # SFTTrainer writes onto the live model's config from the tokenizer (the saved base config lacks them)
        skip = ("torch_dtype", "dtype", "_name_or_path", "transformers_version", "use_cache", "pad_token_id",
                "bos_token_id", "eos_token_id")
        d = {k: v for k, v in cfg.to_dict().items() if k not in skip}
        h.update(json.dumps(d, sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
        if hasattr(p, "full_tensor"):  # a DTensor sharded by FSDP2: gathered (a collective: every rank calls this)
            p = p.full_tensor()
        flat = p.detach().reshape(-1)
        step = max(1, _CHUNK // flat.element_size())
        for s in range(0, flat.numel(), step):
            h.update(flat[s:s + step].contiguous().view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


def digest_bytes(chunks) -> str:
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(c)
    return h.hexdigest()
