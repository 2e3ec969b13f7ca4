"""Optimizer-aware influence: per-example gradients preconditioned by Adam's second moment.

Each hooked layer's gradient ``G`` (weight and bias, ``[N_o, N_i(+1)]``) becomes ``G ⊘ (√V + ε)``
before the projection, with ``V`` the optimizer's ``exp_avg_sq`` laid out as ``G`` is; training
and query gradients get the same transform, and the method is then a plain inner product of
stored rows (``--method adam``). Two modes (:class:`gradindex.capture.transform.LayerTransform`):

* ``exact``: the entrywise weight ``1/(√V + ε)``; needs the materialized route.
* ``factored``: Adafactor's rank-1 ``V ≈ r cᵀ / Σr`` (``r``, ``c`` the row and column sums of
  ``V``). With ``ρ = √(r / √Σr)`` and ``γ = √(c / √Σr)``, ``√V ≈ ρ γᵀ``, and the weight
  ``1/((ρ + √ε)(γ + √ε))`` is one diagonal per side, so the factorized route still applies.

The state is read from

* a safetensors file with one tensor per parameter, ``<parameter name>.exp_avg_sq`` (names as in
  ``model.named_parameters()``; a PEFT ``PeftModel``'s ``base_model.model.`` names are read as the
  injected model's that ``--adapter`` loads), and optionally the metadata key ``eps``
  (default 1e-8); :func:`save_second_moments` writes one from a live optimizer; or
* a torch checkpoint of ``torch.optim.Adam``/``AdamW``'s ``state_dict()`` (or a dict holding it
  under ``optimizer``), loaded with ``torch.load(weights_only=True)``: never unpickled otherwise.
  Its integer parameter ids are mapped to names by the model's ``named_parameters()`` order (or
  by the groups' ``param_names`` when the optimizer was given named parameters); every shape
  must match, else the file is refused.

Bias correction (``1 - β₂ᵗ``) is not applied: it scales every ``V`` alike, which moves only ε.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gradindex.capture.hooks import select_layers
from gradindex.capture.layers import LayerInfo, layer_info
from gradindex.capture.transform import LayerTransform

ADAM_MODES = ("exact", "factored")
DEFAULT_EPS = 1e-8
SUFFIX = ".exp_avg_sq"
PEFT_WRAPPER = "base_model.model."
"""What a ``PeftModel`` puts before its injected model's parameter names (a LoRA training loop saves those)."""


@dataclass(frozen=True)
class SecondMoments:
    """Adam's ``exp_avg_sq`` per parameter name, with each parameter's ε, and the file's hash."""

    v: dict[str, torch.Tensor]
    eps: dict[str, float]
    sha256: str
    format: str


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_second_moments(path: str | os.PathLike, model: nn.Module) -> SecondMoments:
    """Read ``exp_avg_sq`` of ``model``'s parameters from ``path`` (module doc); refuse a mismatch."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"optimizer state {str(p)!r} does not exist; pass the file saved from training")
    params = dict(model.named_parameters())
    if p.suffix == ".safetensors":
        v, eps, fmt = _from_safetensors(p, params), None, "safetensors"
    else:
        v, eps, fmt = (*_from_torch(p, params), "torch")
    if eps is None:
        eps = {n: _safetensors_eps(p) for n in v}
    return SecondMoments(v, eps, file_sha256(p), fmt)


def _unwrapped(name: str, params: Mapping[str, nn.Parameter]) -> str:
    """``name`` as ``params`` holds it: a ``PeftModel``'s ``base_model.model.X`` is ``X`` of the injected model that
    ``--adapter`` loads (:func:`gradindex.adapter.attach_adapter`), where only ``X`` is the model's."""
    if name not in params and name.startswith(PEFT_WRAPPER) and name[len(PEFT_WRAPPER):] in params:
        return name[len(PEFT_WRAPPER):]
    return name


def _safetensors_eps(p: Path) -> float:
    from safetensors import safe_open

    with safe_open(str(p), "pt") as f:
        meta = f.metadata() or {}
    try:
        return float(meta.get("eps", DEFAULT_EPS))
    except ValueError:
        raise ValueError(f"{str(p)!r}: metadata 'eps' = {meta['eps']!r} is not a number") from None


