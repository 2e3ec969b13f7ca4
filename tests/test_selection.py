"""Online data selection against independent computations: torch.func per-example gradients, projected and
dotted with the target's mean gradient by hand; the policies' choices; the weighted loss; bit-identity."""

from __future__ import annotations

import pytest
import torch

from gradindex.capture import ProjectionSpec, layer_info, projection_matrix
from gradindex.data import collate, per_example_loss
from gradindex.integrations import (
    KeepAll,
    OnlineSelector,
    RandomFraction,
    Reweight,
    SelectingLoader,
    Threshold,
    TopFraction,
)

V = 64
SPEC = ProjectionSpec(k_a=4, k_g=6, seed=7)


def _gpt2(dropout: float = 0.0, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=V, n_layer=2, n_embd=32, n_head=4, n_positions=64, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return GPT2LMHeadModel(cfg)


def _seqs(n: int, seed: int, lo: int = 4, hi: int = 14) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _batch(seqs: list[list[int]]) -> dict:
    return collate(seqs, seqs, 0)


TARGET = _seqs(6, seed=11)


def _projected_func_grads(model, layers: list[str], ids: list[int], labels: list[int], scales=None) -> torch.Tensor:
    """One example's projected gradient of its summed token loss, concatenated over ``layers``, via torch.func
    (``scales``: layer → per-side ``(s_g [N_o], s_a [N_i+1])`` applied to ``G`` before the projection)."""
    from torch.func import functional_call, grad

    mods = dict(model.named_modules())
    params = {k: v.detach() for k, v in model.named_parameters()}
    keys = [k for n in layers for k in (f"{n}.weight", f"{n}.bias")]

    def loss_fn(p, x, y):
        out = functional_call(model, {**params, **p}, (x,), {"use_cache": False})
        return per_example_loss(out.logits, y)[0].sum()

    g = grad(loss_fn)({k: params[k] for k in keys}, torch.tensor([ids]), torch.tensor([labels]))
    out = []
    for n in layers:
        info = layer_info(mods[n])
        G = info.weight_grad_to_G(g[f"{n}.weight"], g[f"{n}.bias"]).double()  # [N_o, N_i+1]
        if scales is not None:
            G = scales[n][0][:, None] * G * scales[n][1][None, :]
        P_g = projection_matrix(SPEC, n, "g", info.n_out).double()
        P_a = projection_matrix(SPEC, n, "a", info.n_in_total).double()
        out.append((P_g @ G @ P_a.T).reshape(-1))
    return torch.cat(out)


def _reference(model, layers, batch_seqs, score="cosine", damping=None, scales=None):
    """Scores of ``batch_seqs`` against the mean-token-loss gradient of :data:`TARGET`, computed independently."""
    model.eval()
    t = sum(_projected_func_grads(model, layers, s, s, scales) for s in TARGET) / sum(len(s) - 1 for s in TARGET)
    g = torch.stack([_projected_func_grads(model, layers, s, s, scales) for s in batch_seqs])  # [B, D]
    if damping is not None:  # diagonal: the first batch's mean squared per-example gradients
        v = g.pow(2).mean(0)
        d = (v + damping * v.mean()).rsqrt()
        g, t = g * d, t * d
    s = g @ t
    return s / (g.norm(dim=1) * t.norm()) if score == "cosine" else s


@pytest.mark.parametrize("score,precondition", [("dot", "none"), ("cosine", "none"), ("cosine", "diagonal")])
def test_scores_equal_torch_func_projected_gradients_against_the_target_mean(score, precondition):
    model = _gpt2()
    seqs = _seqs(5, seed=3)
    sel = OnlineSelector(model, TARGET, KeepAll(), projection=SPEC, score=score, precondition=precondition,
                         damping=0.1, target_batch_size=4)
    model.train()
    got, ntok = sel.score(_batch(seqs))  # padded batch, target set in two batches
    assert model.training and all(m.training for m in model.modules())  # modes restored
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient formed
    want = _reference(model, sel.layers, seqs, score, damping=0.1 if precondition == "diagonal" else None)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-6 * want.abs().max()), (got, want)
    assert ntok.tolist() == [len(s) - 1 for s in seqs]
    if score == "dot":  # scores are not all alike, so the policy tests below choose something
        assert got.max() - got.min() > 0.1 * got.abs().max()


