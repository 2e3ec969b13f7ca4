"""Covariance factors ``A = E[ā āᵀ]`` and ``S = E[ḡ ḡᵀ]`` per layer, averaged over non-padding tokens.

Two sources, summed the same way (``Σ_tokens``, then one division by the token count):

* the store: a build with ``collect_covariance`` (``gradindex build --precondition ...``) writes each
  shard's sums ``covariance/<layer>/{A,S}`` and token count, in the pass that writes the gradients;
* the model: one forward/backward pass over (part of) the data with the same hooks and projection,
  for shards built without them, for a separate fit set, or for the true Fisher (``fisher='true'``:
  targets sampled from the model, :mod:`gradindex.capture.sampling`, instead of the observed ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from gradindex.capture import GradientCapture, KfacSums, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.batch import batch_gradients
from gradindex.capture.sampling import FISHERS, label_uniforms
from gradindex.data import Tokenized, load_records, token_hash, tokenize_records
from gradindex.fingerprint import digest_bytes, model_fingerprint
from gradindex.model import resolve_pad_id
from gradindex.progress import progress_bar
from gradindex.spec.build import DEFAULT_BATCH_SIZE
from gradindex.spec.manifest import IndexMismatchError, Manifest, tokens_differ
from gradindex.store import Store
from gradindex.store.covariance import read_covariance


@dataclass
class FactorSums:
    """Per-layer sums ``Σ ā āᵀ`` ``[k_a, k_a]``, ``Σ ḡ ḡᵀ`` ``[k_g, k_g]`` (float64) and token counts."""

    A: dict[str, np.ndarray] = field(default_factory=dict)
    S: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    examples: int = 0

    def add(self, name: str, A: np.ndarray, S: np.ndarray, tokens: int) -> None:
        if name in self.A:
            self.A[name] = self.A[name] + A
            self.S[name] = self.S[name] + S
            self.tokens[name] += int(tokens)
        else:
            self.A[name], self.S[name], self.tokens[name] = (
                np.array(A, np.float64),
                np.array(S, np.float64),
                int(tokens),
            )

    def means(self, layers: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
        """``layer → (A, S, tokens)`` with ``A``, ``S`` divided by the token count."""
        out = {}
        for n in layers:
            t = self.tokens.get(n, 0)
            if t <= 0:
                raise ValueError(
                    f"no token was seen for layer {n!r} while fitting factors; is the fit set empty?"
                )
            out[n] = (self.A[n] / t, self.S[n] / t, t)
        return out


def store_covariance(store: Store, layers: Sequence[str]) -> tuple[FactorSums, list[tuple[int, int]]]:
    """Sum the shards' covariance groups; also return ``(first_id, n)`` of shards lacking a finite one."""
    sums, missing = FactorSums(), []
    for k, path in enumerate(store.paths):
        got = read_covariance(path, "covariance", layers)
        if got is None or not all(np.isfinite(a).all() and np.isfinite(s).all() for a, s, _ in got.values()):
            missing.append((store.first_ids[k], store.sizes[k]))  # absent, or hit by a non-finite example
            continue
        for n, (a, s, t) in got.items():
            sums.add(n, a, s, t)
        sums.examples += store.sizes[k]
    return sums, missing


def projection_from_manifest(manifest: dict) -> ProjectionSpec:
    return ProjectionSpec.from_dict(Manifest(manifest).projection)


