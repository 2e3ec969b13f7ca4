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
import re
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gradindex.adapter import adapter_layers
from gradindex.capture.gram import add_gram, gram_block
from gradindex.capture.layers import GroupMember, LayerInfo, group_rule_for, layer_info, rule_for
from gradindex.capture.projection import ProjectionSpec, projection_matrix
from gradindex.capture.routing import ROUTES, choose_route
from gradindex.capture.transform import SIDES, LayerTransform


def _with_ones(a: torch.Tensor, m: torch.Tensor | None, bias: bool) -> torch.Tensor:
    """``a`` ``[B, T, N_i]`` times the token weights ``m``, with a column of ``m`` (or 1) for the bias."""
    if not bias:
        return a if m is None else a * m
    B, T, n_in = a.shape
    out = a.new_empty(B, T, n_in + 1)  # [B, T, N_i+1]
    if m is None:
        out[..., :n_in] = a
        out[..., n_in] = 1.0
    else:
        torch.mul(a, m, out=out[..., :n_in])
        out[..., n_in:] = m
    return out


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
    embeddings nor the LM head), or, on a model with a LoRA adapter, the adapter's ``lora_A`` and
    ``lora_B`` linears (:mod:`gradindex.adapter`). Patterns are shell-style globs on qualified names.
    """
    hookable = hookable_layers(model)
    if not hookable:
        raise ValueError(f"{type(model).__name__} has no supported linear layer to hook")
    adapter = adapter_layers(hookable)
    if not patterns and adapter:
        return {n: hookable[n] for n in adapter}
    if not patterns:
        prefix = _block_prefix(model)
        chosen = {n: m for n, m in hookable.items() if prefix and n.startswith(prefix + ".")}
        uncovered = uncovered_fused(model)
        if uncovered:
            raise ValueError(
                f"{uncovered[0]} is a fused 3-D weight (e.g. mixture-of-experts experts) in a layout no capture rule "
                "covers, so a default build would leave it out; attribute the other layers by choosing them with "
                "--layers (e.g. --layers '*self_attn*'), or add a rule (gradindex.capture.layers.register_group)"
            )
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


def hookable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every module a layer rule covers, and the virtual layers of the modules a group rule covers, by name."""
    out: dict[str, nn.Module] = {}
    for n, m in model.named_modules():
        if not n:
            continue
        if rule_for(m) is not None:
            out[n] = m
        group = group_rule_for(m)
        if group is not None:
            out.update(group.layers(n, m))
    return out


def uncovered_fused(model: nn.Module) -> list[str]:
    """Names (block index as ``*``) of 3-D parameters inside the blocks that no group rule covers."""
    prefix = _block_prefix(model)
    out: list[str] = []
    for n, m in model.named_modules():
        if not prefix or not n.startswith(prefix + ".") or group_rule_for(m) is not None:
            continue
        for pn, p in m.named_parameters(recurse=False):
            glob = re.sub(r"\.\d+\.", ".*.", f"{n}.{pn}")
            if p.ndim >= 3 and glob not in out:
                out.append(glob)
    return out


def owned_parameters(modules: Mapping[str, nn.Module]) -> list[nn.Parameter]:
    """The parameters the chosen layers attribute (a fused expert matrix counts once)."""
    seen: dict[int, nn.Parameter] = {}
    for m in modules.values():
        fused = getattr(m, "fused", None)  # a group's stand-in: the fused parameter(s) it is a slice of
        for p in [fused] if isinstance(fused, nn.Parameter) else fused or m.parameters(recurse=False):
            seen.setdefault(id(p), p)
    return list(seen.values())


def attributed_share(model: nn.Module, modules: Mapping[str, nn.Module]) -> float:
    """Share of the non-embedding parameters (the input embeddings and the LM head left out) the layers attribute."""
    skip = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
            for p in m.parameters()}
    total = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return sum(p.numel() for p in owned_parameters(modules) if id(p) not in skip) / max(1, total)


