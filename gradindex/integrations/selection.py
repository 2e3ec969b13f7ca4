"""Online data selection: score each training batch's examples against a target set's gradient, then keep,
drop or reweight them before the optimizer update, with the user's loop unchanged.

Per micro-batch, before the loop's own forward:

1. a **scoring pass** on the batch: forward and weight-free backward through
   :class:`gradindex.capture.GradientCapture` (:func:`gradindex.capture.batch.tensor_batch_gradients`,
   the offline build's step), in eval mode and with the RNG state saved and restored, so no
   parameter gradient, dropout draw or module mode of the loop changes; it gives each example's
   projected gradient ``g_i`` of its summed token loss, per hooked layer;
2. a **score** against the target gradient ``t``: the gradient of the target set's mean token loss,
   projected the same way (recomputed every ``refresh_every`` steps): ``cosine`` (default),
   ``⟨g_i, t⟩ / (‖g_i‖ ‖t‖)`` over the hooked layers concatenated, or ``dot``. Optionally
   preconditioned: ``precondition="adam"`` takes both gradients through ``Γ^½``, ``Γ = 1/(√V + ε)``
   from the loop's Adam second moments factored per side and folded into the projection (so
   ``⟨Γ g_i, t⟩``, the first-order change of the target loss under an Adam-like step on ``i``);
   ``"diagonal"`` divides every projected coordinate by ``√v``, a running mean of the training
   examples' squared projected gradients (no optimizer needed);
3. a **policy** turns the scores into per-example weights: :class:`TopFraction`, :class:`Threshold`
   (0/1 keeps) or :class:`Reweight` (softmax or clipped scores); :class:`RandomFraction` (no
   scoring pass) is the baseline of the same size;
4. the loop's real step then trains on the result. :class:`SelectingLoader` (plain loops) yields
   the kept examples only, so a dropped example costs no training compute. Weights are applied by a
   hook on the model's output logits that multiplies example ``i``'s rows of the logits gradient by
   ``w_i``: whatever the loop's reduction of a separable token loss (``c · Σ_i L_i``: HF's mean,
   ``num_items_in_batch``, a GradScaler), every parameter gradient becomes ``c · Σ_i w_i ∇L_i``.
   Weights are scaled so that ``Σ_i w_i n_i = Σ_i n_i`` (``n_i``: target tokens), so the update's
   size matches the loop's token-mean; for 0/1 keeps that is the mean over the kept tokens, the
   same update as the kept subset. :meth:`OnlineSelector.attach` (used by :class:`SelectionCallback`
   for the ``transformers.Trainer``) scores in a forward pre-hook of the model, at the parameters of
   that very forward, and drops by zero weights.

The logged loss is the loop's own (unweighted, over the whole batch in hook mode); only gradients
are weighted. A policy that keeps every example leaves the loop bit-identical to plain training.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from gradindex import distributed
from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
from gradindex.capture.batch import batch_gradients, tensor_batch_gradients
from gradindex.data import IGNORE
from gradindex.integrations.live import COMBINED, LIVE_MARK

SCORES = ("cosine", "dot")
PRECONDITIONERS = ("none", "adam", "diagonal")
DIAGONAL_DAMPING = 1e-3
"""``precondition="diagonal"``: the running second moment ``v`` is damped by this fraction of its mean (its own
setting, not the influence methods' :data:`gradindex.methods.DEFAULT_DAMPING`)."""


# -- policies -------------------------------------------------------------------------------------
@dataclass
class TopFraction:
    """Keep the ``round(fraction · B)`` highest-scoring examples of each batch (at least ``min_keep``).

    Ties go to the earlier example in the batch; kept examples keep their batch order.
    """

    fraction: float
    min_keep: int = 1
    needs_scores = True

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        check_min_keep(self.min_keep)

    def count(self, batch_size: int) -> int:
        return min(batch_size, max(self.min_keep, math.floor(self.fraction * batch_size + 0.5)))

    def __call__(self, scores: torch.Tensor, batch_size: int) -> torch.Tensor:
        order = torch.argsort(-torch.nan_to_num(scores.double(), nan=-math.inf), stable=True)  # NaN last
        w = torch.zeros(batch_size)
        w[order[: self.count(batch_size)]] = 1.0
        return w


@dataclass
class Threshold:
    """Keep the examples scoring at least ``min_score``; with fewer than ``min_keep``, the best ``min_keep``.

    ``min_keep=0`` may drop a whole batch: :class:`SelectingLoader` then skips it (the loop never
    sees it), hook mode gives it zero weight.
    """

    min_score: float
    min_keep: int = 1
    needs_scores = True

    def __post_init__(self) -> None:
        check_min_keep(self.min_keep)

    def __call__(self, scores: torch.Tensor, batch_size: int) -> torch.Tensor:
        w = (scores >= self.min_score).float()
        if int(w.sum()) < self.min_keep:
            w = TopFraction(1.0 / batch_size, min_keep=self.min_keep)(scores, batch_size)
        return w


@dataclass
class Reweight:
    """Weights from the scores: ``softmax(scores / temperature)`` or ``relu`` (``max(score, 0)``; a batch with
    no positive score is kept unweighted), capped at ``max_weight`` times the batch mean if given.

    The selector then scales them so that ``Σ w_i n_i = Σ n_i`` (see the module doc).
    """

    temperature: float = 0.1
    kind: str = "softmax"
    max_weight: float | None = None
    needs_scores = True

    def __post_init__(self) -> None:
        if self.kind not in ("softmax", "relu"):
            raise ValueError(f"kind {self.kind!r} is not one of ['softmax', 'relu']")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.max_weight is not None and not self.max_weight > 0:
            raise ValueError(f"max_weight must be positive (a cap on the weights, a multiple of the batch mean), got "
                             f"{self.max_weight}: at 0 no example would be trained on")

    def __call__(self, scores: torch.Tensor, batch_size: int) -> torch.Tensor:
        s = scores.double()
        if self.kind == "softmax":
            w = torch.softmax(s / self.temperature, dim=0)
        else:
            w = s.clamp(min=0.0)
            if float(w.sum()) == 0.0:
                w = torch.ones_like(s)
        w = w * (batch_size / w.sum())  # mean 1
        if self.max_weight is not None:
            w = w.clamp(max=self.max_weight)
        return w.float()


@dataclass
class RandomFraction:
    """Keep ``round(fraction · B)`` examples drawn uniformly (seeded): the baseline, with no scoring pass."""

    fraction: float
    seed: int = 0
    min_keep: int = 1
    needs_scores = False

    def __post_init__(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)

    def __call__(self, scores: torch.Tensor | None, batch_size: int) -> torch.Tensor:
        k = TopFraction(self.fraction, self.min_keep).count(batch_size)
        w = torch.zeros(batch_size)
        w[torch.randperm(batch_size, generator=self._gen)[:k]] = 1.0
        return w


@dataclass
class KeepAll:
    """Score every batch and keep it whole (to log scores, or to time the scoring pass)."""

    needs_scores = True

    def __call__(self, scores: torch.Tensor, batch_size: int) -> torch.Tensor:
        return torch.ones(batch_size)


# -- the target ----------------------------------------------------------------------------------
def target_from_texts(texts: Sequence[str], tokenizer, max_length: int = 512):
    """Token ids and labels of target texts (:class:`gradindex.data.Tokenized`), as ``gradindex build`` reads them."""
    from gradindex.data import records_from_texts, tokenize_records

    return tokenize_records(records_from_texts(list(texts)), tokenizer, max_length)


def check_target_vocab(ids: list[list[int]], model: nn.Module) -> None:
    """Refuse target token ids outside the model's vocabulary (another tokenizer's: torch's embedding lookup fails
    with an index error at the first batch)."""
    try:
        vocab = int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError):
        return
    bad = [int(t) for x in ids for t in x if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"target token ids {bad[:3]} are outside the model's vocabulary of {vocab}: tokenize the "
                         "target with the model's own tokenizer (target_from_texts(texts, tokenizer))")


