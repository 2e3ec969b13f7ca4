"""Capture: hooks on linear layers, seeded factored projection, routing between computations."""

from gradindex.capture import rules  # noqa: F401 - registers the built-in layer rules (the registry is layers.py)
from gradindex.capture.hooks import GradientCapture, LayerCall, Visitor, select_layers, unhooked_weights
from gradindex.capture.layers import LayerInfo, layer_info, register_layer
from gradindex.capture.projection import ProjectionSpec, projection_matrix
from gradindex.capture.routing import choose_route
from gradindex.capture.space import RowSpace
from gradindex.capture.visitors import FullSums, FullTokens, KfacSums, ProjectedRows, TokenFactors

__all__ = [
    "FullSums",
    "FullTokens",
    "GradientCapture",
    "KfacSums",
    "LayerCall",
    "LayerInfo",
    "ProjectedRows",
    "ProjectionSpec",
    "RowSpace",
    "TokenFactors",
    "Visitor",
    "choose_route",
    "layer_info",
    "projection_matrix",
    "register_layer",
    "select_layers",
    "unhooked_weights",
]