def unhooked_weights(model: nn.Module, chosen: Mapping[str, nn.Module]) -> list[str]:
    """Weight matrices inside the transformer blocks that no module of ``chosen`` owns, as globs with the
    block index as ``*`` (e.g. a mixture-of-experts' fused expert weights, which no capture rule covers)."""
    prefix = _block_prefix(model)
    if not prefix:
        return []
    owned = {id(p) for p in owned_parameters(chosen)}
    out: list[str] = []
    for name, p in model.named_parameters():
        if name.startswith(prefix + ".") and p.ndim >= 2 and id(p) not in owned:
            glob = re.sub(r"\.\d+\.", ".*.", name)
            if glob not in out:
                out.append(glob)
    return out


def _check_transforms(
    transforms: Mapping[str, LayerTransform | Mapping[str, torch.Tensor]], infos: dict[str, LayerInfo]
) -> dict[str, LayerTransform]:
    """Validate per-layer transforms (a :class:`LayerTransform`, or ``{"a": M_a, "g": M_g}`` dense maps)."""
    out: dict[str, LayerTransform] = {}
    for name, t in transforms.items():
        if name not in infos:
            raise ValueError(f"transform given for layer {name!r}, which is not hooked (hooked: {_examples(infos)})")
        if not isinstance(t, LayerTransform):
            t = LayerTransform.from_maps(dict(t))
        info = infos[name]
        for side in SIDES:
            n = info.n_in_total if side == "a" else info.n_out
            M, d = t.map(side), t.scale(side)
            if M is not None and (M.ndim != 2 or M.shape[1] != n):
                raise ValueError(f"transform of layer {name!r} side {side!r} must be [m, {n}], got {tuple(M.shape)}")
            if d is not None and tuple(d.shape) != (n,):
                raise ValueError(f"scales of layer {name!r} side {side!r} must be [{n}], got {tuple(d.shape)}")
        if t.elementwise is not None and tuple(t.elementwise.shape) != (info.n_out, info.n_in_total):
            raise ValueError(f"entrywise weights of layer {name!r} must be [{info.n_out}, {info.n_in_total}], "
                             f"got {tuple(t.elementwise.shape)}")
        if t.keep is not None:
            size = t.out_size("g", info.n_out) * t.out_size("a", info.n_in_total)
            if t.keep.ndim != 1 or not len(t.keep) or int(t.keep.min()) < 0 or int(t.keep.max()) >= size:
                raise ValueError(f"kept coordinates of layer {name!r} must be a non-empty [d] index into its "
                                 f"{size} mapped coordinates")
        out[name] = t
    return out


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (a checkpointed block's forward is being recomputed)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _group_key(module: nn.Module) -> str:
    return f"<group {id(module)}>"


def _hook_groups(modules: Mapping[str, nn.Module]) -> dict[str, tuple[nn.Module, dict[str, nn.Module]]]:
    """The group modules behind the chosen stand-ins, each with the stand-ins chosen of it."""
    out: dict[str, tuple[nn.Module, dict[str, nn.Module]]] = {}
    for name, m in modules.items():
        parent = m.group if isinstance(m, GroupMember) else None
        if parent is not None:
            out.setdefault(_group_key(parent), (parent, {}))[1][name] = m
    return out


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
        collect_full_covariance: bool = False,
        transforms: Mapping[str, LayerTransform | Mapping[str, torch.Tensor]] | None = None,
        keep_tokens: bool = False,
    ) -> None:
        if route not in ROUTES:
            raise ValueError(f"route {route!r} is not one of {ROUTES}")
        self.model = model
        self.modules = select_layers(model, layers)
        self.infos: dict[str, LayerInfo] = {n: layer_info(m) for n, m in self.modules.items()}
        self._groups = _hook_groups(self.modules)
        """hooked module → its virtual layers (name → stand-in), for modules a group rule covers."""
        self.projection = projection
        self.transforms = _check_transforms(transforms or {}, self.infos)
        """layer → change of coordinates applied before the projection (:mod:`gradindex.capture.transform`)."""
        if collect_covariance and any(t.elementwise is not None for t in self.transforms.values()):
            raise ValueError("covariance factors of entrywise-weighted gradients are not supported (the weights "
                             "have no per-token form); collect them without --optimizer-state")
        if (collect_covariance or keep_tokens) and any(t.keep is not None for t in self.transforms.values()):
            raise ValueError("rows of chosen eigen-coordinates (the eigen basis) have no factored form: they are "
                             "whitened at capture and need no covariance factors or per-token factors")
        self.route = route
        self.weight_free = weight_free
        self.collect_covariance = collect_covariance
        self.collect_full_covariance = collect_full_covariance
        self.keep_tokens = keep_tokens
        """Also keep each layer's per-token factors of every batch (:meth:`pop_tokens`)."""
        self._token_parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.route_counts: Counter = Counter()
        self._handles: list = []
        self._mask: torch.Tensor | None = None
        self._batch_shape: tuple[int, int] | None = None
        self._records: list[tuple[str, tuple, GradientEdge, tuple]] = []
        """Weight-free: per hooked call, its key, inputs, the output's gradient edge and ``(shape, dtype, device)``
        (the edge, not the output: an output no later op saves is freed in the forward, as without hooks)."""
        self._grads: dict[str, torch.Tensor] = {}
        self._proj: dict[tuple[str, str, str], torch.Tensor | None] = {}
        self._proj_a: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._mask_tokens: int | None = None
        self.cov_a: dict[str, torch.Tensor] = {}  # Σ_tokens ā āᵀ, float64
        self.cov_g: dict[str, torch.Tensor] = {}  # Σ_tokens ḡ ḡᵀ, float64
        self.cov_tokens: dict[str, int] = {}
        # Σ_tokens a aᵀ (bias column included) and Σ_tokens g gᵀ, unprojected, float64; upper triangles only
        # (gradindex.capture.gram: read them with upper_to_symmetric)
        self.full_a: dict[str, torch.Tensor] = {}
        self.full_g: dict[str, torch.Tensor] = {}
        self.full_tokens: dict[str, int] = {}
        self.full_select: torch.Tensor | None = None
        """Batch positions whose tokens the full sums take (``None``: all; set per batch by the caller)."""

    # -- shapes -------------------------------------------------------------------------------
    def side_size(self, name: str, side: str) -> int:
        """Stored size of one side: ``k`` when projected, else the transform's rows, else the width."""
        info = self.infos[name]
        k = self.projection.layer_sizes(name)[0 if side == "a" else 1]
        if k:
            return k
        n = info.n_in_total if side == "a" else info.n_out
        t = self.transforms.get(name)
        return n if t is None else t.out_size(side, n)

    def dims(self, name: str) -> tuple[int, int]:
        """``(rows, cols)`` of the stored per-example matrix of a layer (``k_g, k_a`` or ``N_o, N_i+1``;
        ``1, d`` for a transform that keeps ``d`` chosen coordinates)."""
        t = self.transforms.get(name)
        if t is not None and t.keep is not None:
            return 1, int(t.keep.numel())
        return self.side_size(name, "g"), self.side_size(name, "a")

    def dim(self, name: str) -> int:
        r, c = self.dims(name)
        return r * c

    def side_map(self, name: str, side: str, device: torch.device | str) -> torch.Tensor | None:
        """``[k, n]`` map of one side's per-token vectors to the stored side.

        ``P M`` (projection after the layer's side map ``M``: dense, or the diagonal of its scales), ``P``,
        the dense ``M``, or ``None`` for an unprojected side with no dense map (its scales, if any, are
        applied by :meth:`side_scale`).
        """
        key = (name, side, str(device))
        if key not in self._proj:
            info = self.infos[name]
            t = self.transforms.get(name)
            n = info.n_in_total if side == "a" else info.n_out
            k = self.projection.layer_sizes(name)[0 if side == "a" else 1]
            if k:
                m = n if t is None else t.out_size(side, n)
                P = projection_matrix(self.projection, name, side, m)  # [k, m]
                M = P if t is None else t.fold(side, P)  # [k, n]
            else:
                M = None if t is None or t.map(side) is None else t.map(side).float()  # [m, n]
            self._proj[key] = None if M is None else M.to(device)
        return self._proj[key]

    def side_scale(self, name: str, side: str) -> torch.Tensor | None:
        """``[n]`` scales of an unprojected side without a dense map (else folded into :meth:`side_map`)."""
        t = self.transforms.get(name)
        if t is None or t.map(side) is not None or self.projection.layer_sizes(name)[0 if side == "a" else 1]:
            return None
        return t.scale(side)

    # -- lifetime -----------------------------------------------------------------------------
    def attach(self) -> GradientCapture:
        if not self._handles:
            for name, mod in self.modules.items():
                if not isinstance(mod, GroupMember):  # a group's stand-ins are hooked once, on the group
                    self._handles.append(mod.register_forward_hook(self._forward_hook(name, mod)))
            for mod, _ in self._groups.values():
                self._handles.append(mod.register_forward_hook(self._forward_hook(_group_key(mod), mod)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._records.clear()
        self._token_parts.clear()

    def __enter__(self) -> GradientCapture:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- per batch ----------------------------------------------------------------------------
    def set_mask(self, mask: torch.Tensor | None, shape: tuple[int, int] | None = None) -> None:
        """``[B, T]`` weights of token positions (1 real, 0 padding) for the next batch.

        ``shape``: the batch's ``(B, T)`` when there is no mask. Either tells the hooks how to fold a
        layer input that a model flattened to ``[B*T, N_i]`` (OPT's MLP) back into examples.
        """
        self._mask = mask
        self._batch_shape = tuple(mask.shape) if mask is not None else (tuple(shape) if shape is not None else None)
        self._mask_tokens = None

    def backward(self, loss: torch.Tensor, grad_output: torch.Tensor | None = None,
                 inputs: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
        """Weight-free backward: gradients w.r.t. hooked outputs only, fed to the accumulator.

        ``grad_output``: the gradient to start from when ``loss`` is not a scalar (e.g. a cached
        gradient of the final hidden states); ``inputs``: more tensors whose gradients are returned.
        """
        if not self._records:
            raise RuntimeError("no hooked layer ran with gradients enabled since the last backward")
        outs = [r[2] for r in self._records]
        grads = torch.autograd.grad(loss, outs + list(inputs), grad_outputs=grad_output, allow_unused=True)
        records, self._records = self._records, []
        for (key, ins, _, (shape, dtype, device)), g in zip(records, grads[:len(outs)], strict=True):
            self._dispatch(key, ins, torch.zeros(shape, dtype=dtype, device=device) if g is None else g)
        return tuple(grads[len(outs):])

    def pop(self) -> dict[str, torch.Tensor]:
        """Per-example gradients of the last batch: layer name → ``[B, D]`` float32."""
        out, self._grads = self._grads, {}
        self._records.clear()
        return out

    def pop_tokens(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """With ``keep_tokens``: per layer, the :meth:`token_factors` of each call of the layer since
        the last ``pop_tokens`` (one per call; a layer run twice in a forward has two)."""
        out, self._token_parts = self._token_parts, {}
        return out

    # -- internals ----------------------------------------------------------------------------
    def _forward_hook(self, key: str, module: nn.Module):
        def hook(mod: nn.Module, inputs: tuple, output: torch.Tensor):
            if not torch.is_grad_enabled() or (self.weight_free and _in_backward()):
                # weight-free, in a backward: a checkpointed block recomputing a forward already recorded. (Live,
                # reentrant checkpointing runs the first forward without grad and only the recomputation is
                # hooked; non-reentrant's recomputed outputs are not in the graph, so their hooks never fire.)
                return None
            ins = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs)
            if self.weight_free:
                if not output.requires_grad:  # frozen upstream: start the graph here
                    output = output.detach().requires_grad_()
                self._records.append((key, ins, get_gradient_edge(output), (output.shape, output.dtype,
                                                                            output.device)))
                return output
            if output.requires_grad:
                output.register_hook(lambda g, ins=ins: self._dispatch(key, ins, g))
            return None

        return hook

    def _dispatch(self, key: str, inputs: tuple, g: torch.Tensor) -> None:
        """One hooked module's inputs and output gradient → its layers' per-token factors → :meth:`_accumulate`."""
        if key in self._groups:
            mod, wanted = self._groups[key]
            for name, a, gg in group_rule_for(mod).factors(mod, inputs, g, wanted):
                self._accumulate(name, a, gg)
            return
        a, g = self.infos[key].factors(self.modules[key], inputs, g)
        self._accumulate(key, a, g)

    def _accumulate(self, name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        G = self.layer_gradient(name, a, g)
        if self.keep_tokens:
            self._token_parts.setdefault(name, []).append(self.token_factors(name, a, g))
        prev = self._grads.get(name)
        self._grads[name] = G if prev is None else prev + G

    def layer_gradient(
        self, name: str, a: torch.Tensor, g: torch.Tensor, route: str | None = None
    ) -> torch.Tensor:
        """One layer's per-example gradients ``[B, D]`` (fp32) from its inputs and output gradients.

        ``a`` ``[B, T, N_i]`` and ``g`` ``[B, T, N_o]`` are weighted by the current mask; ``route``
        overrides the capture's (the benchmarks time each route on the same tensors).
        """
        info = self.infos[name]
        a, g = self.per_token(name, a, g)  # [B, T, N_i], [B, T, N_o] fp32 (no copy when already)
        B, T = a.shape[:2]
        m = self._token_weights(name, B, T, a)  # [B, T, 1], or None when every token counts
        M_a = self.side_map(name, "a", a.device)  # [k_a, N_i(+1)] or None (exact side)
        M_g = self.side_map(name, "g", g.device)  # [k_g, N_o] or None
        d_g = self.side_scale(name, "g")  # [N_o] or None
        t = self.transforms.get(name)
        if M_a is None and M_g is None:
            route = "materialized"  # nothing to map: both routes are the same product
        elif t is not None and t.elementwise is not None:
            route = "materialized"  # entrywise weights have no per-token form
        else:
            route = route or self.route
            if route == "auto":
                k_g, k_a = self.side_size(name, "g"), self.side_size(name, "a")
                route = choose_route(B, T, info.n_in_total, info.n_out, k_a, k_g,
                                     map_a=M_a is not None, map_g=M_g is not None)
        self.route_counts[route] += 1
        if route == "factorized":
            ab = self._map_inputs(name, a, m)  # [B, T, k_a]
            gb = self._map_outputs(g, M_g, d_g)  # [B, T, k_g]
            G = torch.bmm(gb.transpose(1, 2), ab)  # [B, k_g, k_a]
            if self.collect_covariance:
                self._add_covariance(name, ab, gb, m)
        else:
            a1 = _with_ones(a, m, info.bias)  # [B, T, N_i(+1)], padding zeroed
            G = torch.bmm(g.transpose(1, 2), a1)  # [B, N_o, N_i(+1)]
            if t is not None:
                G = t.weight(G)  # entrywise weights first; side maps and scales below
            if M_a is not None:
                G = G @ M_a.T  # [B, N_o, k_a]
            else:
                d_a = self.side_scale(name, "a")
                G = G if d_a is None else G * d_a.to(G.device, G.dtype)
            if M_g is not None:
                G = M_g @ G  # [B, k_g, k_a]
            elif d_g is not None:
                G = G * d_g.to(G.device, G.dtype)[:, None]
            if self.collect_covariance:
                self._add_covariance(name, self._map_inputs(name, a, m), self._map_outputs(g, M_g, d_g), m)
        if self.collect_full_covariance:
            self._add_full_covariance(name, a, g, m)
        return G.reshape(B, -1) if t is None else t.select(G.reshape(B, -1))

    def _add_full_covariance(self, name: str, a: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None) -> None:
        """Add the unprojected ``Σ a aᵀ`` (with the bias column) and ``Σ g gᵀ`` over real tokens (of the
        examples at :attr:`full_select` only, when set)."""
        sel = self.full_select
        if sel is not None and a.dim() != 3:  # (tokens not laid out per example: no selection; the sums are
            self.ensure_full_sums(name, a.device)  # marked unusable, and the fit makes its own factor pass)
            self.full_a[name].fill_(float("nan"))
            return
        if sel is not None:
            sel = sel.to(a.device)
            a, g, m = a[sel], g[sel], None if m is None else m[sel]
        self.ensure_full_sums(name, a.device)
        if a.shape[0] == 0:
            return
        a1 = _with_ones(a, m, self.infos[name].bias)
        a2 = a1.reshape(-1, a1.shape[-1])
        g2 = (g if m is None else g * m).reshape(-1, g.shape[-1])
        block = gram_block(a.device)
        add_gram(self.full_a[name], a2, block)
        add_gram(self.full_g[name], g2, block)
        self.full_tokens[name] += self._tokens(a, m) if sel is None else \
            (a.shape[0] * a.shape[1] if m is None else int(m.sum()))

    def ensure_full_sums(self, name: str | None = None, device: torch.device | None = None) -> None:
        """Zero full sums for layer ``name`` (``None``: every layer) where none are held yet: a shard
        none of whose examples are selected still stores (zero) sums."""
        device = device if device is not None else next(self.model.parameters()).device
        for n in [name] if name is not None else list(self.infos):
            if n not in self.full_a:
                info = self.infos[n]
                z = dict(dtype=torch.float64, device=device)
                self.full_a[n] = torch.zeros(info.n_in_total, info.n_in_total, **z)
                self.full_g[n] = torch.zeros(info.n_out, info.n_out, **z)
                self.full_tokens[n] = 0

    def _tokens(self, a: torch.Tensor, m: torch.Tensor | None) -> int:
        """Real tokens in the batch (one host sync per batch, not per layer)."""
        if m is None:
            return a.shape[0] * a.shape[1]
        if self._mask_tokens is None:
            self._mask_tokens = int(self._mask.sum())
        return self._mask_tokens

    def token_factors(self, name: str, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's per-token factors ``(ḡ [B, T, rows], ā [B, T, cols])``, fp32, with
        ``Σ_t ḡ_t ā_tᵀ`` equal to :meth:`layer_gradient` (reshaped ``[B, rows, cols]``).

        ``ḡ_t = M_g g_t`` and ``ā_t = M_a [a_t, 1]`` (the side maps: projection and per-side
        transforms; scales only on an unmapped side), weighted by the current mask, so padding
        tokens have ``ā_t = 0``. An entrywise transform has no per-token form and is refused.
        """
        t = self.transforms.get(name)
        if t is not None and t.elementwise is not None:
            raise ValueError(f"layer {name!r} has an entrywise gradient transform (exact optimizer-aware "
                             "influence), which does not split into per-token terms; use a factored one")
        a, g = self.per_token(name, a, g)  # [B, T, N_i], [B, T, N_o]
        m = self._token_weights(name, a.shape[0], a.shape[1], a)  # [B, T, 1] or None
        gb = self._map_outputs(g, self.side_map(name, "g", g.device), self.side_scale(name, "g"))
        return gb, self._map_inputs(name, a, m)

    def per_token(self, name: str, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's input ``a`` and output gradient ``g`` as ``[B, T, N_i]`` and ``[B, T, N_o]`` float32.

        Models call some linear layers on ``[B, T, N]`` and some on tokens flattened to ``[B*T, N]``
        (OPT's MLP); with the batch's shape known (:meth:`set_mask`) both fold back into examples.
        """
        info = self.infos[name]
        shape = self._batch_shape
        if shape is None:
            B = a.shape[0]
        else:
            B = shape[0]
            if a.numel() != B * shape[1] * info.n_in:
                raise ValueError(
                    f"layer {name!r} was called on inputs of shape {tuple(a.shape)}, which are not the batch's "
                    f"{B} x {shape[1]} token positions; gradindex hooks layers that run once per token (an "
                    "unpadded or routed layer, e.g. a mixture-of-experts expert, is not supported: exclude it "
                    "with --layers)"
                )
        return a.reshape(B, -1, info.n_in).float(), g.reshape(B, -1, info.n_out).float()

    def _token_weights(self, name: str, B: int, T: int, a: torch.Tensor) -> torch.Tensor | None:
        mask = self._mask
        if mask is None:
            return None
        if mask.shape != (B, T):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not fit layer {name!r} inputs "
                f"[{B}, {T}, {self.infos[name].n_in}]"
            )
        return mask.to(a.device, a.dtype).unsqueeze(-1)

    def _map_inputs(self, name: str, a: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """``M_a [a, 1]`` per token ``[B, T, k_a]`` in one matmul (bias column folded in), masked."""
        key = (name, str(a.device))
        if key not in self._proj_a:
            M_a = self.side_map(name, "a", a.device)  # [k_a, N_i(+1)] or None
            if M_a is None:
                a1 = _with_ones(a, m, self.infos[name].bias)  # [B, T, N_i(+1)]
                d_a = self.side_scale(name, "a")
                return a1 if d_a is None else a1 * d_a.to(a1.device, a1.dtype)
            n_in = self.infos[name].n_in
            bias = M_a[:, n_in].clone() if self.infos[name].bias else None  # [k_a]
            self._proj_a[key] = (M_a[:, :n_in].T.contiguous(), bias)  # [N_i, k_a], [k_a]
        P_t, p_b = self._proj_a[key]
        B, T, n_in = a.shape
        a2 = a.reshape(B * T, n_in)
        ab = (a2 @ P_t if p_b is None else torch.addmm(p_b, a2, P_t)).view(B, T, -1)
        return ab if m is None else ab.mul_(m)

    @staticmethod
    def _map_outputs(g: torch.Tensor, M_g: torch.Tensor | None, d_g: torch.Tensor | None) -> torch.Tensor:
        """``M_g g`` per token ``[B, T, k_g]``, or ``g`` scaled by ``d_g`` on an unprojected side."""
        if M_g is not None:
            return g @ M_g.T
        return g if d_g is None else g * d_g.to(g.device, g.dtype)

    def _add_covariance(self, name: str, a: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None) -> None:
        """Add ``Σ a aᵀ`` and ``Σ g gᵀ`` over real tokens (``a`` already masked) to the factors."""
        a2 = a.reshape(-1, a.shape[-1])
        g2 = (g if m is None else g * m).reshape(-1, g.shape[-1])  # padding tokens carry no curvature
        ca = (a2.T @ a2).double()
        cg = (g2.T @ g2).double()
        n = self._tokens(a, m)
        if name in self.cov_a:
            self.cov_a[name] += ca
            self.cov_g[name] += cg
            self.cov_tokens[name] += n
        else:
            self.cov_a[name], self.cov_g[name], self.cov_tokens[name] = ca, cg, n