def check_min_keep(min_keep: int) -> None:
    if not (isinstance(min_keep, int) and min_keep >= 0):
        raise ValueError(f"min_keep must be a whole number >= 0 (examples kept of each batch at least), got "
                         f"{min_keep!r}")


def _target_lists(target, labels) -> tuple[list[list[int]], list[list[int]]]:
    if hasattr(target, "input_ids") and hasattr(target, "labels"):
        return [list(x) for x in target.input_ids], [list(y) for y in target.labels]
    if isinstance(target, str) or any(isinstance(x, str) for x in target):
        raise ValueError("the target is text: give its token ids, e.g. target_from_texts(texts, tokenizer) (a "
                         "Tokenized target, labels included)")
    ids = [list(x) for x in target]
    labs = [list(y) for y in labels] if labels is not None else [list(x) for x in ids]
    if len(labs) != len(ids) or any(len(a) != len(b) for a, b in zip(ids, labs)):
        raise ValueError("target labels must match the target token ids one for one")
    if not ids:
        raise ValueError("the target set is empty")
    return ids, labs


def batch_labels(batch: Mapping) -> torch.Tensor:
    """The batch's unshifted ``labels``, else its ``input_ids`` with padding (``attention_mask`` 0) ignored."""
    labels = batch.get("labels")
    if labels is not None:
        return torch.as_tensor(labels)
    ids = torch.as_tensor(batch["input_ids"])
    mask = batch.get("attention_mask")
    return ids if mask is None else ids.masked_fill(torch.as_tensor(mask).to(ids.device) == 0, IGNORE)


