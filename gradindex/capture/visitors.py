"""What a :class:`~gradindex.capture.hooks.GradientCapture` makes of each hooked layer call (its per-token ``a_t``,
``g_t``, a :class:`~gradindex.capture.hooks.LayerCall`): per-example rows in a :class:`RowSpace`
(:class:`ProjectedRows`), K-FAC sums of the stored sides (:class:`KfacSums`; over a space with no projection nor
transform, the full-space ``A``, ``S``), unprojected sums of chosen examples (:class:`FullSums`), stored-space
per-token factors (:class:`TokenFactors`), full-space per-token factors handed to a function (:class:`FullTokens`:
full-space curvature and scores need sums over tokens, never ``G = Σ_t g_t a_tᵀ`` itself). Visitors sharing a space
share each call's mapped factors (:func:`stored_factors`), computed once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from gradindex.capture.gram import add_gram, gram_block
from gradindex.capture.hooks import GradientCapture, LayerCall, Visitor
from gradindex.capture.routing import ROUTES, choose_route
from gradindex.capture.space import RowSpace, with_ones


def stored_factors(space: RowSpace, call: LayerCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ḡ [B, T, k_g], ā [B, T, k_a])``, fp32: one call's per-token factors in ``space``, ``ḡ_t = M_g g_t``,
    ``ā_t = M_a [a_t, 1]`` weighted by the mask (padding tokens have ``ā_t = 0``), so ``Σ_t ḡ_t ā_tᵀ`` is the row
    reshaped ``[rows, cols]``. Computed once per call and space."""
    key = ("factors", id(space))
    if key not in call.cache:
        call.cache[key] = (space.map_outputs(call.name, call.g), space.map_inputs(call.name, call.a, call.m))
    return call.cache[key]


def inputs_with_ones(call: LayerCall) -> torch.Tensor:
    """``[B, T, N_i(+1)]`` fp32: one call's inputs times its token weights, bias column appended
    (:func:`~gradindex.capture.space.with_ones`), computed once per call for the visitors that take it (the
    materialized rows and the full-space sums of a full-factor build)."""
    if "with_ones" not in call.cache:
        call.cache["with_ones"] = with_ones(call.a, call.m, call.info.bias)
    return call.cache["with_ones"]


class ProjectedRows(Visitor):
    """Per-example gradients in ``space``, summed over a layer's calls in a batch: :meth:`pop` gives them."""

    def __init__(self, space: RowSpace, route: str = "auto") -> None:
        if route not in ROUTES:
            raise ValueError(f"route {route!r} is not one of {ROUTES}")
        self.space, self.route = space, route
        self.route_counts: Counter = Counter()
        self._grads: dict[str, torch.Tensor] = {}

    def bind(self, capture: GradientCapture) -> None:
        self.space.bind(capture.infos)

    def visit(self, call: LayerCall) -> None:
        G = self.gradient(call)
        prev = self._grads.get(call.name)
        self._grads[call.name] = G if prev is None else prev + G

    def pop(self) -> dict[str, torch.Tensor]:
        """Per-example gradients of the last batch: layer name → ``[B, D]`` float32."""
        out, self._grads = self._grads, {}
        return out

    def gradient(self, call: LayerCall, route: str | None = None) -> torch.Tensor:
        """One call's per-example gradients ``[B, D]`` (fp32); ``route`` overrides the visitor's (the benchmarks
        time each route on the same tensors)."""
        name, sp = call.name, self.space
        M_a, M_g = sp.side_map(name, "a", call.a.device), sp.side_map(name, "g", call.g.device)  # [k, n] or None
        t = sp.transforms.get(name)
        route = self._route(call, M_a is not None, M_g is not None, route)
        self.route_counts[route] += 1
        B = call.a.shape[0]
        if route == "factorized":
            gb, ab = stored_factors(sp, call)  # [B, T, k_g], [B, T, k_a]
            G = torch.bmm(gb.transpose(1, 2), ab)  # [B, k_g, k_a]
        else:
            G = torch.bmm(call.g.transpose(1, 2), inputs_with_ones(call))  # [B, N_o, N_i(+1)]
            if t is not None:
                G = t.weight(G)  # entrywise weights first; side maps and scales below
            if M_a is not None:
                G = G @ M_a.T  # [B, N_o, k_a]
            else:
                d_a = sp.side_scale(name, "a")
                G = G if d_a is None else G * d_a.to(G.device, G.dtype)
            d_g = sp.side_scale(name, "g")
            if M_g is not None:
                G = M_g @ G  # [B, k_g, k_a]
            elif d_g is not None:
                G = G * d_g.to(G.device, G.dtype)[:, None]
        return G.reshape(B, -1) if t is None else t.select(G.reshape(B, -1))

    def _route(self, call: LayerCall, map_a: bool, map_g: bool, route: str | None) -> str:
        t = self.space.transforms.get(call.name)
        if not (map_a or map_g) or (t is not None and t.elementwise is not None):
            return "materialized"  # nothing to map (both routes are the same product), or no per-token form
        route = route or self.route
        if route != "auto":
            return route
        (B, T), info = call.a.shape[:2], call.info
        return choose_route(B, T, info.n_in_total, info.n_out, self.space.side_size(call.name, "a"),
                            self.space.side_size(call.name, "g"), map_a=map_a, map_g=map_g)