def test_adam_preconditioned_scores_equal_the_factored_second_moment_by_hand():
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    model.train()
    for i in range(2):  # an optimizer state to read
        model(**_batch(_seqs(4, seed=40 + i))).loss.backward()
        opt.step()
        opt.zero_grad()
    sel = OnlineSelector(model, TARGET, KeepAll(), projection=SPEC, precondition="adam", optimizer=opt)
    seqs = _seqs(5, seed=3)
    got, _ = sel.score(_batch(seqs))
    scales = {}
    for n, mod in _hooked(model):
        V = torch.cat([opt.state[mod.weight]["exp_avg_sq"].T, opt.state[mod.bias]["exp_avg_sq"][:, None]], 1).double()
        r, c = V.sum(1), V.sum(0)  # Adafactor's rank-1 V = r c^T / sum(r); sqrt(V) = rho gamma^T
        rho, gamma = (r / r.sum().sqrt()).sqrt(), (c / r.sum().sqrt()).sqrt()
        scales[n] = ((1 / (rho + 1e-3)).sqrt(), (1 / (gamma + 1e-3)).sqrt())  # Gamma^(1/2), sqrt(eps) = 1e-3
    want = _reference(model, sel.layers, seqs, "cosine", scales=scales)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-6), (got, want)
    plain = _reference(model, sel.layers, seqs, "cosine")
    assert not torch.allclose(got.double(), plain, rtol=1e-2)  # the preconditioner changed the scores
    with pytest.raises(ValueError, match="optimizer"):
        OnlineSelector(model, TARGET, KeepAll(), precondition="adam")


def test_adam_preconditioning_waits_for_the_optimizer_state():
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    sel = OnlineSelector(model, TARGET, TopFraction(0.5), projection=SPEC, precondition="adam", optimizer=opt)
    for b in SelectingLoader([_batch(_seqs(4, seed=50 + i)) for i in range(3)], sel):
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    # step 0 had no state (plain target); step 1 refreshed with it; refresh_every=0 then keeps it
    assert sel.stats["refreshes"] == 2 and sel.refreshed_at == 1 and sel.space.transforms


def test_policies_choose_as_specified():
    s = torch.tensor([0.3, -0.1, 0.9, 0.3, 0.5, -0.7, 0.2, 0.0])
    assert TopFraction(0.25)(s, 8).nonzero().squeeze(1).tolist() == [2, 4]
    assert TopFraction(0.5)(s, 8).nonzero().squeeze(1).tolist() == [0, 2, 3, 4]  # tie 0.3: both kept at 4
    assert TopFraction(0.375)(s, 8).nonzero().squeeze(1).tolist() == [0, 2, 4]  # tie: the earlier one
    assert TopFraction(0.01)(s, 8).sum() == 1 and TopFraction(0.01, min_keep=0)(s, 8).sum() == 0
    assert TopFraction(0.25)(torch.tensor([float("nan"), 1.0, 0.0, 2.0]), 4).nonzero().squeeze(1).tolist() == [3]
    assert Threshold(0.25)(s, 8).nonzero().squeeze(1).tolist() == [0, 2, 3, 4]
    assert Threshold(5.0)(s, 8).nonzero().squeeze(1).tolist() == [2]  # min_keep=1: the best one
    assert Threshold(5.0, min_keep=0)(s, 8).sum() == 0
    w = Reweight(temperature=0.5)(s, 8)
    want = torch.softmax(s.double() / 0.5, 0) * 8
    assert torch.allclose(w.double(), want, rtol=1e-6)
    r = Reweight(kind="relu")(s, 8)
    assert torch.allclose(r.double(), s.double().clamp(min=0) * 8 / s.clamp(min=0).sum(), rtol=1e-6)
    assert torch.equal(Reweight(kind="relu")(-s.abs(), 8), torch.ones(8))
    assert Reweight(temperature=0.05, max_weight=2.0)(s, 8).max() == 2.0
    a, b = RandomFraction(0.25, seed=1)(None, 8), RandomFraction(0.25, seed=1)(None, 8)
    assert torch.equal(a, b) and a.sum() == 2
    with pytest.raises(ValueError):
        TopFraction(0.0)


