"""Cost model that routes each layer and batch to the factorized or materialized computation.

Counts are multiply-adds from docs/design.md ("The math in brief"; docs/math.md, "Routing"). A route
is only chosen if its peak extra memory fits ``memory_budget`` elements, so routing never uses more
memory than the fixed factorized route would when the materialized one does not fit.

``k_a``/``k_g`` are the stored sizes of each side. A side with no map (no projection and no
transform: its stored size is its width) costs nothing to map; ``map_a``/``map_g`` say whether
a side has one, so unprojected (exact) sides and per-layer sizes are priced as they run.
"""

from __future__ import annotations

ROUTES = ("auto", "factorized", "materialized")


def factorized_cost(B: int, T: int, n_in: int, n_out: int, k_a: int, k_g: int,
                    map_a: bool = True, map_g: bool = True) -> int:
    """Map ``a_t`` and ``g_t`` first, then sum outer products over tokens."""
    return B * T * (n_in * k_a * map_a + n_out * k_g * map_g + k_a * k_g)


def materialized_cost(B: int, T: int, n_in: int, n_out: int, k_a: int, k_g: int,
                      map_a: bool = True, map_g: bool = True) -> int:
    """Form ``G = Σ_t g_t a_tᵀ`` per example, then map each side that has a map."""
    return B * T * n_in * n_out + B * (n_out * n_in * k_a * map_a + k_g * n_out * k_a * map_g)


def materialized_memory(B: int, n_in: int, n_out: int, k_a: int) -> int:
    """Elements of the per-example dense gradients and the half-projected ``G P_aᵀ``."""
    return B * n_in * n_out + B * n_out * k_a


def choose_route(
    B: int,
    T: int,
    n_in: int,
    n_out: int,
    k_a: int,
    k_g: int,
    memory_budget: int = 1 << 28,
    materialized_speed: float = 1.0,
    map_a: bool = True,
    map_g: bool = True,
) -> str:
    """``'factorized'`` or ``'materialized'``, whichever costs fewer (weighted) multiply-adds.

    ``materialized_speed`` > 1 says dense batched matmuls run that much faster per multiply-add
    than the factorized path on this machine (a calibration knob; 1.0 is the plain count).
    """
    if materialized_memory(B, n_in, n_out, k_a) > memory_budget:
        return "factorized"
    fact = factorized_cost(B, T, n_in, n_out, k_a, k_g, map_a, map_g)
    mat = materialized_cost(B, T, n_in, n_out, k_a, k_g, map_a, map_g) / materialized_speed
    return "materialized" if mat < fact else "factorized"
