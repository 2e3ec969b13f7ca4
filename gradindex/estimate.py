"""A build's time and GPU memory from the model's shapes alone: what a config-only ``gradindex plan`` prints.

With no weights (the model built on the meta device, :func:`gradindex.model.load_meta_model`) nothing can
be timed, so :func:`estimate_build` counts FLOPs and divides them by an assumed throughput:

* a model pass per example (the capture's weight-free backward takes the input gradients only): ``4 P T``
  for the ``P`` matmul parameters a token goes through (a mixture-of-experts' experts by their
  ``top_k / E`` share; the LM head included, the embeddings not) and ``6 L d T²`` for causal attention
  (``2 L d T²`` forward, about twice that backward), over the ``T`` tokens of each example;
* the hooks' per-example gradients: the multiply-adds of the route each layer takes
  (:mod:`gradindex.capture.routing`), and for fused experts one more float32 expert forward;
* where the build makes the full-space fit (:attr:`~gradindex.plan.BuildPlan.full_fit`): its factor sums
  (``T (N_i² + N_o²)`` per fit example and layer), its correction pass (a model pass and ``2 T (N_o² + N_i² +
  N_o N_i)``) and its eigendecompositions (``9 n³`` float64 per factor, on the host, LAPACK);
* the stored-space fit and transcode: each row rotated in its layer's eigenbasis on the host.

GPU memory of the capture: the weights in ``--dtype``, the activations a batch keeps for its backward
(every hooked layer's input and output per token, the logits with their float32 loss copy and gradient),
the hooks' float32 working set (the largest layer's per-token factors, every layer's projection maps, the
batch's rows) and, with the full-space fit, its float64 factor sums. The full-space files
(``gradindex precondition --space full``) are ``Q_S [N_o, N_o]``, ``Q_A [N_i, N_i]`` and ``Λ [N_o, N_i]``
per layer in float32. GPUs assumed: one, unless the capture's memory or the full-space files exceed
:data:`GPU_BYTES`; then the smallest count over which they fit, split evenly.

GPU memory of the exact stage (``--rerank-full C``, :func:`exact_stage_memory`), its curvature streamed a layer
at a time: the weights, one query's full-space ``M`` (float32, one number per hooked parameter), the curvature
it keeps (the cache budget, at least the largest layer's ``Q_S``, ``Q_A``, ``Λ``, at most every layer's), a
candidate batch's activations (as the capture's) and its hooks' working set (the largest layer's dense
gradients of a batch, at most :data:`~gradindex.query.full.DENSE_BYTES`, and ``-selfnorm``'s rotated ``R`` with
its square); and how many queries' ``M`` fit on one GPU beside the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from gradindex.capture.hooks import select_layers
from gradindex.capture.layers import GroupMember
from gradindex.capture.routing import choose_route, factorized_cost, materialized_cost, materialized_memory
from gradindex.diskspace import human
from gradindex.precondition.preconditioner import CURVATURE_CACHE_BYTES

GPU_BYTES = 80 * 10**9
"""One GPU's memory (an 80 GB H100 or A100)."""
TFLOPS = {"bfloat16": 400.0, "float16": 400.0, "float32": 25.0}
"""Assumed sustained TFLOP/s of one GPU per ``--dtype``: about 40% of an H100 SXM's dense peak (989 TFLOP/s
in bfloat16/float16 tensor cores, 67 in float32, which gradindex runs without TF32)."""
HOST_FLOPS = 50e9
"""Assumed host FLOP/s of the stored-space fit's rotations and the full-space eigendecompositions."""
EIGH_COST = 9
"""FLOPs of a symmetric eigendecomposition with its eigenvectors, in units of ``n³``."""