def test_top_fraction_and_threshold_keep_exactly_the_expected_examples():
    model = _gpt2()
    seqs = _seqs(8, seed=4)
    want = _reference(model, [n for n, _ in _hooked(model)], seqs, "cosine")
    expected = sorted(torch.argsort(-want)[:3].tolist())  # round(0.375 * 8) = 3
    sel = OnlineSelector(model, TARGET, TopFraction(0.375), projection=SPEC)
    model.train()
    (out,) = list(SelectingLoader([_batch(seqs)], sel))
    exp = _batch([seqs[i] for i in expected])
    assert torch.equal(out["input_ids"][:, :exp["input_ids"].shape[1]], exp["input_ids"])
    assert torch.equal(out["labels"][:, :exp["labels"].shape[1]], exp["labels"])
    assert out["labels"].shape[0] == 3 and sel.stats["kept"] == 3 and sel.stats["examples"] == 8
    srt = want.sort().values
    thr = float(srt[4] + srt[5]) / 2  # between two scores: 3 kept
    sel = OnlineSelector(model, TARGET, Threshold(thr), projection=SPEC)
    (out,) = list(SelectingLoader([_batch(seqs)], sel))
    kept = [i for i in range(8) if want[i] >= thr]
    assert out["input_ids"].shape[0] == len(kept) == 3
    assert sel.last_weights.nonzero().squeeze(1).tolist() == kept
    # a batch with nothing kept is skipped by the loader
    sel = OnlineSelector(model, TARGET, Threshold(2.0, min_keep=0), projection=SPEC)
    with pytest.warns(UserWarning, match="kept no example"):
        assert list(SelectingLoader([_batch(seqs)], sel)) == [] and sel.step == 1


def _hooked(model):
    from gradindex.capture import select_layers

    return list(select_layers(model).items())


def _grads(model) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_reweighting_weights_each_examples_loss_in_the_loops_own_backward():
    model = _gpt2()
    seqs = _seqs(6, seed=5)
    batch = _batch(seqs)
    scores = _reference(model, [n for n, _ in _hooked(model)], seqs, "cosine")
    ntok = torch.tensor([len(s) - 1 for s in seqs], dtype=torch.float64)
    w = torch.softmax(scores / 0.2, 0) * len(seqs)
    w = w * ntok.sum() / (w * ntok).sum()  # Σ w n = Σ n
    # the independent gradient: Σ_i w_i L_i over the loop's token count (HF's mean loss, reweighted)
    model.zero_grad()
    model.train()
    loss, _ = per_example_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                               batch["labels"])
    ((w.float() * loss).sum() / ntok.sum().float()).backward()
    want = _grads(model)
    model.zero_grad()
    sel = OnlineSelector(model, TARGET, Reweight(temperature=0.2), projection=SPEC)
    for b in SelectingLoader([batch], sel):  # the user's step, unchanged
        out = model(**b)
        out.loss.backward()
    assert torch.allclose(sel.last_weights.double(), torch.softmax(scores / 0.2, 0) * 6, rtol=1e-4)
    assert abs(out.loss.item() - float(loss.detach().sum() / ntok.sum())) < 1e-5  # the logged loss is the plain one
    got = _grads(model)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-7), k
    key = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.allclose(got[key], _plain_grads(batch)[key], rtol=1e-2)  # and it is not the plain gradient


def _plain_grads(batch) -> dict[str, torch.Tensor]:
    model = _gpt2()
    model.train()
    model(**batch).loss.backward()
    return _grads(model)