# -- the score and the weights -------------------------------------------------------------------
class Scorer:
    """How each example's projected gradient is compared with the target's (module doc, step 2): ``kind``
    ``cosine`` or ``dot``, with ``diagonal`` through ``v^{-1/2}``, ``v`` the running second moment
    (:meth:`update`, ``beta``) damped by ``damping`` times its mean."""

    def __init__(self, kind: str, diagonal: bool, beta: float, damping: float) -> None:
        if kind not in SCORES:
            raise ValueError(f"score {kind!r} is not one of {list(SCORES)}")
        self.kind, self.diagonal, self.beta, self.damping = kind, diagonal, beta, damping
        self.second_moment: dict[str, torch.Tensor] | None = None
        """layer → ``[D]`` running mean of squared per-example projected gradients (``diagonal``)."""
        self._batches = 0
        self._raw: dict[str, torch.Tensor] = {}

    def update(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Adam-like bias-corrected running mean (``beta``) of the batches' mean squared per-example gradients."""
        self._batches += 1
        k, b = self._batches, self.beta
        for n in grads:
            sq = grads[n].double().pow(2).mean(0)
            self._raw[n] = (1 - b) * sq + (b * self._raw[n] if n in self._raw else 0.0)
        self.second_moment = {n: (self._raw[n] / (1 - b ** k)).float() for n in grads}

    def __call__(self, grads: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor],
                 layers: Sequence[str]) -> torch.Tensor:
        """``[B]`` scores of per-example gradients (layer → ``[B, D]``) against ``target`` (layer → ``[D]``)."""
        g = torch.cat([grads[n].float() for n in layers], dim=1)  # [B, D]
        t = torch.cat([target[n].to(g.device) for n in layers])  # [D]
        if self.diagonal:
            v = torch.cat([self.second_moment[n].to(g.device) for n in layers])
            d = (v + self.damping * v.mean()).rsqrt()  # [D]
            g, t = g * d, t * d
        s = g @ t
        if self.kind == "cosine":
            s = s / (g.norm(dim=1) * t.norm()).clamp(min=1e-30)
        return s


