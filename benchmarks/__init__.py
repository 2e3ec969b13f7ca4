"""gradindex's benchmarks: scripts run from the repository root as ``python -m benchmarks.<name>``.

Shared helpers (the shared workload, the training recipe, query gradients, LDS / Spearman) live in
:mod:`benchmarks.common`; :mod:`benchmarks.reference` is the independent numpy reference of the
curvature math and of the stored codes (it imports nothing from gradindex). Figures and their
conditions: benchmarks/README.md.
"""
