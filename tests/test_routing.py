"""The routing cost model picks the route docs/design.md's multiply-add counts favour, within its memory rule."""

from __future__ import annotations

import itertools

import pytest

from gradindex.capture.routing import choose_route, factorized_cost, materialized_cost, materialized_memory


def design_costs(B, T, n_in, n_out, k_a, k_g) -> tuple[int, int]:
    """docs/design.md, "The math in brief" (the two routes), written out again independently of the module."""
    factorized = B * T * (n_in * k_a + n_out * k_g + k_a * k_g)
    materialized = B * T * n_in * n_out + B * (n_out * n_in * k_a + k_g * n_out * k_a)
    return factorized, materialized


def design_memory(B, n_in, n_out, k_a) -> int:
    """Extra elements the materialized route holds: each example's dense G [N_o, N_i] and G P_aᵀ [N_o, k_a]."""
    return B * (n_out * n_in) + B * (n_out * k_a)


SHAPES = list(itertools.product([1, 8, 64], [1, 16, 512, 4096], [32, 768, 4097], [32, 3072], [4, 16, 64], [8, 64]))


def test_costs_and_memory_are_the_design_formulas():
    for B, T, n_in, n_out, k_a, k_g in SHAPES:
        assert (factorized_cost(B, T, n_in, n_out, k_a, k_g), materialized_cost(B, T, n_in, n_out, k_a, k_g)) \
            == design_costs(B, T, n_in, n_out, k_a, k_g)
        assert materialized_memory(B, n_in, n_out, k_a) == design_memory(B, n_in, n_out, k_a)


@pytest.mark.parametrize("budget", [1 << 20, 1 << 28])
def test_choice_is_the_cheaper_route_that_fits_the_memory_budget(budget):
    chosen = {"factorized": 0, "materialized": 0}
    for shape in SHAPES:
        B, T, n_in, n_out, k_a, k_g = shape
        fact, mat = design_costs(*shape)
        fits = design_memory(B, n_in, n_out, k_a) <= budget
        expect = "materialized" if fits and mat < fact else "factorized"
        got = choose_route(*shape, memory_budget=budget)
        assert got == expect, (shape, fact, mat, fits)
        chosen[got] += 1
    assert min(chosen.values()) > 10, chosen  # the grid exercises both routes


def test_long_sequences_on_narrow_layers_materialize_and_short_ones_on_wide_layers_factorize():
    # B=8, T=512, 32x32 layer, k=16: 4.4M multiply-adds materialized against 5.2M factorized
    assert design_costs(8, 512, 32, 32, 16, 16) == (5_242_880, 4_390_912)
    assert choose_route(8, 512, 32, 32, 16, 16) == "materialized"
    # B=8, T=4, 4096x4096 layer: forming G costs 537M, projecting first 4.2M
    assert choose_route(8, 4, 4096, 4096, 16, 16) == "factorized"


def test_memory_rule_overrides_speed():
    shape = (8, 512, 32, 32, 16, 16)  # materialized is cheaper ...
    need = design_memory(8, 32, 32, 16)
    assert choose_route(*shape, memory_budget=need) == "materialized"
    assert choose_route(*shape, memory_budget=need - 1) == "factorized"  # ... but does not fit
    # however fast dense matmuls are said to be, a route that does not fit is never taken
    assert choose_route(8, 4, 4096, 4096, 16, 16, materialized_speed=1e9) == "materialized"
    assert choose_route(8, 4, 4096, 4096, 16, 16, memory_budget=1 << 20, materialized_speed=1e9) == "factorized"