def test_hook_mode_drops_by_zero_weight_as_the_loader_drops_by_subsetting():
    seqs = _seqs(8, seed=6)
    got = {}
    for mode in ("loader", "hook"):
        model = _gpt2()
        model.train()
        sel = OnlineSelector(model, TARGET, TopFraction(0.5), projection=SPEC)
        if mode == "loader":
            for b in SelectingLoader([_batch(seqs)], sel):
                model(**b).loss.backward()
        else:
            with sel:
                model(**_batch(seqs)).loss.backward()
        got[mode] = (_grads(model), sel.last_weights.clone())
    assert torch.equal(got["loader"][1], got["hook"][1])
    for k, g in got["loader"][0].items():
        assert torch.allclose(got["hook"][0][k], g, rtol=1e-4, atol=1e-7), k


def _train(model, batches, policy=None, mode="loader", refresh_every=0, steps_checked=None, **options):
    """A user's loop (AdamW, HF loss), with or without selection; returns the selector."""
    torch.manual_seed(123)  # dropout draws
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    sel = None
    loader = batches
    if policy is not None:
        sel = OnlineSelector(model, TARGET, policy, projection=SPEC, refresh_every=refresh_every, optimizer=opt,
                             **options)
        if mode == "loader":
            loader = SelectingLoader(batches, sel)
        else:
            sel.attach()
    for b in loader:
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad()
    if sel is not None:
        sel.close()
    return sel


@pytest.mark.parametrize("mode,policy", [("loader", KeepAll()), ("hook", TopFraction(1.0))])
def test_keep_all_leaves_training_bit_identical(mode, policy):
    batches = [_batch(_seqs(4, seed=20 + i)) for i in range(5)]
    plain, selected = _gpt2(dropout=0.1), _gpt2(dropout=0.1)
    _train(plain, batches)
    sel = _train(selected, batches, policy, mode, refresh_every=2, precondition="diagonal")
    for (k, a), b in zip(plain.state_dict().items(), selected.state_dict().values()):
        assert torch.equal(a, b), k
    assert sel.stats["batches"] == 5 and sel.stats["kept"] == 20
    assert sel.stats["refreshes"] == 3 and sel.step == 5  # refreshed at steps 0, 2 and 4
    assert sel.last_scores is not None and torch.isfinite(sel.last_scores).all()
    # dropout was on: a run with another seed differs, so the equality above is not vacuous
    other = _gpt2(dropout=0.1)
    torch.manual_seed(5)
    opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other.train()
    other(**batches[0]).loss.backward()
    opt.step()
    assert not torch.equal(other.transformer.h[0].mlp.c_fc.weight, plain.transformer.h[0].mlp.c_fc.weight)


def test_refresh_follows_the_parameters_and_random_needs_no_scoring():
    batches = [_batch(_seqs(4, seed=30 + i)) for i in range(4)]
    model = _gpt2()
    sel = _train(model, batches, TopFraction(0.5), refresh_every=0)
    first = {n: t.clone() for n, t in sel.target.items()}
    assert sel.stats["refreshes"] == 1
    sel.refresh()
    assert any(not torch.allclose(first[n], sel.target[n]) for n in first)  # trained: the target gradient moved
    sel = _train(_gpt2(), batches, RandomFraction(0.5, seed=3))
    assert sel.target is None and sel.stats["scoring_s"] == 0.0 and sel.stats["kept"] == 8


def test_batches_without_labels_use_the_input_ids_and_bad_inputs_are_named():
    model = _gpt2()
    seqs = _seqs(4, seed=8)
    b = _batch(seqs)
    sel = OnlineSelector(model, TARGET, KeepAll(), projection=SPEC, score="dot")
    with_labels, _ = sel.score(b)
    without, _ = sel.score({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})
    assert torch.equal(with_labels, without)
    with pytest.raises(ValueError, match="input_ids"):
        sel.score({"x": b["input_ids"]})
    with pytest.raises(TypeError, match="mappings"):
        list(SelectingLoader([(b["input_ids"], b["labels"])], sel))
    with pytest.raises(ValueError, match="score"):
        OnlineSelector(model, TARGET, KeepAll(), score="l2")
    with pytest.raises(ValueError, match="no target token"):
        OnlineSelector(model, [[1]], KeepAll(), projection=SPEC).refresh()