def _from_safetensors(p: Path, params: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(p))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{str(p)!r} is not a readable safetensors file ({e})") from None
    out, unknown = {}, []
    for key, t in tensors.items():
        if not key.endswith(SUFFIX):
            continue
        name = _unwrapped(key[: -len(SUFFIX)], params)
        if name not in params:
            unknown.append(name)
            continue
        out[name] = _checked(name, t, params[name], p)
    if unknown:
        raise ValueError(
            f"{str(p)!r} holds second moments of parameters this model does not have ({unknown[:3]}); "
            f"its parameters look like {list(params)[:2]}: save the state of this model's optimizer"
        )
    if not out:
        raise ValueError(f"{str(p)!r} holds no tensor named '<parameter>{SUFFIX}'")
    return out


def _from_torch(p: Path, params: Mapping[str, nn.Parameter]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    try:
        sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{str(p)!r} is not a plain optimizer state_dict (it holds pickled objects that are only "
            f"loaded with weights_only=True: {first}); save `optimizer.state_dict()` alone, or a "
            f"safetensors file of '<parameter>{SUFFIX}' tensors"
        ) from None
    except Exception as e:  # noqa: BLE001 - torch.load raises many types on a corrupt file
        raise ValueError(f"{str(p)!r} is not a readable torch checkpoint ({type(e).__name__}: {e})") from None
    if isinstance(sd, dict) and "optimizer" in sd and isinstance(sd["optimizer"], dict):
        sd = sd["optimizer"]
    if not (isinstance(sd, dict) and "state" in sd and "param_groups" in sd):
        raise ValueError(f"{str(p)!r} is not an optimizer state_dict (no 'state' and 'param_groups')")
    groups = sd["param_groups"]
    ids = [i for g in groups for i in g["params"]]
    named = all("param_names" in g for g in groups)
    names = [n for g in groups for n in g["param_names"]] if named else list(params)
    if not named and len(ids) != len(params):
        raise ValueError(
            f"{str(p)!r} covers {len(ids)} parameters, the model has {len(params)}; its ids cannot be "
            f"mapped to names: save a safetensors file of '<parameter>{SUFFIX}' tensors instead"
        )
    by_id = dict(zip(ids, names, strict=True))
    eps_of = {i: float(g.get("eps", DEFAULT_EPS)) for g in groups for i in g["params"]}
    out, eps = {}, {}
    for i, st in sd["state"].items():
        name = by_id.get(int(i))
        name = name if name is None else _unwrapped(name, params)
        if name is None or name not in params:
            raise ValueError(f"{str(p)!r}: state of parameter id {i} maps to no parameter of this model")
        if "exp_avg_sq" not in st:
            raise ValueError(f"{str(p)!r}: state of {name!r} has no 'exp_avg_sq'; is it an Adam state?")
        out[name] = _checked(name, st["exp_avg_sq"], params[name], p, by_order=not named)
        eps[name] = eps_of[int(i)]
    return out, eps


def _checked(name: str, v: torch.Tensor, param: nn.Parameter, p: Path, by_order: bool = False) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(param.shape):
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        hint = (" (ids were mapped by the model's parameter order; the optimizer's groups list them in "
                "another order: save named second moments as safetensors)") if by_order else ""
        raise ValueError(f"{str(p)!r}: second moment of {name!r} has shape {got}, the parameter "
                         f"{tuple(param.shape)}{hint}")
    if not torch.isfinite(v).all() or (v < 0).any():
        raise ValueError(f"{str(p)!r}: second moment of {name!r} is negative or not finite")
    return v.detach().to("cpu", torch.float64)


def save_second_moments(optimizer: torch.optim.Optimizer, model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the ``exp_avg_sq`` of every parameter of ``model`` in ``optimizer`` as safetensors."""
    from safetensors.torch import save_file

    tensors = {}
    for name, p in model.named_parameters():
        st = optimizer.state.get(p, {})
        if "exp_avg_sq" in st:
            tensors[name + SUFFIX] = st["exp_avg_sq"].detach().float().contiguous().cpu()
    save_file(tensors, str(path), metadata={"eps": repr(optimizer_eps(optimizer))})
    return Path(path)


def optimizer_eps(optimizer) -> float:
    """The one ``eps`` of an Adam optimizer's parameter groups, written beside its second moments (a
    state file read back without it would be weighted with the default 1e-8)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    eps = {float(g.get("eps", DEFAULT_EPS)) for g in inner.param_groups}
    if len(eps) != 1:
        raise ValueError(f"parameter groups use different eps {sorted(eps)}; one file holds one eps")
    return eps.pop()


def layer_second_moment(module: nn.Module, info: LayerInfo, moments: SecondMoments,
                        module_name: str) -> tuple[torch.Tensor, float]:
    """``V`` of one layer in ``G``'s layout ``[N_o, N_i(+1)]`` (float64), and its ε."""
    if info.kind == "expert":
        raise ValueError(f"--optimizer-state does not cover fused expert weights yet ({module_name!r}); choose "
                         "the other layers with --layers (e.g. --layers '*self_attn*')")
    w_name = f"{module_name}.weight"
    b_name = f"{module_name}.bias"
    need = [w_name] + ([b_name] if info.bias else [])
    missing = [n for n in need if n not in moments.v]
    if missing:
        raise ValueError(f"the optimizer state has no second moment of {missing}; was the layer trained?")
    eps = {moments.eps[n] for n in need}
    if len(eps) != 1:
        raise ValueError(f"the weight and bias of {module_name!r} use different eps {sorted(eps)}")
    V = info.weight_grad_to_G(moments.v[w_name], moments.v[b_name] if info.bias else None)
    return V, eps.pop()


def adam_transform(V: torch.Tensor, eps: float, mode: str) -> LayerTransform:
    """The transform of one layer from its ``V`` ``[N_o, N_i(+1)]`` (module doc)."""
    if mode == "exact":
        return LayerTransform(elementwise=(1.0 / (V.sqrt() + eps)).float())
    if mode == "factored":
        r, c = V.sum(1), V.sum(0)  # [N_o], [N_i(+1)]
        s = max(float(r.sum()), torch.finfo(torch.float64).tiny)
        rho, gamma = (r / s**0.5).sqrt(), (c / s**0.5).sqrt()
        return LayerTransform(g=(1.0 / (rho + eps**0.5)).float(), a=(1.0 / (gamma + eps**0.5)).float())
    raise ValueError(f"adam mode {mode!r} is not one of {ADAM_MODES}")


def adam_transforms(moments: SecondMoments, modules: Mapping[str, nn.Module],
                    infos: Mapping[str, LayerInfo], mode: str) -> dict[str, LayerTransform]:
    """layer → transform for every hooked layer."""
    out = {}
    for name, mod in modules.items():
        V, eps = layer_second_moment(mod, infos[name], moments, name)
        out[name] = adam_transform(V, eps, mode)
    return out


def optimizer_record(moments: SecondMoments, mode: str) -> dict:
    """What the manifest keeps of the preconditioning: the identity a query must reproduce."""
    eps = sorted(set(moments.eps.values()))
    return {"kind": "adam", "mode": mode, "sha256": moments.sha256, "format": moments.format,
            "eps": eps[0] if len(eps) == 1 else eps}


def adam_capture_transforms(path: str | os.PathLike, mode: str, model: nn.Module,
                            layers=None) -> tuple[dict[str, LayerTransform], dict]:
    """Transforms of the layers ``layers`` selects (as the capture does) and the manifest record."""
    if mode not in ADAM_MODES:
        raise ValueError(f"--adam-mode {mode!r} is not one of {list(ADAM_MODES)}")
    moments = load_second_moments(path, model)
    modules = select_layers(model, layers)
    device = next(model.parameters()).device
    out = adam_transforms(moments, modules, {n: layer_info(m) for n, m in modules.items()}, mode)
    out = {n: t.to(device) for n, t in out.items()}
    return out, optimizer_record(moments, mode)