def model_covariance(
    model: nn.Module,
    tokenizer,
    data: Tokenized,
    rows: Sequence[int],
    layers: Sequence[str],
    projection: ProjectionSpec,
    batch_size: int = DEFAULT_BATCH_SIZE,
    route: str = "auto",
    progress: bool = False,
    transforms: dict | None = None,
    fisher: str = "empirical",
    seed: int = 0,
) -> FactorSums:
    """Factor sums from one forward/backward pass over ``data`` rows ``rows``, hooks as in the build.

    ``fisher='true'`` takes each token's ``g`` from a target sampled from the model (seeded by
    ``seed`` and the row), ``'empirical'`` from the observed one. ``transforms`` are the capture's
    side maps of the index's row basis (factors of the mapped rows).
    """
    if fisher not in FISHERS:
        raise ValueError(f"fisher {fisher!r} is not one of {list(FISHERS)}")
    sums = FactorSums()
    pad_id = resolve_pad_id(model, tokenizer)
    was = {n: p.requires_grad for n, p in model.named_parameters()}
    model.requires_grad_(False)
    space = RowSpace(projection, transforms)
    kfac = KfacSums(space)
    cap = GradientCapture(model, list(layers), ProjectedRows(space, route), kfac)
    if set(cap.infos) != set(layers):
        raise ValueError(f"the model's layers {sorted(cap.infos)} are not the index's {sorted(layers)}")
    rows = list(rows)
    try:
        with cap, progress_bar(total=len(rows), unit="ex", desc="factors", disable=not progress) as bar:
            for s in range(0, len(rows), batch_size):
                idx = rows[s : s + batch_size]
                ids = [data.input_ids[i] for i in idx]
                u = label_uniforms(seed, idx, [len(x) for x in ids]) if fisher == "true" else None
                batch_gradients(model, cap, ids, [data.labels[i] for i in idx], pad_id, u)
                bar.update(len(idx))
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(was[n])
    for n in layers:
        if n in kfac.A:
            sums.add(n, kfac.A[n].cpu().numpy(), kfac.S[n].cpu().numpy(), kfac.tokens[n])
    sums.examples = len(rows)
    return sums


def text_field_of(manifest: dict) -> str:
    """The ``text_field`` argument that re-tokenizes the build's data the same way."""
    f = manifest.get("counts", {}).get("text_field", "text")
    return "text" if f in ("input_ids", "prompt+completion") else f


def data_fingerprint(data: Tokenized) -> str:
    return digest_bytes(token_hash(i, lab) for i, lab in zip(data.input_ids, data.labels, strict=True))


def load_build_model(manifest: dict, device: str = "auto"):
    """The model and tokenizer that built the index (``manifest['model_id']``), fingerprint-checked."""
    from gradindex.model import index_model_options, is_model_path, load_causal_lm

    model_id = manifest.get("model_id", "")
    if not model_id or not is_model_path(model_id):
        raise FileNotFoundError(
            f"fitting factors needs a pass over the model, but the model that built this index "
            f"({model_id!r}) is not found; pass the model to the fit, or rebuild with "
            "`gradindex build ... --precondition kfac|ekfac` so the factors are collected in the build pass"
        )
    model, tok = load_causal_lm(model_id, dtype=manifest.get("dtype", "float32"), device=device,
                                **index_model_options(manifest))
    fp, built = model_fingerprint(model), Manifest(manifest).model_fingerprint
    if fp != built:
        raise IndexMismatchError(
            f"the model at {model_id!r} is not the one that built this index (fingerprint {fp} vs "
            f"{built}); restore it, or rebuild the index"
        )
    return model, tok


def load_build_data(manifest: dict, tokenizer, path: str | None = None, check: bool = True) -> Tokenized:
    """Re-tokenize the build's data (or ``path``) as the build did; check its fingerprint."""
    path = path or manifest.get("data_id", "")
    if not path:
        raise FileNotFoundError(
            "this index records no data file (manifest 'data_id' is empty: captured in training without "
            "data_id=), and this step needs the data; pass --fit-data FILE, or capture with data_id=FILE"
        )
    m = Manifest(manifest)
    data = tokenize_records(load_records(path), tokenizer, int(m.build["max_length"]), text_field_of(manifest))
    if check and data_fingerprint(data) != m.data_fingerprint:
        raise IndexMismatchError(
            f"the data at {path!r} does not tokenize to what this index was built from (data set fingerprint "
            f"differs): {tokens_differ(manifest)}"
        )
    return data


def sample_rows(n: int, k: int, seed: int) -> np.ndarray:
    """``k`` distinct sorted rows of ``n`` (all of them when ``k <= 0`` or ``k >= n``)."""
    if k <= 0 or k >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))
