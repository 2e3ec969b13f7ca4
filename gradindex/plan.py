"""What a build will cost before it runs: rows per layer, disk (peak and final), memory, time, lookup.

:func:`plan_build` sizes every file the build writes from the model's hooked layers, the build's
settings and the number of examples (no capture); :func:`measure_seconds` times a few real capture
batches and one block of the rotations that follow, and extrapolates. ``gradindex plan`` prints
both; ``gradindex build`` prints :meth:`BuildPlan.summary` before it starts, and each stage checks
the disk's free space against what it still has to write (:func:`gradindex.diskspace.check_space`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gradindex.capture import GradientCapture, KfacSums, ProjectedRows, RowSpace
from gradindex.capture.batch import batch_gradients
from gradindex.capture.hooks import select_layers
from gradindex.capture.layers import layer_info
from gradindex.data import Tokenized
from gradindex.diskspace import human
from gradindex.index.config import IndexConfig
from gradindex.index.cost import LookupCost
from gradindex.index.sketch import SKETCH_BYTES
from gradindex.index.tiers import RowShape, Tier, make_tier
from gradindex.precondition.apply import rotate
from gradindex.precondition.ekfac import BLOCK_BYTES
from gradindex.precondition.sampled import sampled_reason
from gradindex.spec.build import RERANK_FIT_EXAMPLES
from gradindex.store.basis import RowBasis
from gradindex.store.builder import BuildConfig
from gradindex.store.codes import encode, has_scale, row_bytes
from gradindex.store.sizing import sized_projection

COLUMN_BYTES = 8 + 4 + 4 + 1 + 16
"""Per example, besides the rows: id, loss, token count, finite flag, token hash."""
DATASET_BYTES = 3 << 10
"""HDF5's per-dataset overhead in a shard (header, chunk index, free space left by the appends)."""
BASE_RAM = 400 << 20
"""The interpreter with torch, transformers and the library loaded (measured: 380-450 MB)."""


@dataclass
class LayerPlan:
    name: str
    n_out: int
    n_in: int
    k_g: int
    k_a: int

    @property
    def numbers(self) -> int:
        return self.k_g * self.k_a