class _Sums(Visitor):
    """Per layer: float64 ``A`` (inputs' side), ``S`` (output gradients' side) and the tokens they sum."""

    def __init__(self) -> None:
        self.A: dict[str, torch.Tensor] = {}
        self.S: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self.layers: list[str] = []

    def bind(self, capture: GradientCapture) -> None:
        self.layers = list(capture.infos)

    def means(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
        """layer → ``(A, S, tokens)``, float64 means over the tokens seen."""
        return {n: (self.A[n] / max(1, t), self.S[n] / max(1, t), t) for n, t in self.tokens.items()}

    def clear(self) -> None:
        self.A.clear()
        self.S.clear()
        self.tokens.clear()


class KfacSums(_Sums):
    """K-FAC factor sums of the stored sides: ``Σ ā āᵀ`` and ``Σ ḡ ḡᵀ`` over real tokens (``ā`` with its bias
    column, both mapped into ``space``). A space with no projection nor transform gives the full-space sums."""

    def __init__(self, space: RowSpace) -> None:
        super().__init__()
        self.space = space

    def bind(self, capture: GradientCapture) -> None:
        super().bind(capture)
        self.space.bind(capture.infos).factored("covariance factors")

    def visit(self, call: LayerCall) -> None:
        gb, ab = stored_factors(self.space, call)
        a2 = ab.reshape(-1, ab.shape[-1])
        g2 = (gb if call.m is None else gb * call.m).reshape(-1, gb.shape[-1])  # padding tokens carry no curvature
        ca = (a2.T @ a2).double()
        cg = (g2.T @ g2).double()
        n, name = call.tokens(), call.name
        if name in self.A:
            self.A[name] += ca
            self.S[name] += cg
            self.tokens[name] += n
        else:
            self.A[name], self.S[name], self.tokens[name] = ca, cg, n


class FullSums(_Sums):
    """Unprojected ``Σ a aᵀ`` (bias column included) and ``Σ g gᵀ`` over real tokens, float64 upper triangles only
    (read them with :func:`~gradindex.capture.gram.upper_to_symmetric`), of the examples at :attr:`select` only."""

    def __init__(self) -> None:
        super().__init__()
        self.select: torch.Tensor | None = None
        """Batch positions whose tokens the sums take (``None``: all; set per batch by the caller)."""
        self.device: torch.device | None = None

    def bind(self, capture: GradientCapture) -> None:
        super().bind(capture)
        self.infos = capture.infos
        self.device = next(capture.model.parameters()).device

    def visit(self, call: LayerCall) -> None:
        g, m, sel, made = call.g, call.m, self.select, call.cache.get("with_ones")  # (the materialized rows')
        if sel is None:
            a1 = inputs_with_ones(call)
        else:  # the selected examples' (not the whole batch's, unless the rows made those)
            sel = sel.to(g.device)
            g, m = g[sel], None if m is None else m[sel]
            a1 = made[sel] if made is not None else with_ones(call.a[sel], m, call.info.bias)
        self.ensure(call.name, a1.device)
        if a1.shape[0] == 0:
            return
        a2 = a1.reshape(-1, a1.shape[-1])
        g2 = (g if m is None else g * m).reshape(-1, g.shape[-1])
        block = gram_block(a1.device)
        add_gram(self.A[call.name], a2, block)
        add_gram(self.S[call.name], g2, block)
        if sel is None:
            self.tokens[call.name] += call.tokens()
        else:
            self.tokens[call.name] += a1.shape[0] * a1.shape[1] if m is None else int(m.sum())

    def ensure(self, name: str | None = None, device: torch.device | None = None) -> None:
        """Zero sums for layer ``name`` (``None``: every layer) where none are held yet: a shard none of whose
        examples are selected still stores (zero) sums."""
        device = device if device is not None else self.device
        for n in [name] if name is not None else self.layers:
            if n not in self.A:
                info = self.infos[n]
                z = dict(dtype=torch.float64, device=device)
                self.A[n] = torch.zeros(info.n_in_total, info.n_in_total, **z)
                self.S[n] = torch.zeros(info.n_out, info.n_out, **z)
                self.tokens[n] = 0


class TokenFactors(Visitor):
    """Each call's per-token factors in ``space`` (:func:`stored_factors`), by layer, until :meth:`take`n."""

    def __init__(self, space: RowSpace) -> None:
        self.space = space
        self.parts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def bind(self, capture: GradientCapture) -> None:
        self.space.bind(capture.infos).factored("per-token factors", entrywise=False)

    def visit(self, call: LayerCall) -> None:
        t = self.space.transforms.get(call.name)
        if t is not None and t.elementwise is not None:
            raise ValueError(f"layer {call.name!r} has an entrywise gradient transform (exact optimizer-aware "
                             "influence), which does not split into per-token terms; use a factored one")
        self.parts.setdefault(call.name, []).append(stored_factors(self.space, call))

    def take(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer, the ``(ḡ, ā)`` of each call since the last ``take`` (a layer run twice in a forward has two)."""
        out, self.parts = self.parts, {}
        return out


class FullTokens(Visitor):
    """Each call's full-space per-token factors to ``fn(name, a, g)``: ``a`` ``[B, T, N_i(+1)]`` (bias column
    appended, padding tokens zeroed) and ``g`` ``[B, T, N_o]`` (padding tokens zeroed), both float32, so that
    ``G_b = g[b]ᵀ a[b]``; no gradient is formed. A batch without padding is not masked (the same factors)."""

    def __init__(self, fn: Callable[[str, torch.Tensor, torch.Tensor], None]) -> None:
        self.fn = fn

    def visit(self, call: LayerCall) -> None:
        m = None if call.capture.all_real() else call.m
        self.fn(call.name, with_ones(call.a, m, call.info.bias), call.g if m is None else call.g * m)
