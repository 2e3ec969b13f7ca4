"""The typed description of an index directory: what its manifest says (:mod:`gradindex.spec.manifest`)
and where each of its files lives (:mod:`gradindex.spec.layout`).

Stage 0 (shared by every stage): nothing here imports a pipeline stage. Import the submodules
directly (``from gradindex.spec.layout import IndexLayout``); this package imports none of them.
"""
