"""The hook manager: the selected layers' per-token activations and output gradients → visitors.

Two ways of taking the gradients share one code path (:meth:`GradientCapture._dispatch`):

* ``weight_free=True`` (offline builds, queries): the caller runs the forward pass and then
  :meth:`GradientCapture.backward` on the summed per-example loss. Gradients are taken with
  ``torch.autograd.grad`` with respect to the hooked layers' outputs only, so no parameter
  ``.grad`` is computed and the backward pass stops at the first hooked layer.
* ``weight_free=False`` (live capture inside an unchanged training loop): tensor hooks on the
  layers' outputs fire during the user's own ``loss.backward()``.

Each layer call's inputs and output gradients go, as a :class:`LayerCall`, to the capture's visitors
(:mod:`gradindex.capture.visitors`), which make rows, factor sums or per-token factors of them.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from gradindex.adapter import adapter_layers
from gradindex.capture.layers import GroupMember, LayerInfo, group_rule_for, layer_info, rule_for, some_names
from gradindex.quantize import refuse_quantized


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
                f"(modules look like {some_names(hookable)})"
            )
        refuse_quantized(chosen)
        return chosen
    chosen: dict[str, nn.Module] = {}
    for pat in patterns:
        hits = [n for n in hookable if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            raise ValueError(
                f"layer pattern {pat!r} matched no module; modules look like {some_names(hookable)} "
                "(see `gradindex layers MODEL_DIR`)"
            )
        chosen.update((n, hookable[n]) for n in hits)
    refuse_quantized(chosen)
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




@dataclass
class LayerCall:
    """One hooked call of one layer, as the visitors see it."""

    capture: GradientCapture
    name: str
    info: LayerInfo
    a: torch.Tensor
    """``[B, T, N_i]`` float32 inputs (not masked)."""
    g: torch.Tensor
    """``[B, T, N_o]`` float32 output gradients (not masked)."""
    m: torch.Tensor | None
    """``[B, T, 1]`` token weights of the batch (1 real, 0 padding), or None when every token counts."""
    cache: dict = field(default_factory=dict)
    """What one visitor computed of this call for another (e.g. :meth:`RowSpace.factors`' mapped factors)."""

    def tokens(self) -> int:
        """Real tokens in the batch (one host sync per batch, not per layer)."""
        return self.a.shape[0] * self.a.shape[1] if self.m is None else self.capture.real_tokens()


class Visitor:
    """What is done with the hooked layers' per-token inputs and gradients (:mod:`~gradindex.capture.visitors`)."""

    def bind(self, capture: GradientCapture) -> None:
        """Called once by the capture given it, with the hooked layers known (``capture.infos``)."""

    def visit(self, call: LayerCall) -> None:
        raise NotImplementedError

    def pop(self) -> dict[str, torch.Tensor]:
        """What this visitor made of the last batch, by layer (:meth:`GradientCapture.pop`); most keep theirs."""
        return {}


TWO_FORWARDS = ("a backward reached the hooked layers through an earlier forward's graph (two forwards, one backward: "
                "e.g. micro-batch losses summed before one backward); per-example gradients need one backward per "
                "forward while capturing: call backward on each forward's loss (scaled as you summed them), or "
                "concatenate the micro-batches into one forward")
"""The refusal of a backward through a forward before the current one (its rows would be added to this batch's)."""


class GradientCapture:
    """Hooks on chosen linear layers of a model; each call's per-token inputs and output gradients go to the visitors.

    Use as a context manager (hooks are removed on exit). Per batch: :meth:`set_mask`, forward, backward
    (:meth:`backward` with ``weight_free``, or the user's own), then :meth:`pop`. The visitors decide what is
    made of each call (:mod:`gradindex.capture.visitors`: per-example projected rows, K-FAC sums, ...).
    """

    def __init__(self, model: nn.Module, layers: Sequence[str] | None = None, *visitors: Visitor,
                 weight_free: bool = True) -> None:
        self.model = model
        self.modules = select_layers(model, layers)
        self.infos: dict[str, LayerInfo] = {n: layer_info(m) for n, m in self.modules.items()}
        self._groups = _hook_groups(self.modules)
        """hooked module → its virtual layers (name → stand-in), for modules a group rule covers."""
        self.weight_free = weight_free
        self.visitors: list[Visitor] = []
        self._handles: list = []
        self._mask: torch.Tensor | None = None
        self._batch_shape: tuple[int, int] | None = None
        self._records: list[tuple[str, tuple, GradientEdge, tuple]] = []
        """Weight-free: per hooked call, its key, inputs, the output's gradient edge and ``(shape, dtype, device)``
        (the edge, not the output: an output no later op saves is freed in the forward, as without hooks)."""
        self._real: dict[str, int | bool] = {}
        self.generation = 0
        """Which model forward a hooked output belongs to (:meth:`next_forward`, a live capture's): a backward
        through an earlier forward's graph is refused, not added to the current batch's rows."""
        for v in visitors:
            self.add(v)

    def next_forward(self) -> None:
        """A new grad-enabled model forward begins: outputs hooked from now on belong to it."""
        self.generation += 1

    def add(self, visitor: Visitor) -> Visitor:
        visitor.bind(self)
        self.visitors.append(visitor)
        return visitor

    @contextmanager
    def visiting(self, visitor: Visitor):
        """One more visitor while the block runs."""
        self.add(visitor)
        try:
            yield visitor
        finally:
            self.visitors.remove(visitor)

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
        self._real = {}

    def real_tokens(self) -> int:
        """The mask's sum (read once per batch)."""
        if "tokens" not in self._real:
            self._real["tokens"] = int(self._mask.sum())
        return self._real["tokens"]

    def all_real(self) -> bool:
        """Whether the batch has no padding (no mask, or one of ones; read once per batch)."""
        if "all" not in self._real:
            self._real["all"] = self._mask is None or bool(self._mask.all())
        return self._real["all"]

    def backward(self, loss: torch.Tensor, grad_output: torch.Tensor | None = None,
                 inputs: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, ...]:
        """Weight-free backward: gradients w.r.t. hooked outputs only, fed to the visitors.

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
        """What the visitors made of the last batch (the per-example rows: layer name → ``[B, D]`` float32)."""
        out: dict[str, torch.Tensor] = {}
        for v in self.visitors:
            out.update(v.pop())
        self._records.clear()
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
                output.register_hook(lambda g, ins=ins, gen=self.generation: self._dispatch(key, ins, g, gen))
            return None

        return hook

    def _dispatch(self, key: str, inputs: tuple, g: torch.Tensor, generation: int | None = None) -> None:
        """One hooked module's inputs and output gradient → its layers' per-token factors → the visitors."""
        if generation is not None and generation != self.generation:
            raise RuntimeError(TWO_FORWARDS)
        if key in self._groups:
            mod, wanted = self._groups[key]
            for name, a, gg in group_rule_for(mod).factors(mod, inputs, g, wanted):
                self._visit(name, a, gg)
            return
        a, g = self.infos[key].factors(self.modules[key], inputs, g)
        self._visit(key, a, g)

    def _visit(self, name: str, a: torch.Tensor, g: torch.Tensor) -> None:
        a, g = self.per_token(name, a, g)  # [B, T, N_i], [B, T, N_o] fp32 (no copy when already)
        call = LayerCall(self, name, self.infos[name], a, g, self._token_weights(name, a.shape[0], a.shape[1], a))
        for v in self.visitors:
            v.visit(call)

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
