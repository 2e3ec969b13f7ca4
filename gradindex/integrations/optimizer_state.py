"""Adam's second moment at chosen steps, for optimizer-aware preconditioning.

``OUT/optimizer/step-NNNNNNN.safetensors`` holds one float32 tensor per trained parameter, keyed
``<parameter name>.exp_avg_sq`` (names as ``model.named_parameters()`` gives them), saved after
``NNNNNNN`` optimizer updates: the state in force while the rows with ``step == NNNNNNN`` were
captured. Its metadata records the optimizer's ``eps`` (the one :func:`gradindex.capture.adam.load_second_moments`
reads back), as :func:`gradindex.capture.adam.save_second_moments` does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from gradindex import distributed
from gradindex.capture.adam import optimizer_eps
from gradindex.spec import layout

OPTIMIZER_DIR = layout.OPTIMIZER_DIR
KEY_SUFFIX = ".exp_avg_sq"


def optimizer_state_path(out_dir: str | Path, step: int) -> Path:
    return layout.IndexLayout.of(out_dir).optimizer_state(step)


def second_moments(optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """``{<param name>.exp_avg_sq: tensor}`` of every parameter the optimizer holds that state for."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for p, st in inner.state.items():
        if "exp_avg_sq" in st and id(p) in names:
            v = st["exp_avg_sq"]
            v = v.full_tensor() if hasattr(v, "full_tensor") else v  # FSDP2-sharded state: gathered (collective)
            out[names[id(p)] + KEY_SUFFIX] = v.detach().float().cpu().contiguous()
    if not out:
        raise ValueError(
            f"the optimizer ({type(inner).__name__}) holds no 'exp_avg_sq' state for the model's parameters; "
            "save_optimizer_state needs Adam or AdamW (and a step already taken)"
        )
    return out


def save_second_moments(optimizer, model: nn.Module, out_dir: str | Path, step: int) -> dict:
    """Write the state file for ``step``; return its manifest entry."""
    from safetensors.torch import save_file

    if optimizer is None:
        raise ValueError("save_optimizer_state needs the optimizer: pass optimizer= to GradIndexCapture")
    tensors = second_moments(optimizer, distributed.unwrap(model))  # every rank (FSDP2 gathers)
    eps = optimizer_eps(optimizer)
    path = optimizer_state_path(out_dir, step)
    entry = {"step": step, "file": f"{OPTIMIZER_DIR}/{path.name}", "tensors": len(tensors)}
    if distributed.rank() > 0:  # the state is the same on every rank: rank 0 writes it
        return entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata={"step": str(step), "key_format": "<param name>.exp_avg_sq",
                                              "eps": repr(eps)})
    tmp.replace(path)
    return entry
