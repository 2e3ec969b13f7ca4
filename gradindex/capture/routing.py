"""Cost model that routes each layer and batch to the factorized or materialized computation.

Counts are multiply-adds from DESIGN.md ("Two routes"). A route is only chosen if its peak
extra memory fits ``memory_budget`` elements, so routing never uses more memory than the
fixed factorized route would when the materialized one does not fit.
"""

from __future__ import annotations

ROUTES = ("auto", "factorized", "materialized")


def factorized_cost(B: int, T: int, n_in: int, n_out: int, k_a: int, k_g: int) -> int:
    """Project ``a_t`` and ``g_t`` first, then sum outer products over tokens."""
    return B * T * (n_in * k_a + n_out * k_g + k_a * k_g)


def materialized_cost(B: int, T: int, n_in: int, n_out: int, k_a: int, k_g: int) -> int:
    """Form ``G = Σ_t g_t a_tᵀ`` per example, then project both sides."""
    return B * T * n_in * n_out + B * (n_out * n_in * k_a + k_g * n_out * k_a)


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
) -> str:
    """``'factorized'`` or ``'materialized'``, whichever costs fewer (weighted) multiply-adds.

    ``materialized_speed`` > 1 says dense batched matmuls run that much faster per multiply-add
    than the factorized path on this machine (a calibration knob; 1.0 is the plain count).
    """
    if materialized_memory(B, n_in, n_out, k_a) > memory_budget:
        return "factorized"
    fact = factorized_cost(B, T, n_in, n_out, k_a, k_g)
    mat = materialized_cost(B, T, n_in, n_out, k_a, k_g) / materialized_speed
    return "materialized" if mat < fact else "factorized"
