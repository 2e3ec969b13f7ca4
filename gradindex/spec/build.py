"""The store build's settings as plain values, and their defaults: what ``gradindex build``'s options and
:class:`gradindex.store.builder.BuildConfig` share (the CLI reads its defaults here, without loading a stage).

Stage 0: no stage is imported; the checks of a combination live in ``BuildConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from gradindex.spec.rows import DEFAULT_DAMPING, RowSpec

DEFAULT_BATCH_SIZE = 8
"""Examples per forward/backward unless one is given; also the batch of an index whose record names none."""


def batch_size_of(manifest: Mapping) -> int:
    """The batch size an index was built with (``config.batch_size``), else :data:`DEFAULT_BATCH_SIZE`."""
    return int(manifest.get("config", {}).get("batch_size", DEFAULT_BATCH_SIZE))


@dataclass(frozen=True)
class BuildOptions:
    """Every build setting but what a row holds (``BuildConfig.rows``, :mod:`gradindex.spec.rows`): how to
    capture and what to fit; each is one ``gradindex build`` option (:data:`gradindex.cli.build.OPTION_FIELDS`)."""

    layers: tuple[str, ...] = ()
    """Glob patterns of layers to hook; empty = every linear layer in the transformer blocks."""
    max_length: int = 512
    """Examples longer than this many tokens are truncated (and counted in the manifest)."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Examples per forward/backward."""
    route: str = "auto"
    """``auto`` (cost model), ``factorized`` or ``materialized``."""
    shard_size: int = 4096
    """Examples per store file; also the most a torn file can cost on resume."""
    collect_covariance: bool = False
    """Accumulate K-FAC factors (A, S) per shard in the same pass."""
    full_factors: bool = False
    """Also sum the full-space (unprojected) ``A`` and ``S`` per shard in this pass, so that
    ``gradindex precondition --space full`` needs only its correction pass."""
    precondition: str = "auto"
    """``none``, ``kfac`` or ``ekfac``: fit it after the capture (factors from this same pass); ``auto``:
    ``ekfac``, or ``none`` with ``optimizer_state`` or ``basis="eigen"``."""
    damping: float = DEFAULT_DAMPING
    """Relative damping of the fit (its self-influence), and of the rows' ``EKFAC``/``EIGEN`` token when the
    spec names none (``BuildConfig`` keeps both equal)."""
    basis_examples: int = 0
    """Examples sampled for the factor pass of a ``kfac`` basis (0 = all)."""
    basis_seed: int = 0
    """Seed of that sample."""
    fisher: str = "empirical"
    """Factors of ``precondition`` from the observed labels (``empirical``, collected in this pass) or
    from labels sampled from the model (``true``: a model pass of its own; stored rows keep the observed)."""
    fisher_seed: int = 0
    """Seed of the true Fisher's sampled labels."""
    optimizer_state: str = ""
    """Adam state of the training run (safetensors or torch ``state_dict``): store ``G ⊘ (√v + ε)``,
    the rows of ``--method adam`` (:mod:`gradindex.capture.adam`); empty = plain gradients."""
    fit_sample: int = 8192
    """A default build (EK-FAC rows transcoded to int4) of more examples than ``sample_above`` fits EK-FAC on a
    seeded sample of this many (its rows captured first, then discarded) and writes every row already coded in
    that whitened eigenbasis in its one capture pass: no raw store, no transcode (docs/math.md, "Fit on a
    sample"). 0: fit on every example (the capture, then the fit and the transcode over all rows).
    Builds of at most this many examples, other options and torchrun fit on every example."""
    sample_above: int = 0
    """The default build fits on the ``fit_sample`` sample only with more examples than this. 0 (auto):
    :data:`FIT_EVERY_UP_TO` x ``fit_sample``, or ``fit_sample`` where the output's disk cannot hold the fit on
    every example at its peak (its float16 rows beside their rotated copy, ~8x the final int4 store; ``gradindex
    plan`` shows it). Up to there the fit on every example costs less time: 1.17 bare forward + backward passes
    at 10^4 examples against 1.90 for the sample (benchmarks/results/buildcost_10k.json)."""
    rerank_fit: bool = False
    """Also fit ``precondition`` (kfac/ekfac) in full (unprojected) space in this build, what the exact stage
    of a query (``--rerank-full C``) needs, where the rows hold less than the whole gradient: its factors
    summed in the capture pass over every example up to :data:`RERANK_FIT_EXAMPLES` (else a seeded sample of
    that many), its EK-FAC correction from ``rerank_correction`` of them. Off by default: the default query is
    the first stage, and the fit is what raised a budget-bound build's peak RSS and time (docs/query.md, "Two
    stages"); ``gradindex precondition INDEX --method ekfac --space full`` adds it to a built index."""
    rerank_correction: int = 128
    """With ``rerank_fit``: the full-space EK-FAC fit's factors from every fit example (summed in the capture
    pass), its correction ``Λ*`` from a seeded sample of this many of them (``fisher_seed``), a model pass over
    the sample; 0 = all of them (a model pass over every fit example: about 1.4 capture floors on the peers
    workload). 128 of 1,024 examples kept top-10 0.97-0.98 and Spearman 0.998 of the exact full-space scores
    (benchmarks/correction_sample.py)."""


FIT_EVERY_UP_TO = 8
"""``sample_above``'s auto: fit on every example up to this many times ``fit_sample`` examples. The sample's own
capture costs about ``fit_sample`` examples' capture; the fit on every example adds its store pass and transcode,
about 0.1 of a capture per example on a small model (GPT-2 4x256: crossing near 10x the sample; SmolLM2-135M,
whose capture costs more per stored number: near 70x), so 8x keeps either route within 1.3 floors."""


RERANK_FIT_EXAMPLES = 2048
"""The full-space fit a build with ``rerank_fit`` makes for the exact stage takes every example up to this
many, else a seeded sample of this many: its factors summed in the capture pass, its EK-FAC correction from
``rerank_correction`` of them (a model pass over those)."""


def default(name: str):
    """The default of field ``name`` of :class:`BuildOptions`, else of the row spec (:class:`RowSpec`): what
    ``gradindex build`` uses when its option is left out."""
    for f in (*fields(BuildOptions), *fields(RowSpec)):
        if f.name == name:
            return f.default
    raise KeyError(f"neither BuildOptions nor RowSpec has a field {name!r}")