@dataclass
class BuildPlan:
    """Bytes of every stage's files, for ``examples`` examples (estimates from the formats, not measured)."""

    examples: int
    layers: list[LayerPlan]
    storage: str
    capture_storage: str
    transcode: bool
    capture_bytes: int
    """The captured rows (``capture_storage``), with the per-example columns and factor sums."""
    store_bytes: int
    """The final rows (``storage``)."""
    precond_bytes: int
    basis_bytes: int
    index_bytes: int
    """The FAISS stage's files (0 without it; an exhaustive index holds codes of every row)."""
    ram_bytes: int
    rotated_bytes: int = 0
    """The fused transcode's float16 copy of the rotated rows (:mod:`gradindex.precondition.rotated`),
    beside the captured rows until each shard is coded."""
    shards: int = 1
    lookup: LookupCost | None = None
    """One query's estimated cost on the index tier the index stage builds (:meth:`gradindex.index.tiers.Tier.cost`),
    None for a tier with no estimate (FAISS) or no index stage."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Estimated seconds per stage, when measured (:func:`measure_seconds`) or counted (``from_flops``)."""
    from_flops: bool = False
    """``seconds`` are a FLOP count at an assumed throughput (:mod:`gradindex.estimate`: a config-only plan,
    no weights loaded), not extrapolated from measured batches."""
    sample_examples: int = 0
    """A sampled build's fit sample (:mod:`gradindex.precondition.sampled`; 0: the fit takes every example):
    ``capture_bytes`` are then the sample's float16 rows, deleted before the main pass writes the coded rows."""
    approximate: bool = False
    """The rows' sizes are only settled by the build's own factor pass (``--projection-basis eigen``):
    the bytes are those of the budget's raw-basis rows, and the build checks no disk space against them."""
    full_fit: int = 0
    """Examples of the full-space fit for the exact stage, made only with ``rerank_fit``
    (:func:`rerank_fit_sizes`; 0: none, the default); its files are in ``precond_bytes``, its sums in
    ``ram_bytes``."""
    correction: int = 0
    """Examples of that fit's EK-FAC correction pass (a model pass over them; 0: a K-FAC fit)."""
    exact_seconds: tuple[float, float] = (0.0, 0.0)
    """One query's exact stage of the top :data:`~gradindex.query.full.EXACT_STAGE_C` (self-normalized; on a
    budget-bound index, on request), ``(low, high)``: its FLOPs (:func:`gradindex.estimate.exact_stage_flops`) with
    the dense products at timed matmul rates (:func:`dense_rates`: low) or at the timed capture's rate (high), the
    model passes at the capture's; a config-only plan's both at its assumed throughput ((0, 0): not estimated). On
    SmolLM2-135M the measured exact stage fell between the two (docs/query.md, "Two stages")."""

    @property
    def budget_bound(self) -> bool:
        """Whether the rows hold fewer numbers than the whole gradients of their layers (where a build with
        ``rerank_fit`` fits full-space curvature for the exact stage)."""
        return sum(lp.numbers for lp in self.layers) < sum(lp.n_out * lp.n_in for lp in self.layers)

    @property
    def row_bytes(self) -> int:
        """Bytes per example in the final store."""
        return sum(row_bytes(self.storage, lp.numbers) for lp in self.layers) + COLUMN_BYTES

    @property
    def final_disk(self) -> int:
        return self.store_bytes + self.precond_bytes + self.basis_bytes + self.index_bytes

    @property
    def peak_disk(self) -> int:
        """The most on disk at once: the captured rows beside their rotated copy (which shrinks, a shard at a
        time, as the coded shards grow: the peak is as the first shard is coded), or the final index."""
        if self.sample_examples:  # the sample's rows, then the coded rows with their kept self-influence
            kept = 16 * self.examples * len(self.layers)
            during = max(self.capture_bytes, self.store_bytes + self.basis_bytes + kept) + self.precond_bytes
        elif self.transcode:
            during = (self.capture_bytes + self.precond_bytes + self.basis_bytes
                      + max(self.rotated_bytes + -(-self.store_bytes // self.shards), self.store_bytes))
        else:
            during = self.capture_bytes + self.precond_bytes + self.index_bytes
        return max(during, self.final_disk)

    @property
    def least_disk(self) -> int:
        """The peak without the rotated copy: the fused transcode then rotates each row twice instead
        (:func:`gradindex.precondition.fused.fit_and_transcode` keeps the copy only where the disk has room)."""
        return replace(self, rotated_bytes=0).peak_disk

    def remaining(self, out: str | Path) -> int:
        """Bytes the build still adds to ``out`` at its least peak (what is there counts as written)."""
        out = Path(out)
        there = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() else 0
        return max(0, self.least_disk - there)

    def summary(self) -> str:
        """One line: rows, disk, memory, time (when measured), lookup."""
        numbers = sum(lp.numbers for lp in self.layers)
        rows = f"{'ekfac-whitened ' if self.transcode else ''}{self.storage}"
        if self.sample_examples:
            rows += f", fitted on a sample of {self.sample_examples:,}"
        t = ""
        if self.seconds:
            stages = ", ".join(f"{k} {_duration(v)}" for k, v in self.seconds.items())
            how = " as a FLOP estimate" if self.from_flops else ""
            t = f", about {_duration(sum(self.seconds.values()))}{how} ({stages})"
        if self.lookup is None:
            look = f"an exhaustive lookup scans {human(self.store_bytes)} of rows"
        else:
            lk = self.lookup
            look = (f"a lookup ({lk.kind} index) about {lk.seconds:.2g} s a query on one idle core, "
                    f"{human(lk.ram_bytes)} RAM, {human(lk.scanned_bytes)} read")
        exact = ""
        low, high = self.exact_seconds
        if high and self.budget_bound:
            from gradindex.query.full import EXACT_STAGE_C

            span = _duration(low) if _duration(low) == _duration(high) else f"{_duration(low)}-{_duration(high)}"
            exact = (f"; the exact stage, on request (--rerank-full {EXACT_STAGE_C} after `gradindex precondition "
                     f"--space full`), about {span} a query")
        return (f"plan: {self.examples:,} examples x {len(self.layers)} layers ({numbers:,} numbers, {rows}: "
                f"{human(self.row_bytes)} per example); disk {human(self.final_disk)} final, {human(self.peak_disk)} "
                f"at peak; RAM about {human(self.ram_bytes)}{t}; {look}{exact}")


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def hooked_layers(model: nn.Module, cfg: BuildConfig) -> list[LayerPlan]:
    """The layers ``cfg`` hooks and their stored ``[k_g, k_a]`` (the budget's sizes for a raw basis; a
    ``spectrum`` allocation, which needs the factor pass, is sized as ``ratio``: the same bytes)."""
    infos = {n: layer_info(m) for n, m in select_layers(model, cfg.layers or None).items()}
    if cfg.rows.allocation == "spectrum":
        cfg = replace(cfg, allocation="ratio", basis="raw")
    space = RowSpace(sized_projection(cfg, infos, RowBasis())).bind(infos)
    return [LayerPlan(n, i.n_out, i.n_in_total, *space.dims(n)) for n, i in infos.items()]


def rows_bytes(examples: int, shard_size: int, layers: list[LayerPlan], storage: str) -> int:
    """Bytes of ``examples`` rows in shards of ``shard_size``, as :class:`~gradindex.store.ShardWriter` lays
    them out: HDF5 allocates whole chunks (up to 256 rows, at most 1 MiB), so a shard's last chunk is full,
    and each dataset's header and chunk index take about :data:`DATASET_BYTES` (measured)."""
    total = 0
    datasets = 6 + len(layers) * (2 if has_scale(storage) else 1)
    for first in range(0, examples, shard_size):
        n = min(shard_size, examples - first)
        chunk = max(1, min(256, n))
        total += -(-n // chunk) * chunk * COLUMN_BYTES + datasets * DATASET_BYTES
        for lp in layers:
            rb = row_bytes(storage, lp.numbers)
            rows = max(1, min(chunk, (1 << 20) // max(1, rb)))
            total += -(-n // rows) * rows * rb
    return total


def plan_tier(examples: int, layers: list[LayerPlan], storage: str, factory: str = "auto",
              sketch_bytes: int = 0) -> tuple[Tier, RowShape]:
    """The index tier ``factory`` picks over these rows, and the rows as it sees them."""
    rows = RowShape.of(examples, [lp.numbers for lp in layers], storage)
    cfg = IndexConfig(factory=factory or "auto", sketch_bytes=sketch_bytes or SKETCH_BYTES)
    return make_tier(cfg, rows), rows


def plan_build(model: nn.Module, cfg: BuildConfig, examples: int, index: bool = True, factory: str = "auto",
               sketch_bytes: int = 0, longest: int | None = None) -> BuildPlan:
    """Sizes of a build of ``examples`` examples under ``cfg`` (``index``: with its FAISS stage, of
    ``factory`` and ``sketch_bytes`` as in :class:`gradindex.index.IndexConfig`; ``longest``: the longest
    example's tokens, :func:`longest_example`, else ``cfg.max_length``)."""
    from gradindex.estimate import ACTIVATION_FACTOR, activation_bytes, hook_bytes

    layers = hooked_layers(model, cfg)
    shards = max(1, -(-examples // cfg.shard_size))
    factors = sum(8 * (lp.k_a ** 2 + lp.k_g ** 2) for lp in layers)  # one layer's A and S, float64
    collect = cfg.precondition != "none" or cfg.collect_covariance
    sample = 0 if sampled_reason(cfg, examples) else cfg.fit_sample  # (its rows are the captured ones)
    captured = sample or examples
    capture = rows_bytes(captured, cfg.shard_size, layers, cfg.rows.capture_storage) + \
        (-(-captured // cfg.shard_size) * factors if collect else 0)
    store = rows_bytes(examples, cfg.shard_size, layers, cfg.rows.storage)
    transcode = cfg.rows.transcode
    L = len(layers)
    per_fit = sum(8 * (2 * (lp.k_a ** 2 + lp.k_g ** 2) + lp.k_a + lp.k_g + lp.numbers) for lp in layers) \
        + 8 * examples * (L + 1)
    fits = {"none": 0, "kfac": 1, "ekfac": 2}[cfg.precondition]
    precond = fits * per_fit + (8 * examples * (L + 1) if fits and not transcode else 0)  # (+ graddot's norms)
    basis = sum(8 * (lp.k_a ** 2 + lp.k_g ** 2 + lp.numbers) for lp in layers) if transcode else 0
    lookup, index_bytes = None, 0
    if index:  # the index stage's tier: its lookup estimate, and what it writes
        tier, rows = plan_tier(examples, layers, cfg.rows.storage, factory, sketch_bytes)
        lookup, index_bytes = tier.cost(rows), tier.disk_bytes(rows)
    width = sum(lp.numbers for lp in layers)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # fused expert weights ([E, ...] 3-D parameters, e.g. Mixtral's): transformers loads a checkpoint's per-expert
    # matrices into them, a copy beside the file's mapped pages, so they count twice (plan_slice.json: a Mixtral
    # slice peaked at 2x its weights; tests/test_plan.py)
    fused = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() >= 3)
    T = min(cfg.max_length, longest or cfg.max_length)
    # the hooks' working set (the batch's float32 rows with their host copy included) and the forward + backward's
    # activations and logits; the weights once (a float32 folder's are its mapped file, another dtype's a copy)
    capture_ram = hook_bytes(cfg, layers, cfg.batch_size, T) + \
        int(ACTIVATION_FACTOR * activation_bytes(model, cfg, layers, cfg.batch_size * T))
    block = 3 * min(BLOCK_BYTES, 4 * width * max(1, examples))  # a block of rows, rotated, coded
    ram = BASE_RAM + params + fused + max(capture_ram, block)
    rotated = 2 * examples * sum(lp.numbers for lp in layers) if transcode and cfg.precondition == "ekfac" \
        and not sample else 0
    plan = BuildPlan(examples, layers, cfg.rows.storage, cfg.rows.capture_storage, transcode, capture, store, precond,
                     basis, index_bytes, ram, rotated, shards, lookup, sample_examples=sample,
                     approximate=cfg.rows.basis == "eigen")
    wanted = cfg.rerank_fit and plan.budget_bound and not plan.approximate  # (the full-space fit: asked only)
    plan.full_fit, plan.correction = rerank_fit_sizes(cfg, examples, wanted, bool(cfg.optimizer_state))
    if plan.full_fit:  # per layer, float32 Q_S, Q_A, their eigenvalues and Λ; beside EK-FAC, K-FAC's eigenvalues
        plan.precond_bytes += sum(4 * (lp.n_out ** 2 + (lp.n_in + 1) ** 2 + (lp.n_out + 1) * (lp.n_in + 2) - 1
                                       + (lp.n_out + lp.n_in + 1) * (cfg.precondition == "ekfac"))  # (a bias column)
                                  for lp in layers)
        # float64 A, S summed in the capture, their eigenbases, Λ*'s sums (all layers at once)
        plan.ram_bytes += sum(8 * (2 * (lp.n_in ** 2 + lp.n_out ** 2) + lp.n_out * lp.n_in) for lp in layers)
    return plan


def longest_example(data: Tokenized) -> int:
    """Tokens of the longest example of ``data`` (the batch a capture's memory is sized for)."""
    offsets = getattr(data.input_ids, "offsets", None)
    if offsets is not None:
        return int(np.diff(offsets).max(initial=1))
    return max((len(x) for x in data.input_ids), default=1)


def rerank_fit_sizes(cfg: BuildConfig, examples: int, wanted: bool, optimizer: bool) -> tuple[int, int]:
    """``(fit examples, correction examples)`` of the full-space fit a build of ``examples`` makes for the exact
    stage: where ``wanted`` (asked with ``rerank_fit``, the rows a projection) and ``cfg.precondition`` is
    kfac/ekfac on plain gradients (not ``optimizer``-scaled ones); ``(0, 0)`` where it makes none."""
    if not wanted or cfg.precondition not in ("kfac", "ekfac") or optimizer:
        return 0, 0
    fit = min(examples, RERANK_FIT_EXAMPLES)
    correction = min(fit, cfg.rerank_correction or fit) if cfg.precondition == "ekfac" else 0
    return fit, correction


def exact_seconds(model: nn.Module, cfg: BuildConfig, plan: BuildPlan, lengths, capture_seconds: float,
                  device="cpu") -> tuple[float, float]:
    """One query's exact stage of the top :data:`~gradindex.query.full.EXACT_STAGE_C` (a query and candidates of the
    data's mean length), ``(low, high)``: its model passes at the rate the capture of ``lengths`` runs at
    (``capture_seconds``), its dense products at the rates :func:`dense_rates` times on ``device`` (low; the real
    stage adds reading its curvature and elementwise work) or at the capture's rate (high)."""
    from gradindex.estimate import exact_stage_flops, stage_flops
    from gradindex.query.full import EXACT_STAGE_C

    if not len(lengths) or capture_seconds <= 0 or not plan.layers:
        return 0.0, 0.0
    rate = stage_flops(model, cfg, plan, np.asarray(lengths))[0]["capture"] / capture_seconds
    t = float(np.mean(lengths))
    f = exact_stage_flops(model, cfg, plan.layers, t, [t] * EXACT_STAGE_C)
    on_m, on_tokens = dense_rates(plan, device, max(1, round(min(cfg.batch_size, EXACT_STAGE_C) * t)))
    return (f["passes"] / rate + f["query"] / on_m + f["candidates"] / on_tokens,
            (f["passes"] + f["query"] + f["candidates"]) / rate)


DENSE_PROBE = 2048
"""The widest side :func:`dense_rates` times (a product this wide runs at the rate of wider ones), so that a plan
with weights of a large model does not spend minutes of CPU on its probe (Llama-3-8B's widest layer: 14,336)."""


def dense_rates(plan: BuildPlan, device="cpu", rows: int = 512) -> tuple[float, float]:
    """FLOP/s of the exact stage's two kinds of dense product on ``device``, on the largest hooked layer's shape
    (each side at most :data:`DENSE_PROBE`): the query's ``Q_Sᵀ G Q_A`` (``[N_o, N_i]`` between square factors) and a
    candidate batch's per-token factors rotated and multiplied (``rows`` tokens of ``[N_o]`` and ``[N_i]``). Each
    timed after a warm-up, the faster of two."""
    lp = max(plan.layers, key=lambda x: x.n_out * x.n_in)
    o, i, rows = min(lp.n_out, DENSE_PROBE), min(lp.n_in, DENSE_PROBE), min(rows, DENSE_PROBE)
    g = torch.Generator().manual_seed(0)
    Q_S, Q_A, G = (torch.randn(*s, generator=g).to(device) for s in ((o, o), (i, i), (o, i)))
    gt, at = (torch.randn(rows, n, generator=g).to(device) for n in (o, i))
    products = ((lambda: Q_S.T @ G @ Q_A, 2 * (o * o * i + o * i * i)),
                (lambda: (gt @ Q_S).T @ (at @ Q_A), 2 * rows * (o * o + i * i + o * i)))
    out = []
    for run, flops in products:
        seconds = []
        for _ in range(3):
            t = time.perf_counter()
            run().sum().item()
            seconds.append(time.perf_counter() - t)
        out.append(flops / max(min(seconds[1:]), 1e-9))
    return out[0], out[1]


def measure_seconds(model: nn.Module, data: Tokenized, cfg: BuildConfig, plan: BuildPlan, pad_id: int,
                    batches: int = 2) -> dict[str, float]:
    """Seconds per stage, extrapolated from ``batches`` timed capture batches (after one warm-up) and one
    timed float32 rotation of a batch of random rows per layer (the fit's store pass rotates every row once;
    the transcode scales and codes the rotated rows)."""
    B, N = cfg.batch_size, len(data)
    spec = sized_projection(cfg, {n: layer_info(m) for n, m in select_layers(model, cfg.layers or None).items()},
                            RowBasis())
    was = {n: p.requires_grad for n, p in model.named_parameters()}
    model.requires_grad_(False)
    space = RowSpace(spec)
    cap = GradientCapture(model, cfg.layers, ProjectedRows(space, cfg.route),
                          *([KfacSums(space)] if cfg.precondition != "none" else []))
    times = []
    try:
        with cap:
            for b in range(min(batches + 1, max(1, -(-N // B)))):
                s = (b * B) % max(1, N)
                t = time.perf_counter()
                batch_gradients(model, cap, data.input_ids[s:s + B], data.labels[s:s + B], pad_id)
                times.append(time.perf_counter() - t)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(was[n])
    per_batch = float(np.mean(times[1:] if len(times) > 1 else times))
    out = {"capture": per_batch * N / B}
    if plan.budget_bound:
        plan.exact_seconds = exact_seconds(model, cfg, plan, [len(x) for x in data.input_ids], out["capture"],
                                           next(model.parameters()).device)
    if cfg.precondition != "none":
        g = torch.Generator().manual_seed(0)
        t = time.perf_counter()
        for lp in plan.layers:
            X = torch.randn(B, lp.k_g, lp.k_a, generator=g)
            Q_S, Q_A = torch.eye(lp.k_g), torch.eye(lp.k_a)
            rotate(X, Q_S, Q_A).square().sum()
        rot = (time.perf_counter() - t) / B  # a row's
        if plan.transcode:
            t = time.perf_counter()
            for lp in plan.layers:
                encode(torch.randn(B, lp.numbers, generator=g).numpy(), plan.storage)
            code = (time.perf_counter() - t) / B
        if plan.sample_examples:  # the sample captured and fitted; every row rotated and coded as it is captured
            S = plan.sample_examples
            out = {"fit sample": (per_batch / B + rot) * S, "capture": out["capture"] + (rot + code) * N}
        else:
            out["fit"] = rot * N
            if plan.transcode:
                out["transcode"] = 2 * code * N  # (the codes, and the copy's write and read)
    if plan.correction:  # the full-space fit's correction pass: about a capture batch per batch
        out["full-space fit"] = per_batch * plan.correction / B
    return out