def test_trainer_callback_selects_and_keep_all_is_bit_identical(tmp_path):
    pytest.importorskip("accelerate")
    import datasets
    from transformers import Trainer, TrainingArguments

    from gradindex.integrations import SelectionCallback

    seqs = _seqs(16, seed=9)
    ds = datasets.Dataset.from_dict({"input_ids": seqs})

    def collator(examples):
        return _batch([e["input_ids"] for e in examples])

    finals, cbs = [], []
    for policy in (None, KeepAll(), TopFraction(0.5)):
        model = _gpt2(dropout=0.1)
        cb = [SelectionCallback(TARGET, policy, projection=SPEC, refresh_every=1)] if policy is not None else []
        args = TrainingArguments(str(tmp_path / str(len(finals))), per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, learning_rate=1e-2, num_train_epochs=1, report_to=[],
                                 use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
        Trainer(model, args, train_dataset=ds, data_collator=collator, callbacks=cb).train()
        finals.append(model.state_dict())
        cbs.append(cb)
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k
    keep_all, half = cbs[1][0].selector, cbs[2][0].selector
    assert keep_all.stats["batches"] == 4 and keep_all.stats["refreshes"] == 2  # steps 0 and 1 (2 steps of 2)
    assert half.stats["kept"] == 8 and half.stats["examples"] == 16
    assert not torch.equal(finals[0]["transformer.h.0.mlp.c_fc.weight"], finals[2]["transformer.h.0.mlp.c_fc.weight"])


def test_selection_refuses_what_would_train_on_nothing_or_fail_deep_in_torch(tmp_path):
    """A text target and another vocabulary's ids failed inside torch ("too many dimensions 'str'", an embedding
    index error); min_keep < 0 and max_weight 0 were accepted and trained on nothing; online selection on a model
    under a live capture failed with a shape error inside the capture's visitors."""
    from gradindex.integrations import GradIndexCapture

    model = _gpt2()
    with pytest.raises(ValueError, match=r"the target is text: .*target_from_texts"):
        OnlineSelector(model, ["red home dog", "blue sky"], KeepAll(), projection=SPEC)
    with pytest.raises(ValueError, match=r"target token ids \[70000\] are outside the model's vocabulary of 64"):
        OnlineSelector(model, [[5, 70000, 12]], KeepAll(), projection=SPEC)
    with pytest.raises(ValueError, match="min_keep must be a whole number >= 0"):
        Threshold(2.0, min_keep=-3)
    with pytest.raises(ValueError, match="min_keep must be a whole number >= 0"):
        TopFraction(0.5, min_keep=-1)
    with pytest.raises(ValueError, match="max_weight must be positive"):
        Reweight(max_weight=0.0)
    sel = OnlineSelector(model, TARGET, TopFraction(0.5), projection=SPEC)
    seqs = _seqs(4, seed=3)
    with GradIndexCapture(model, tmp_path / "cap", projection="4", num_rows=4) as cap:
        cap.batch(range(4))
        with pytest.raises(ValueError, match="do not combine GradIndexCapture / GradIndexCallback with online"):
            sel.weigh(_batch(seqs))
        model(**_batch(seqs)).loss.backward()
    sel.weigh(_batch(seqs))  # (the capture done: selection scores again)


@pytest.mark.parametrize("mode", ["loader", "hook"])
def test_a_policy_that_keeps_nothing_warns_once_and_one_that_keeps_some_does_not(mode, recwarn):
    """A threshold above every score with min_keep=0 trained on nothing, silently."""
    batches = [_batch(_seqs(4, seed=40 + i)) for i in range(3)]
    with pytest.warns(UserWarning, match=r"kept no example of the 3 batch\(es\) it saw.*min_keep >= 1"):
        sel = _train(_gpt2(), batches, Threshold(1e9, min_keep=0), mode)
    assert sel.stats["kept"] == 0
    sel.close()  # (warned once: not again)
    assert not [w for w in recwarn if "kept no example" in str(w.message)][1:]
    recwarn.clear()
    sel = _train(_gpt2(), batches, Threshold(1e9, min_keep=1), mode)
    assert sel.stats["kept"] == 3 and not [w for w in recwarn if "kept no example" in str(w.message)]