class LogitWeights:
    """Per-example weights on the next training forward's output logits gradient (module doc, step 4), applied
    by a forward hook on ``model`` (:meth:`hook`) unless ``paused()`` (the selector's own scoring pass)."""

    def __init__(self, model: nn.Module, paused) -> None:
        self.model, self.paused = model, paused
        self._armed: torch.Tensor | None = None
        self._handle = None

    def arm(self, w: torch.Tensor, batch: Mapping) -> None:
        """Weights ``w`` for the next training forward, on ``batch``'s examples: scaled so that
        ``Σ w_i n_i = Σ n_i`` (``n_i``: target tokens; all zero stays zero)."""
        n = (batch_labels(batch)[:, 1:] != IGNORE).sum(1).cpu().to(w.device, torch.float64)
        tot = float((w.double() * n).sum())
        self._armed = w * 0.0 if tot == 0.0 else (w.double() * (float(n.sum()) / tot)).float()

    def _output_hook(self, module: nn.Module, args, kwargs, output) -> None:
        if self.paused() or self._armed is None or not torch.is_grad_enabled():
            return
        w, self._armed = self._armed, None
        out = None
        for name in ("logits", "log_probs"):
            x = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
            if isinstance(x, torch.Tensor) and x.requires_grad:
                out = x
                break
        if out is None:
            raise ValueError("online selection's weights act on the model's output 'logits' (or a fused head's "
                             "'log_probs'), and this forward returned neither with gradients")
        if out.shape[0] != w.shape[0]:
            raise ValueError(f"weights for {w.shape[0]} examples, but the forward ran on {out.shape[0]}")
        scale = w.to(out.device).view(-1, *([1] * (out.ndim - 1)))
        out.register_hook(lambda g: g * scale.to(g.dtype))

    def hook(self) -> None:
        if self._handle is None:
            self._handle = self.model.register_forward_hook(self._output_hook, with_kwargs=True)

    def unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._armed = None


