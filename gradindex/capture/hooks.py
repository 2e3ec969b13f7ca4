"""The hook manager: per-token activations and output gradients → per-example projected gradients.

Two modes share one code path (:meth:`GradientCapture._accumulate`):

* ``weight_free=True`` (offline builds, queries): the caller runs the forward pass and then
  :meth:`GradientCapture.backward` on the summed per-example loss. Gradients are taken with
  ``torch.autograd.grad`` with respect to the hooked layers' outputs only, so no parameter
  ``.grad`` is computed and the backward pass stops at the first hooked layer.
* ``weight_free=False`` (live capture inside an unchanged training loop): tensor hooks on the
  layers' outputs fire during the user's own ``loss.backward()``.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from gradindex.capture.layers import LayerInfo, layer_info, rule_for
from gradindex.capture.projection import ProjectionSpec, projection_matrix
from gradindex.capture.routing import ROUTES, choose_route


def _block_prefix(model: nn.Module) -> str | None:
    """Qualified name of the ModuleList holding the transformer blocks (the largest one)."""
    best, best_size = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            size = sum(p.numel() for p in mod.parameters())
            if size > best_size:
                best, best_size = name, size
    return best


def select_layers(model: nn.Module, patterns: Sequence[str] | None = None) -> dict[str, nn.Module]:
    """Hookable modules by qualified name, in model order.

    With no patterns: every supported linear layer inside the transformer blocks (not the
    embeddings nor the LM head). Patterns are shell-style globs on qualified names.
    """
    hookable = {n: m for n, m in model.named_modules() if n and rule_for(m) is not None}
    if not hookable:
        raise ValueError(f"{type(model).__name__} has no supported linear layer to hook")
    if not patterns:
        prefix = _block_prefix(model)
        chosen = {n: m for n, m in hookable.items() if prefix and n.startswith(prefix + ".")}
        if not chosen:
            raise ValueError(
                "could not find the transformer blocks to hook by default; pass layer patterns "
                f"(modules look like {_examples(hookable)})"
            )
        return chosen
    chosen: dict[str, nn.Module] = {}
    for pat in patterns:
        hits = [n for n in hookable if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise ValueError(
                f"layer pattern {pat!r} matched no module; modules look like {_examples(hookable)} "
                "(see `gradindex layers MODEL_DIR`)"
            )
        chosen.update((n, hookable[n]) for n in hits)
    return {n: m for n, m in hookable.items() if n in chosen}


def _examples(names: dict) -> str:
    shown = list(names)[:3]
    return ", ".join(repr(s) for s in shown) + (", ..." if len(names) > 3 else "")


class GradientCapture:
    """Attach to chosen linear layers of a model and produce per-example projected gradients.

    Use as a context manager (hooks are removed on exit). Per batch: :meth:`set_mask`, forward,
    backward (:meth:`backward` in weight-free mode, or the user's own), then :meth:`pop`.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[str] | None = None,
        projection: ProjectionSpec = ProjectionSpec(),
        route: str = "auto",
        weight_free: bool = True,
        collect_covariance: bool = False,
    ) -> None:
        if route not in ROUTES:
            raise ValueError(f"route {route!r} is not one of {ROUTES}")
        self.model = model
        self.modules = select_layers(model, layers)
        self.infos: dict[str, LayerInfo] = {n: layer_info(m) for n, m in self.modules.items()}
        self.projection = projection
        self.route = route
        self.weight_free = weight_free
        self.collect_covariance = collect_covariance
        self.route_counts: Counter = Counter()
        self._handles: list = []
        self._mask: torch.Tensor | None = None
        self._records: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._grads: dict[str, torch.Tensor] = {}
        self._proj: dict[tuple[str, str, str], torch.Tensor] = {}
        self.cov_a: dict[str, torch.Tensor] = {}  # Σ_tokens ā āᵀ, float64
        self.cov_g: dict[str, torch.Tensor] = {}  # Σ_tokens ḡ ḡᵀ, float64
        self.cov_tokens: dict[str, int] = {}

    # -- shapes -------------------------------------------------------------------------------
    def dims(self, name: str) -> tuple[int, int]:
        """``(rows, cols)`` of the stored per-example matrix of a layer (``k_g, k_a`` or ``N_o, N_i+1``)."""
        info = self.infos[name]
        if self.projection.is_identity:
            return info.n_out, info.n_in_total
        return self.projection.k_g, self.projection.k_a

    def dim(self, name: str) -> int:
        r, c = self.dims(name)
        return r * c

    def projection_for(self, name: str, side: str, device: torch.device) -> torch.Tensor:
        key = (name, side, str(device))
        if key not in self._proj:
            info = self.infos[name]
            n = info.n_in_total if side == "a" else info.n_out
            self._proj[key] = projection_matrix(self.projection, name, side, n, device)
        return self._proj[key]

    # -- lifetime -----------------------------------------------------------------------------
    def attach(self) -> GradientCapture:
        if not self._handles:
            for name, mod in self.modules.items():
                self._handles.append(mod.register_forward_hook(self._forward_hook(name)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._records.clear()

    def __enter__(self) -> GradientCapture:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- per batch ----------------------------------------------------------------------------
    def set_mask(self, mask: torch.Tensor | None) -> None:
        """``[B, T]`` weights of token positions (1 real, 0 padding) for the next batch."""
        self._mask = mask

    def backward(self, loss: torch.Tensor) -> None:
        """Weight-free backward: gradients w.r.t. hooked outputs only, fed to the accumulator."""
        if not self._records:
            raise RuntimeError("no hooked layer ran with gradients enabled since the last backward")
        outs = [r[2] for r in self._records]
        grads = torch.autograd.grad(loss, outs, allow_unused=True)
        records, self._records = self._records, []
        for (name, a, out), g in zip(records, grads):
            self._accumulate(name, a, torch.zeros_like(out) if g is None else g)

    def pop(self) -> dict[str, torch.Tensor]:
        """Per-example gradients of the last batch: layer name → ``[B, D]`` float32."""
        out, self._grads = self._grads, {}
        self._records.clear()
        return out

    # -- internals ----------------------------------------------------------------------------
    def _forward_hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor):
            if not torch.is_grad_enabled():
                return None
            a = inputs[0].detach()
            if self.weight_free:
                if not output.requires_grad:  # frozen upstream: start the graph here
                    output = output.detach().requires_grad_()
                self._records.append((name, a, output))
                return output
            if output.requires_grad:
                output.register_hook(lambda g, a=a: self._accumulate(name, a, g))
            return None

        return hook

    def _accumulate(self, name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        info = self.infos[name]
        B = a.shape[0]
        a = a.reshape(B, -1, info.n_in).float()  # [B, T, N_i]
        g = g.reshape(B, -1, info.n_out).float()  # [B, T, N_o]
        T = a.shape[1]
        mask = self._mask
        if mask is not None:
            if mask.shape != (B, T):
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} does not fit layer {name!r} inputs "
                    f"[{B}, {T}, {info.n_in}]"
                )
            m = mask.to(a.device, a.dtype).unsqueeze(-1)  # [B, T, 1]
            a = a * m
        else:
            m = torch.ones(B, T, 1, device=a.device, dtype=a.dtype)
        if info.bias:
            a = torch.cat([a, m], dim=-1)  # [B, T, N_i+1]
        if self.projection.is_identity:
            G = torch.bmm(g.transpose(1, 2), a)  # [B, N_o, N_i+1]
            self.route_counts["materialized"] += 1
            if self.collect_covariance:
                self._add_covariance(name, a, g, m)
        else:
            P_a = self.projection_for(name, "a", a.device)  # [k_a, N_i+1]
            P_g = self.projection_for(name, "g", g.device)  # [k_g, N_o]
            route = self.route
            if route == "auto":
                route = choose_route(B, T, a.shape[-1], info.n_out, P_a.shape[0], P_g.shape[0])
            self.route_counts[route] += 1
            if route == "factorized" or self.collect_covariance:
                ab = a @ P_a.T  # [B, T, k_a]
                gb = g @ P_g.T  # [B, T, k_g]
                if self.collect_covariance:
                    self._add_covariance(name, ab, gb, m)
            if route == "factorized":
                G = torch.bmm(gb.transpose(1, 2), ab)  # [B, k_g, k_a]
            else:
                G = torch.bmm(g.transpose(1, 2), a)  # [B, N_o, N_i+1]
                G = P_g @ (G @ P_a.T)  # [B, k_g, k_a]
        G = G.reshape(B, -1)
        prev = self._grads.get(name)
        self._grads[name] = G if prev is None else prev + G

    def _add_covariance(self, name: str, a: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> None:
        a2 = a.reshape(-1, a.shape[-1])
        g2 = (g * m).reshape(-1, g.shape[-1])  # padding tokens carry no curvature
        ca = (a2.T @ a2).double()
        cg = (g2.T @ g2).double()
        n = int(m.sum().item())
        if name in self.cov_a:
            self.cov_a[name] += ca
            self.cov_g[name] += cg
            self.cov_tokens[name] += n
        else:
            self.cov_a[name], self.cov_g[name], self.cov_tokens[name] = ca, cg, n