@dataclass
class Estimate:
    """FLOPs, seconds and GPU memory of a build, from shapes (:func:`estimate_build`)."""

    tflops: float
    """Assumed sustained TFLOP/s of one GPU."""
    flops: dict[str, float]
    """FLOPs per stage (the keys of :func:`gradindex.plan.measure_seconds`)."""
    seconds: dict[str, float]
    """``flops`` at ``tflops`` on ``gpus`` GPUs (host stages at :data:`HOST_FLOPS`)."""
    gpu: dict[str, int]
    """Bytes of the capture's GPU memory: ``weights``, ``activations``, ``hooks``, ``full_sums``."""
    full_space_bytes: int
    """The full-space files' float32 ``Q_S``, ``Q_A`` and ``Λ`` of every layer."""
    gpus: int
    """GPUs the build is assumed to run on: the fewest over which its capture's memory (and, where it makes the
    full-space fit, the full-space files) fit, split evenly."""
    full_space_gpus: int
    """The fewest GPUs over which the full-space files fit (``gradindex precondition --space full``)."""
    tokens: int
    """Tokens of the batch the activations are sized for (``--batch-size`` x the longest example)."""
    dtype: str
    exact: dict[str, int] = field(default_factory=dict)
    """Bytes of the exact stage's GPU memory (:func:`exact_stage_memory`)."""
    exact_seconds: float = 0.0
    """One query's exact stage of the top :data:`~gradindex.query.full.EXACT_STAGE_C` on one GPU at ``tflops``
    (:func:`exact_stage_flops`, a query and candidates of the mean length)."""

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu.values())

    @property
    def exact_queries(self) -> int:
        """Queries whose ``M`` fit on one GPU beside the rest of the exact stage (0: it does not fit one)."""
        rest = sum(v for k, v in self.exact.items() if k not in ("m", "largest_layer"))
        return max(0, (GPU_BYTES - rest) // self.exact["m"]) if self.exact.get("m") else 0

    def to_dict(self) -> dict:
        exact = {**self.exact, "total": self.exact_total, "queries_per_gpu": self.exact_queries,
                 "fits_one_gpu": self.exact_queries > 0, "seconds_a_query": self.exact_seconds}
        return {"weights_loaded": False, "tflops_per_gpu": self.tflops, "host_flops": HOST_FLOPS,
                "flops": self.flops, "gpus": self.gpus, "full_space_gpus": self.full_space_gpus,
                "gpu_bytes_each": GPU_BYTES, "batch_tokens": self.tokens,
                "gpu": {**self.gpu, "total": self.gpu_bytes}, "full_space_bytes": self.full_space_bytes,
                "exact_stage": exact}

    @property
    def exact_total(self) -> int:
        """The exact stage's bytes for one query."""
        return sum(v for k, v in self.exact.items() if k != "largest_layer")

    def exact_line(self) -> str:
        """The plan's line on the exact stage's GPU memory."""
        e, one = self.exact, f"one {GPU_BYTES / 1e9:.0f} GB GPU"
        n = self.exact_queries
        whose = "query's" if n == 1 else "queries'"
        fit = f"fits {one}, room for {n} {whose} M at once" if n else \
            f"does NOT fit {one}"
        return (f"exact stage (`--rerank-full C`, full-space curvature read a layer at a time): weights "
                f"{human(e['weights'])} + one query's full-space M {human(e['m'])} (float32) + curvature kept "
                f"{human(e['curvature'])} (cache budget {human(CURVATURE_CACHE_BYTES)}, largest layer "
                f"{human(e['largest_layer'])}) + activations {human(e['activations'])} + hooks {human(e['hooks'])} "
                f"= {human(self.exact_total)}: {fit}")

    def lines(self) -> list[str]:
        """What the plan prints after its disk line: how the time was estimated, GPU memory, full-space files."""
        g, one = self.gpu, f"{GPU_BYTES / 1e9:.0f} GB ({human(GPU_BYTES)})"
        parts = f"weights {human(g['weights'])} + activations {human(g['activations'])} + hooked gradients " \
                f"{human(g['hooks'])}" + (f" + full-space factor sums {human(g['full_sums'])} (float64)"
                                          if g["full_sums"] else "")
        why = "fits one" if self.gpus == 1 else \
            "split evenly; `gradindex build` under torchrun keeps a whole model copy per GPU, so more than one " \
            "needs the weights sharded"
        return [f"config only: no weights were loaded (the model was built on the meta device); the time is a FLOP "
                f"estimate, {sum(self.flops.values()):.3g} FLOPs at an assumed {self.tflops:g} TFLOP/s per GPU "
                f"({self.dtype}) and {HOST_FLOPS / 1e9:g} GFLOP/s on the host, not measured",
                f"GPU memory of the capture ({self.dtype}, a batch of {self.tokens:,} tokens): {parts} = "
                f"{human(self.gpu_bytes)}",
                f"full-space files (`gradindex precondition --space full`: Q_S, Q_A and Λ per layer, float32): "
                f"{human(self.full_space_bytes)}, {self.full_space_gpus} GPU(s) of {one} to hold them",
                f"GPUs assumed: {self.gpus} of {one} (the capture's {human(self.gpu_bytes)} {why}); "
                f"the time is for {self.gpus}"] + ([self.exact_line()] if self.exact else [])


def matmul_params(model: nn.Module) -> float:
    """Parameters a token's forward multiplies by: every matrix but the embeddings (a head tied to them
    counts), a fused experts' 3-D weights by their ``top_k / E`` share."""
    emb = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = model.get_output_embeddings()
    tied = {id(p) for p in head.parameters()} & emb if head is not None else set()
    top_k = getattr(model.config, "num_experts_per_tok", None)
    total = 0.0
    for p in model.parameters():
        if p.ndim < 2 or (id(p) in emb and id(p) not in tied):
            continue
        share = min(1.0, top_k / p.shape[0]) if p.ndim == 3 and top_k else 1.0
        total += p.numel() * share
    return total


def attention_width(model: nn.Module) -> tuple[int, int]:
    """``(attention layers, heads x head width)`` from the model's config."""
    c = model.config
    heads = int(getattr(c, "num_attention_heads", 0) or 0)
    head_dim = getattr(c, "head_dim", None) or (int(getattr(c, "hidden_size", 0) or 0) // max(1, heads))
    return int(getattr(c, "num_hidden_layers", 0) or 0), heads * int(head_dim)


def token_shares(model: nn.Module, cfg) -> dict[str, float]:
    """Hooked layer → the share of tokens it runs on (``top_k / E`` for an expert's matrix, else 1)."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    out = {}
    for n, m in select_layers(model, cfg.layers or None).items():
        E = m.group.gate_up_proj.shape[0] if isinstance(m, GroupMember) and top_k else 0
        out[n] = min(1.0, top_k / E) if E else 1.0
    return out


def _hook_flops(layers, cfg, n: int, mean_t: float) -> float:
    """FLOPs of the hooks' per-example gradients over ``n`` examples of ``mean_t`` tokens (each layer's route),
    with the projected K-FAC factors' ``Σ a aᵀ``, ``Σ g gᵀ`` where the build collects them."""
    covariance = cfg.precondition != "none" or cfg.collect_covariance
    total = 0.0
    for lp in layers:
        route, maps = _route(cfg, lp, cfg.batch_size, max(1, round(mean_t)))
        cost = factorized_cost if route == "factorized" else materialized_cost
        total += 2 * cost(n, mean_t, lp.n_in, lp.n_out, lp.k_a, lp.k_g, **maps)
        if covariance:  # (the materialized route maps each side's tokens for them too)
            mapped = n * mean_t * (lp.n_in * lp.k_a * maps["map_a"] + lp.n_out * lp.k_g * maps["map_g"])
            total += 2 * n * mean_t * (lp.k_a ** 2 + lp.k_g ** 2) + 2 * mapped * (route == "materialized")
    return total


def stage_flops(model: nn.Module, cfg, plan, lengths: np.ndarray) -> tuple[dict[str, float], dict[str, float]]:
    """``(GPU FLOPs, host FLOPs)`` per stage of the build ``plan`` over examples of ``lengths`` tokens."""
    lengths = np.asarray(lengths, dtype=np.float64)
    N, mean_t = len(lengths), float(lengths.mean())
    L, d_attn = attention_width(model)
    per_token, per_sq = 4 * matmul_params(model), 6 * L * d_attn
    shares = token_shares(model, cfg)
    experts = sum(2 * lp.n_out * lp.n_in * shares[lp.name] for lp in plan.layers if shares[lp.name] < 1)
    one = per_token + experts + _hook_flops(plan.layers, cfg, 1, mean_t) / mean_t  # per token, plus T² below
    capture = one * lengths.sum() + per_sq * float(np.square(lengths).sum())
    example = capture / N  # an average example's capture
    gpu, host = {"capture": capture}, {}
    if plan.full_fit:
        gpu["capture"] += plan.full_fit * mean_t * sum(lp.n_in ** 2 + lp.n_out ** 2 for lp in plan.layers)
    if cfg.precondition != "none":
        rot = sum(2 * (lp.k_g ** 2 * lp.k_a + lp.k_g * lp.k_a ** 2) for lp in plan.layers)  # a row's rotation
        if plan.sample_examples:
            S = plan.sample_examples
            gpu["fit sample"], host["fit sample"], host["capture"] = example * S, rot * S, rot * N
        else:
            host["fit"] = rot * N
            if plan.transcode:
                host["transcode"] = rot * N
    if plan.full_fit:
        correction = plan.correction * (example + 2 * mean_t * sum(
            lp.n_out ** 2 + lp.n_in ** 2 + lp.n_out * lp.n_in for lp in plan.layers))
        gpu["full-space fit"] = correction
        host["full-space fit"] = EIGH_COST * sum(lp.n_in ** 3 + lp.n_out ** 3 for lp in plan.layers)
    return gpu, host


def exact_stage_flops(model: nn.Module, cfg, layers, query_t: float,
                      candidate_ts: Sequence[float]) -> dict[str, float]:
    """FLOPs of one self-normalized exact stage (``--rerank-full C``, :mod:`gradindex.query.full`) of candidates of
    ``candidate_ts`` tokens each for a query of ``query_t``: ``passes``, the query's and the candidates' model
    passes (as the capture's); ``query``, its full gradient ``G_q`` (``2 T N_o N_i`` a layer) and ``M = (H + δI)⁻¹
    G_q`` (two rotations, ``4 (N_o² N_i + N_o N_i²)``); ``candidates``, each one's dense gradient dotted with ``M``
    (``2 T N_o N_i``) and its self-influence (per-token factors rotated and multiplied, ``2 T (N_o² + N_i² + N_o
    N_i)``); an expert's layer on its ``top_k / E`` share of the tokens. The last two are large dense products."""
    L, d_attn = attention_width(model)
    per_token, per_sq = 4 * matmul_params(model), 6 * L * d_attn
    shares = token_shares(model, cfg)

    def model_pass(t: float) -> float:
        return per_token * t + per_sq * t * t

    query, dense = 0.0, 0.0  # (dense: a candidate's dense products per token, linear in its tokens)
    for lp in layers:
        s, o, i = shares.get(lp.name, 1.0), lp.n_out, lp.n_in
        query += 2 * s * query_t * o * i + 4 * (o * o * i + o * i * i)
        dense += 2 * s * (2 * o * i + o * o + i * i)
    return {"passes": model_pass(query_t) + sum(model_pass(t) for t in candidate_ts), "query": query,
            "candidates": dense * float(sum(candidate_ts))}


ACTIVATION_FACTOR = 1.6
"""What a capture batch holds beyond the hooked layers' inputs and outputs and the logits counted by
:func:`activation_bytes`: the tensors autograd keeps beside them (the norms' inputs, the rotated queries and keys,
the key-value heads repeated for grouped attention, the MLP's activation output). Measured on CPU as the capture's
peak anonymous RSS over three batches (``benchmarks/plan_slice.py``): 1.6x on a SmolLM2-135M-shaped model (8 x 192
tokens: 3.34 GB against 1.98 counted + 0.14 hooks and rows) and on a 2-layer Llama-3-8B slice (8 x 64: 1.20 GB
against 0.60 + 0.22). Applied to the host RAM of :func:`gradindex.plan.plan_build` only: the GPU figures
(:func:`gpu_memory`, :func:`exact_stage_memory`) are not measured on a GPU and are left as counted."""


def hook_bytes(cfg, layers, B: int, T: int) -> int:
    """Bytes of the hooks' float32 working set for a batch of ``B`` examples of ``T`` tokens: the largest layer's
    per-token factors (and its materialized per-example gradients where it takes that route), every layer's
    projection maps, the batch's rows and their host copy."""
    largest = max((4 * B * T * (lp.n_in + lp.n_out) + 4 * (materialized_memory(B, lp.n_in, lp.n_out, lp.k_a)
                   if _route(cfg, lp, B, T)[0] == "materialized" else 0) for lp in layers), default=0)
    maps = sum(4 * (lp.k_a * lp.n_in * (lp.k_a != lp.n_in) + lp.k_g * lp.n_out * (lp.k_g != lp.n_out))
               for lp in layers)
    return int(largest + maps + 2 * 4 * B * sum(lp.numbers for lp in layers))


def activation_bytes(model: nn.Module, cfg, layers, tokens: int, device: str = "cpu") -> int:
    """Bytes a forward + backward of ``tokens`` tokens holds: every hooked layer's input and output per token
    (in the weights' dtype) and the logits: where the capture's fused head runs (:mod:`gradindex.capture.head`),
    one chunk of float32 logits and their log-probabilities on ``device``; else every token's logits with a
    float32 copy and its gradient (the largest term of a small model with a large vocabulary). The host plan
    multiplies it by :data:`ACTIVATION_FACTOR` (measured on CPU); the GPU figures do not (not measured on a GPU)."""
    from gradindex.capture.head import CHUNK_BYTES, MIN_ROWS, plain_head

    params = list(model.parameters())
    size = params[0].element_size() if params else 4
    shares = token_shares(model, cfg)
    per_token = sum((lp.n_in + lp.n_out) * shares[lp.name] for lp in layers)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    names = {lp.name for lp in layers}
    if vocab and plain_head(model, {m for n, m in model.named_modules() if n in names}) is not None:
        rows = min(tokens, max(MIN_ROWS, CHUNK_BYTES.get(device, 256 << 20) // (4 * vocab)))
        return int(tokens * per_token * size + 2 * 4 * rows * vocab)
    return int(tokens * (per_token * size + vocab * (size + 8)))


def gpu_memory(model: nn.Module, cfg, plan, longest: int) -> dict[str, int]:
    """Bytes on the capture's GPU (:class:`Estimate`'s ``gpu``) for a batch of ``longest``-token examples."""
    B = cfg.batch_size
    tokens = B * longest
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    activations = activation_bytes(model, cfg, plan.layers, tokens, "cuda")
    full = 8 * sum(lp.n_in ** 2 + lp.n_out ** 2 for lp in plan.layers) if plan.full_fit else 0
    return {"weights": int(weights), "activations": int(activations), "hooks": hook_bytes(cfg, plan.layers, B, longest),
            "full_sums": int(full)}


def _route(cfg, lp, B: int, T: int) -> tuple[str, dict[str, bool]]:
    """The route a layer's batch of ``B`` examples of ``T`` tokens takes, and which of its sides are mapped."""
    maps = dict(map_a=lp.k_a != lp.n_in, map_g=lp.k_g != lp.n_out)
    if cfg.route != "auto":
        return cfg.route, maps
    return choose_route(B, T, lp.n_in, lp.n_out, lp.k_a, lp.k_g, **maps), maps


def full_space_bytes(layers) -> int:
    """Bytes of the full-space files: per layer float32 ``Q_S [N_o, N_o]``, ``Q_A [N_i, N_i]``, ``Λ [N_o, N_i]``."""
    return sum(4 * (lp.n_out ** 2 + lp.n_in ** 2 + lp.n_out * lp.n_in) for lp in layers)


def exact_stage_memory(weights: int, activations: int, layers, batch_size: int,
                       cache_bytes: int | None = CURVATURE_CACHE_BYTES) -> dict[str, int]:
    """Bytes of the exact stage on its device (module docstring): ``weights``, ``m`` (one query's float32 ``M``),
    ``curvature`` (kept: ``min(every layer's, max(cache_bytes, the largest layer's))``), ``largest_layer`` (shown,
    not added: within ``curvature``), a candidate batch's ``activations`` and ``hooks``."""
    from gradindex.query.full import DENSE_BYTES

    sizes = [4 * (lp.n_out ** 2 + lp.n_in ** 2 + lp.n_out * lp.n_in) for lp in layers]
    largest = max(sizes, default=0)
    curvature = sum(sizes) if cache_bytes is None else min(sum(sizes), max(cache_bytes, largest))
    widest = 4 * batch_size * max((lp.n_out * lp.n_in for lp in layers), default=0)  # a batch's [B, N_o, N_i]
    return {"weights": int(weights), "m": 4 * sum(lp.n_out * lp.n_in for lp in layers), "curvature": int(curvature),
            "largest_layer": int(largest), "activations": int(activations),
            "hooks": int(min(DENSE_BYTES, widest) + 2 * widest)}


def estimate_build(model: nn.Module, cfg, plan, lengths, dtype: str, tflops: float | None = None) -> Estimate:
    """The time and GPU memory of the build ``plan`` (:func:`gradindex.plan.plan_build`) of ``model`` (weights
    or none: shapes only) under ``cfg`` over examples of ``lengths`` tokens, in ``dtype`` at ``tflops`` per GPU
    (default :data:`TFLOPS`)."""
    tflops = float(tflops or TFLOPS[dtype])
    if not tflops > 0:
        raise ValueError(f"--tflops must be > 0, got {tflops:g}")
    longest = int(max(lengths)) if len(lengths) else 1
    gpu = gpu_memory(model, cfg, plan, longest)
    full = full_space_bytes(plan.layers)
    full_gpus = max(1, math.ceil(full / GPU_BYTES))
    gpus = max(1, math.ceil(sum(gpu.values()) / GPU_BYTES), full_gpus if plan.full_fit else 1)
    on_gpu, on_host = stage_flops(model, cfg, plan, np.asarray(lengths))
    seconds = {k: on_gpu.get(k, 0) / (gpus * tflops * 1e12) + on_host.get(k, 0) / HOST_FLOPS
               for k in [*on_gpu, *(k for k in on_host if k not in on_gpu)]}
    flops = {k: on_gpu.get(k, 0) + on_host.get(k, 0) for k in seconds}
    exact = exact_stage_memory(gpu["weights"], gpu["activations"], plan.layers, cfg.batch_size)
    from gradindex.query.full import EXACT_STAGE_C

    t = float(np.mean(lengths)) if len(lengths) else 1.0
    exact_s = sum(exact_stage_flops(model, cfg, plan.layers, t, [t] * EXACT_STAGE_C).values()) / (tflops * 1e12)
    return Estimate(tflops, flops, seconds, gpu, full, gpus, full_gpus, cfg.batch_size * longest, dtype, exact,
                    exact_s)