# -- the selector --------------------------------------------------------------------------------
class OnlineSelector:
    """Scores a training batch's examples against a target set's gradient and turns them into weights.

    ``target``: token-id lists (labels = ids), or a :class:`gradindex.data.Tokenized` (see
    :func:`target_from_texts`), or ids with ``target_labels``. ``policy``: :class:`TopFraction`,
    :class:`Threshold`, :class:`Reweight`, :class:`RandomFraction`, :class:`KeepAll` or any callable
    ``(scores [B], B) -> weights [B]`` with a ``needs_scores`` attribute. ``refresh_every``: steps between
    recomputations of the target gradient (0: once, at the first batch); steps are the optimizer's
    updates when ``optimizer`` is given (or the Trainer's), else scored batches (``count_steps=False``:
    the caller sets :attr:`step`). ``projection``, ``projection_kind``, ``seed``, ``layers`` and ``route``
    are ``gradindex build``'s. ``precondition``: ``none``, ``adam`` (the optimizer's second moments, see
    :meth:`_adam_transforms`) or ``diagonal`` (:class:`Scorer`, with ``beta`` and ``damping``).
    """

    def __init__(self, model: nn.Module, target, policy, *, target_labels: Sequence[Sequence[int]] | None = None,
                 score: str = "cosine", precondition: str = "none", beta: float = 0.99,
                 damping: float = DIAGONAL_DAMPING, refresh_every: int = 0, projection: str | ProjectionSpec = "16",
                 projection_kind: str = "gaussian", seed: int = 0, layers: Sequence[str] = (), route: str = "auto",
                 target_batch_size: int = 16, optimizer=None, count_steps: bool = True) -> None:
        if precondition not in PRECONDITIONERS:
            raise ValueError(f"precondition {precondition!r} is not one of {list(PRECONDITIONERS)}")
        self.model = distributed.unwrap(model)
        self.policy = policy
        self.scorer = Scorer(score, precondition == "diagonal", beta, damping)
        self.precondition = precondition
        self.refresh_every = refresh_every
        self.target_batch_size = target_batch_size
        self.target_ids, self.target_labels = _target_lists(target, target_labels)
        check_target_vocab(self.target_ids, model)
        spec = projection if isinstance(projection, ProjectionSpec) else ProjectionSpec.parse(
            projection, kind=projection_kind, seed=seed)
        self.spec, self.route, self.layer_patterns = spec, route, layers or None
        self.space = RowSpace(spec)
        self.capture = GradientCapture(self.model, self.layer_patterns, ProjectedRows(self.space, route))
        self.layers = list(self.capture.modules)
        self.optimizer = optimizer
        """Whose Adam second moments ``precondition='adam'`` reads (the Trainer's, with :class:`SelectionCallback`)."""
        if precondition == "adam" and optimizer is None:
            raise ValueError("precondition='adam' reads the optimizer's second moments: pass optimizer=")
        self._adam_missing = False
        self.target: dict[str, torch.Tensor] | None = None
        """layer → ``[D]`` gradient of the target set's mean token loss (projected), at the last refresh."""
        self.step = 0
        self.refreshed_at: int | None = None
        self.last_scores: torch.Tensor | None = None
        self.last_weights: torch.Tensor | None = None
        self.stats = {"batches": 0, "examples": 0, "kept": 0, "refreshes": 0, "scoring_s": 0.0, "refresh_s": 0.0}
        """Batches and examples weighed, examples kept (weight > 0), target refreshes, and the seconds spent
        scoring training batches and refreshing the target."""
        self._warned_empty = False
        self._busy = False
        self.weights = LogitWeights(self.model, lambda: self._busy)
        self._handles: list = []
        self._opt_handle = None
        self.count_batches = optimizer is None and count_steps
        """Whether each scored batch counts as a step (no optimizer to count updates, no Trainer to tell)."""
        if optimizer is not None and count_steps:
            self._opt_handle = optimizer.register_step_post_hook(lambda *a: self._stepped())

    def _stepped(self) -> None:
        self.step += 1

    # -- the scoring context --------------------------------------------------------------------
    @contextmanager
    def _scoring(self):
        """Hooks on, eval mode, RNG forked; every module's mode and the RNG state restored after."""
        if getattr(self.model, LIVE_MARK, False):
            raise ValueError(COMBINED)
        modes = [(m, m.training) for m in self.model.modules()]
        dev = next(self.model.parameters()).device
        devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        self._busy = True
        try:
            with torch.random.fork_rng(devices=devices):
                self.model.train(False)
                self.capture.attach()
                try:
                    yield
                finally:
                    self.capture.detach()
        finally:
            for m, t in modes:
                m.training = t
            self._busy = False

    # -- the target -----------------------------------------------------------------------------
    def refresh(self) -> dict[str, torch.Tensor]:
        """Recompute :attr:`target` at the current parameters: one scoring pass over the target set."""
        t0 = time.perf_counter()
        if self.precondition == "adam":
            self.space = RowSpace(self.spec, self._adam_transforms())
            self.capture = GradientCapture(self.model, self.layer_patterns, ProjectedRows(self.space, self.route))
        sums: dict[str, torch.Tensor] = {}
        tokens = 0
        B = self.target_batch_size
        with self._scoring():
            for s in range(0, len(self.target_ids), B):
                bg = batch_gradients(self.model, self.capture, self.target_ids[s:s + B], self.target_labels[s:s + B], 0)
                tokens += int(bg.num_tokens.sum())
                for n, g in bg.grads.items():
                    g = g.double().sum(0)
                    sums[n] = g if n not in sums else sums[n] + g
        if tokens == 0:
            raise ValueError("the target set has no target token (labels all -100, or one-token texts)")
        self.target = {n: (sums[n] / tokens).float() for n in self.layers}
        self.refreshed_at = self.step
        self.stats["refreshes"] += 1
        self.stats["refresh_s"] += time.perf_counter() - t0
        return self.target

    def _adam_transforms(self) -> dict:
        """Per hooked layer, ``Γ^½`` with ``Γ = 1/(√V + ε)`` factored per side (Adafactor's rank-1 ``V``, as
        ``gradindex build --optimizer-state --adam-mode factored``), from the optimizer's live ``exp_avg_sq``.

        Both the target's and the examples' gradients get it, so ``⟨Γ^½ g_i, Γ^½ t⟩ = ⟨Γ g_i, t⟩``: the first-order
        change of the target loss under an Adam-like step on example ``i``. A layer with no state yet (before the
        first update) is left as it is, and the target is refreshed again once the state exists.
        """
        from gradindex.capture.adam import adam_transform
        from gradindex.capture.transform import LayerTransform

        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds the torch optimizer
        eps = {id(p): g.get("eps", 1e-8) for g in opt.param_groups for p in g["params"]}
        out = {}
        self._adam_missing = False
        for name, mod in self.capture.modules.items():
            info = self.capture.infos[name]
            params = [mod.weight] + ([mod.bias] if info.bias else [])
            states = [opt.state.get(q, {}).get("exp_avg_sq") for q in params]
            if any(v is None for v in states):
                self._adam_missing = True
                continue
            V = info.weight_grad_to_G(states[0].double(), states[1].double() if info.bias else None)
            t = adam_transform(V, float(eps[id(mod.weight)]), "factored")
            out[name] = LayerTransform(g=t.g.sqrt(), a=t.a.sqrt()).to(mod.weight.device)
        return out

    def _maybe_refresh(self) -> None:
        if self.target is None:
            self.refresh()
            return
        due = self.refresh_every > 0 and self.step - self.refreshed_at >= self.refresh_every
        if due or (self._adam_missing and self.step > self.refreshed_at):
            self.refresh()

    # -- scores ---------------------------------------------------------------------------------
    def example_gradients(self, batch: Mapping) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per-example projected gradients (layer → ``[B, D]``) and target-token counts ``[B]`` of a batch."""
        if "input_ids" not in batch:
            raise ValueError(f"the batch has no 'input_ids' (keys: {sorted(batch)}); online selection scores "
                             "token batches of a causal LM")
        ids = torch.as_tensor(batch["input_ids"])
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
        tb = {"input_ids": ids, "attention_mask": mask, "labels": batch_labels(batch)}
        with self._scoring():
            bg = tensor_batch_gradients(self.model, self.capture, tb)
        return bg.grads, bg.num_tokens

    def score(self, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B]`` scores of a batch's examples (CPU float32) and their target-token counts."""
        self._maybe_refresh()
        t0 = time.perf_counter()
        grads, ntok = self.example_gradients(batch)
        if self.scorer.diagonal:
            self.scorer.update({n: grads[n] for n in self.layers})
        s = self.scorer(grads, self.target, self.layers).cpu()
        self.stats["scoring_s"] += time.perf_counter() - t0
        return s, ntok.cpu()

    def weigh(self, batch: Mapping) -> torch.Tensor | None:
        """The policy's raw ``[B]`` weights of a batch (0/1 keeps, or reweights); ``None`` when all are 1."""
        B = int(torch.as_tensor(batch["input_ids"]).shape[0])
        if getattr(self.policy, "needs_scores", True):
            scores, _ = self.score(batch)
            self.last_scores = scores
            w = self.policy(scores, B)
        else:
            w = self.policy(None, B)
        w = torch.as_tensor(w, dtype=torch.float32).reshape(-1)
        if w.shape[0] != B or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError(f"the policy returned weights {w.tolist()[:8]} for a batch of {B}: need {B} finite "
                             "weights >= 0")
        self.last_weights = w
        self.stats["batches"] += 1
        self.stats["examples"] += B
        self.stats["kept"] += int((w > 0).sum())
        return None if bool((w == 1).all()) else w

    # -- hook mode (the Trainer, or a loop whose batches cannot be wrapped) ----------------------
    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if self._busy or not torch.is_grad_enabled() or not module.training:
            return None
        batch = dict(kwargs)
        if args:
            batch.setdefault("input_ids", args[0])
        w = self.weigh(batch)
        if w is not None:
            self.weights.arm(w, batch)
        if self.count_batches:
            self.step += 1
        return None

    def attach(self) -> OnlineSelector:
        """Score every training forward of the model in a pre-hook; weights (drops: 0) on its logits' gradient."""
        if not self._handles:
            self._handles.append(self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self.weights.hook()
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.weights.unhook()

    def warn_if_nothing_kept(self) -> None:
        """Warn (once) when the policy has kept no example of any batch scored so far: the loop trained on nothing."""
        if self.stats["batches"] and not self.stats["kept"] and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(f"the selection policy {self.policy!r} kept no example of the {self.stats['batches']} "
                          "batch(es) it saw, so the loop trained on nothing; lower its threshold or give it "
                          "min_keep >= 1", stacklevel=2)

    def close(self) -> None:
        self.warn_if_nothing_kept()
        self.detach()
        if self._opt_handle is not None:
            self._opt_handle.remove()
            self._opt_handle = None

    def __enter__(self) -> OnlineSelector:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()


def subset_batch(batch: Mapping, keep: torch.Tensor, batch_size: int):
    """The examples ``keep`` (indices) of a batch: every tensor or list whose first dimension is the batch's."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == batch_size:
            out[k] = v.index_select(0, keep.to(v.device))
        elif isinstance(v, list | tuple) and len(v) == batch_size:
            out[k] = type(v)(v[i] for i in keep.tolist())
        else:
            out[k] = v
    if type(batch) is dict:
        return out
    try:
        return type(batch)(out)
    except Exception:  # noqa: BLE001 - a mapping type that cannot be rebuilt from a dict
        return out


class SelectingLoader:
    """Wrap a plain loop's batches (dicts with ``input_ids``, and ``labels``/``attention_mask``)::

        selector = OnlineSelector(model, target, TopFraction(0.25), optimizer=opt)
        for batch in SelectingLoader(loader, selector):   # the rest of the loop unchanged
            ...

    Each batch is scored when the loop asks for it (after the previous update: current parameters).
    0/1 policies yield the kept examples only (a batch left empty is skipped); reweighting yields the
    whole batch and weights the next training forward's logits gradient. Without ``optimizer`` given
    to the selector, every yielded batch counts as a step for ``refresh_every``.
    """

    def __init__(self, loader: Iterable[Mapping], selector: OnlineSelector):
        self.loader = loader
        self.selector = selector

    def __len__(self) -> int:
        return len(self.loader)  # an upper bound: a threshold may skip batches

    def __iter__(self) -> Iterator[Mapping]:
        sel = self.selector
        sel.weights.hook()
        try:
            for batch in self.loader:
                if not isinstance(batch, Mapping):
                    raise TypeError(f"SelectingLoader takes batches that are mappings (input_ids, labels, ...), "
                                    f"got {type(batch).__name__}")
                w = sel.weigh(batch)
                if w is None:
                    out = batch
                elif bool(((w == 0) | (w == 1)).all()):
                    keep = w.nonzero().squeeze(1)
                    if keep.numel() == 0:
                        sel.step += int(sel.count_batches)
                        continue
                    out = subset_batch(batch, keep, w.shape[0])
                else:
                    sel.weights.arm(w, batch)
                    out = batch
                yield out
                sel.step += int(sel.count_batches)
            sel.warn_if_nothing_kept()
        finally:
            if not sel._handles:
                sel.weights.unhook()
