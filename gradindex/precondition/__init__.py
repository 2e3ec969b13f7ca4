"""Curvature: K-FAC and EK-FAC preconditioners in the projected space, and self-influence.

``fit_preconditioner`` writes ``precond/<method>.h5`` and registers it in the manifest;
``load_preconditioner(index_dir, method).apply(layer, x, power, damping)`` computes
``(H + δI)^power x`` (identity for ``graddot``/``cosine``); ``self_influence`` gives
``⟨(H + δI)⁻¹ Ĝ_n, Ĝ_n⟩`` for every stored example. See docs/preconditioning.md.
"""

from gradindex.methods import DEFAULT_DAMPING, parse_method
from gradindex.precondition.apply import absolute_damping, eigen_power, eigendecompose, kfac_eigenvalues
from gradindex.precondition.curvature import Curvature, FitJob, curvature_of
from gradindex.precondition.fit import FitConfig, fit_preconditioner
from gradindex.precondition.fullspace import fit_full_space, full_space_methods, load_full_preconditioner
from gradindex.precondition.preconditioner import Preconditioner, available_methods, load_preconditioner
from gradindex.precondition.selfinf import self_influence

__all__ = [
    "DEFAULT_DAMPING",
    "Curvature",
    "FitConfig",
    "FitJob",
    "Preconditioner",
    "absolute_damping",
    "available_methods",
    "curvature_of",
    "eigen_power",
    "eigendecompose",
    "fit_full_space",
    "fit_preconditioner",
    "full_space_methods",
    "kfac_eigenvalues",
    "load_full_preconditioner",
    "load_preconditioner",
    "parse_method",
    "self_influence",
]
