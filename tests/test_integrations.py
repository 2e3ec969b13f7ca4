"""In-loop capture (plain loop and HF Trainer) against the offline build and torch.func gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradindex.capture import ProjectionSpec
from gradindex.data import collate, records_from_texts, tokenize_records
from gradindex.integrations import ROW_KEY, GradIndexCapture, with_row_ids
from gradindex.store import Store
from gradindex.store.builder import BuildConfig, build_store
from tests.conftest import make_texts

N = 32


@pytest.fixture(scope="module")
def data(tokenizer):
    return tokenize_records(records_from_texts(make_texts(N, seed=3, max_words=20)), tokenizer, 64)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def _offline(model_dir, tokenizer, data, out, projection="8"):
    model = _model(model_dir).eval()
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse(projection), shard_size=16, batch_size=8)
    build_store(model, tokenizer, data, out, cfg, progress=False)
    return out


def _rows(index_dir) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    with Store(index_dir) as s:
        ids, blocks = zip(*s.iter_blocks())
        return np.concatenate(ids), {n: np.concatenate([b[n] for b in blocks]) for n in s.layers}


def assert_rows_close(a: dict, b: dict, rtol: float) -> None:
    assert a.keys() == b.keys()
    for n in a:
        err = np.linalg.norm(a[n] - b[n], axis=1) / np.maximum(np.linalg.norm(b[n], axis=1), 1e-30)
        assert err.max() < rtol, (n, float(err.max()))


def plain_loop(model, data, pad_id, cap=None, steps_per_epoch=None, lr=0.0, accum=2, micro=4, epochs=1,
               seed=0, autocast=False, on_step=None):
    """A user's loop: shuffled micro-batches, HF mean loss / accum, AdamW. Returns the losses."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if cap is not None:
        cap = cap(opt)
    losses = []
    ctx = cap if cap is not None else _Null()
    with ctx:
        model.train()
        for epoch in range(epochs):
            if cap is not None:
                cap.epoch = epoch
            order = torch.randperm(len(data), generator=g).tolist()
            for k in range(0, len(order), micro):
                idx = order[k:k + micro]
                b = collate([data.input_ids[i] for i in idx], [data.labels[i] for i in idx], pad_id)
                if cap is not None:
                    b[ROW_KEY] = torch.tensor(idx)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(**b).loss / accum
                loss.backward()
                losses.append(loss.item())
                if (k // micro + 1) % accum == 0:
                    if on_step is not None:
                        on_step(model)
                    opt.step()
                    opt.zero_grad()
    return losses


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


def test_plain_loop_lr0_accumulation_equals_offline_build(tmp_path, gpt2_dir, tokenizer, data):
    off = _offline(gpt2_dir, tokenizer, data, tmp_path / "off")
    model = _model(gpt2_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    holder = {}

    def cap(opt):
        holder["c"] = GradIndexCapture(model, tmp_path / "live", optimizer=opt, projection="8", shard_size=16,
                                       record_loss=True, num_rows=N)
        return holder["c"]

    plain_loop(model, data, tokenizer.pad_token_id, cap=cap)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    ids_l, live = _rows(tmp_path / "live")
    ids_o, ref = _rows(off)
    assert (ids_l == np.arange(N)).all() and (ids_o == ids_l).all()
    assert_rows_close(live, ref, 1e-4)
    m = holder["c"].manifest
    from gradindex.spec.manifest import read_manifest

    mo = read_manifest(off)
    assert m["build"]["data_fingerprint"] == mo["build"]["data_fingerprint"]
    assert m["build"]["model_fingerprint"] == mo["build"]["model_fingerprint"]
    assert m["training"]["steps"] == N // 8 and m["training"]["unseen_ids"] == []
    with Store(tmp_path / "live") as s, Store(off) as so:
        np.testing.assert_allclose(s.column("loss"), so.column("loss"), rtol=1e-4)
        assert (s.column("num_tokens") == so.column("num_tokens")).all()
        steps = s.column("training/step")
        assert sorted(np.bincount(steps).tolist()) == [8] * (N // 8)  # 8 rows (2 micro-batches) per step
        # the mean over the micro-batch's target tokens, divided by the accumulation steps
        scale = s.column("training/loss_scale")
        assert np.all(scale > 0) and np.all(scale < 1 / 2 / 4 + 1e-9)


def _trainer(model, tokenizer, data, out, lr, callbacks=(), rows=True, accum=2, epochs=1, **kw):
    pytest.importorskip("accelerate")
    import datasets
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    ds = datasets.Dataset.from_dict({"input_ids": data.input_ids})
    if rows:
        ds = with_row_ids(ds)
    args = TrainingArguments(str(out), per_device_train_batch_size=4, gradient_accumulation_steps=accum,
                             learning_rate=lr, num_train_epochs=epochs, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
                             remove_unused_columns=not rows, **kw)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return Trainer(model, args, train_dataset=ds, data_collator=collator, callbacks=list(callbacks))


def test_trainer_callback_lr0_equals_offline_build_and_cli_works(tmp_path, gpt2_dir, tokenizer, data):
    from gradindex.integrations import GradIndexCallback

    off = _offline(gpt2_dir, tokenizer, data, tmp_path / "off")
    model = _model(gpt2_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    jsonl = tmp_path / "train.jsonl"
    records_from_texts(make_texts(N, seed=3, max_words=20)).to_json(jsonl)
    cb = GradIndexCallback(tmp_path / "live", projection="8", shard_size=16, model_id=str(gpt2_dir),
                           data_id=str(jsonl))
    _trainer(model, tokenizer, data, tmp_path / "tr", lr=0.0, callbacks=[cb]).train()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    ids, live = _rows(tmp_path / "live")
    _, ref = _rows(off)
    assert (ids == np.arange(N)).all()
    assert_rows_close(live, ref, 1e-4)
    m = cb.manifest
    assert m["training"]["steps"] == N // 8 and not m["training"]["unseen_ids"]
    with Store(tmp_path / "live") as s:
        assert (s.column("training/times_seen") == 1).all()
        # Trainer: the loss is divided by num_items_in_batch, one count over both micro-batches of a step
        # (this transformers counts the unshifted labels, one more per row, when the config names no loss_type:
        # the measured scale follows whatever the Trainer does)
        ntok, steps, scale = s.column("num_tokens"), s.column("training/step"), s.column("training/loss_scale")
        for st in np.unique(steps):
            count = 1 / scale[steps == st]
            assert np.allclose(count, np.round(count[0]), rtol=1e-6)
            assert ntok[steps == st].sum() <= round(count[0]) <= ntok[steps == st].sum() + (steps == st).sum()
    # the later stages run on it
    from click.testing import CliRunner

    from gradindex.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["precondition", str(tmp_path / "live"), "--method", "kfac", "--quiet"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["index", str(tmp_path / "live"), "--cpu-index"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["query", str(tmp_path / "live"), "--text", "the cat sat on a mat", "-k", "3",
                             "--method", "kfac", "--json"])
    assert r.exit_code == 0, r.output


def test_trainer_parameters_bit_identical_with_and_without_callback(tmp_path, gpt2_dir, tokenizer, data):
    from gradindex.integrations import GradIndexCallback

    finals = []
    for with_cb in (False, True):
        model = _model(gpt2_dir)
        cbs = [GradIndexCallback(tmp_path / "live", projection="8", shard_size=16,
                                 save_optimizer_state=[2])] if with_cb else []
        _trainer(model, tokenizer, data, tmp_path / f"tr{with_cb}", lr=1e-2, callbacks=cbs, rows=with_cb).train()
        finals.append(model.state_dict())
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k
    from safetensors.torch import load_file

    st = load_file(tmp_path / "live" / "optimizer" / "step-0000002.safetensors")
    assert "transformer.h.0.attn.c_attn.weight.exp_avg_sq" in st and len(st) == len(list(model.parameters()))


def test_trainer_without_row_column_names_the_fix(tmp_path, gpt2_dir, tokenizer, data):
    from gradindex.integrations import GradIndexCallback

    cb = GradIndexCallback(tmp_path / "live")
    t = _trainer(_model(gpt2_dir), tokenizer, data, tmp_path / "tr", lr=0.0, callbacks=[cb], rows=False)
    with pytest.raises(ValueError, match="gradindex_row"):
        t.train()


def _func_grads(model, layer_names, ids, labels):
    """Per-example ``G`` ``[N_o, N_i+1]`` of the summed token loss, from torch.func at the model's parameters."""
    from torch.func import functional_call, grad

    from gradindex.capture import layer_info
    from gradindex.data import per_example_loss

    mods = dict(model.named_modules())
    params = {k: v.detach() for k, v in model.named_parameters()}
    keys = [k for n in layer_names for k in (f"{n}.weight", f"{n}.bias")]

    def loss_fn(p, x, y):
        out = functional_call(model, {**params, **p}, (x,), {"use_cache": False})
        return per_example_loss(out.logits, y)[0].sum()

    x, y = torch.tensor([ids]), torch.tensor([labels])
    g = grad(loss_fn)({k: params[k] for k in keys}, x, y)
    return {n: layer_info(mods[n]).weight_grad_to_G(g[f"{n}.weight"], g[f"{n}.bias"]).reshape(-1).numpy()
            for n in layer_names}


def test_plain_loop_real_lr_rows_equal_torch_func_gradients_at_each_step(tmp_path, gpt2_dir, tokenizer, data):
    model = _model(gpt2_dir)
    snapshots = []  # parameters in force during each step's micro-batches
    plain_loop(model, data, tokenizer.pad_token_id, lr=3e-2, epochs=2,
               cap=lambda opt: GradIndexCapture(model, tmp_path / "live", optimizer=opt, projection="none",
                                                keep_log=True, num_rows=N),
               on_step=lambda m: snapshots.append({k: v.clone() for k, v in m.state_dict().items()}))
    assert len(snapshots) == 2 * N // 8
    from gradindex.integrations.capture_log import log_parts, read_columns

    ids, live = _rows(tmp_path / "live")
    with Store(tmp_path / "live") as s:
        steps, lr, epoch = s.column("training/step"), s.column("training/lr"), s.column("training/epoch")
        assert (s.column("training/times_seen") == 2).all()
    assert (epoch == 1).all() and (steps >= N // 8).all() and np.allclose(lr, 3e-2)  # keep="last": epoch 2
    (part,) = log_parts(tmp_path / "live")
    assert len(read_columns(part)["ids"]) == 2 * N  # the log keeps both epochs
    ref = _model(gpt2_dir).eval()
    names = list(live)
    for i in range(0, N, 5):
        ref.load_state_dict(snapshots[int(steps[i])])
        want = _func_grads(ref, names, data.input_ids[i], data.labels[i])
        for n in names:
            err = np.linalg.norm(live[n][i] - want[n]) / np.linalg.norm(want[n])
            assert err < 1e-4, (i, n, err)
    # the parameters moved between steps, so the check above is not the lr-0 one again
    assert not torch.equal(snapshots[0]["transformer.h.0.attn.c_attn.weight"],
                           snapshots[-1]["transformer.h.0.attn.c_attn.weight"])


@pytest.mark.parametrize("arch,checkpointing", [("llama", None), ("gpt2", True), ("gpt2", False)])
def test_llama_and_gradient_checkpointing_equal_offline_build(tmp_path, request, tokenizer, data, arch,
                                                              checkpointing):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    off = _offline(model_dir, tokenizer, data, tmp_path / "off")
    model = _model(model_dir)
    if checkpointing is not None:  # hooks also fire on the recomputed forward: rows must not double
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    plain_loop(model, data, tokenizer.pad_token_id,
               cap=lambda opt: GradIndexCapture(model, tmp_path / "live", optimizer=opt, projection="8",
                                                shard_size=16))
    _, live = _rows(tmp_path / "live")
    _, ref = _rows(off)
    assert_rows_close(live, ref, 1e-4)


def test_bf16_autocast_rows_match_offline_build_to_bf16_precision(tmp_path, gpt2_dir, tokenizer, data):
    off = _offline(gpt2_dir, tokenizer, data, tmp_path / "off")
    model = _model(gpt2_dir)
    plain_loop(model, data, tokenizer.pad_token_id, autocast=True,
               cap=lambda opt: GradIndexCapture(model, tmp_path / "live", optimizer=opt, projection="8",
                                                shard_size=16))
    _, live = _rows(tmp_path / "live")
    _, ref = _rows(off)
    assert_rows_close(live, ref, 5e-2)  # bf16 activations and output gradients: ~1e-2 per row
    for n in live:  # the scale is undone: no systematic factor left
        ratio = np.linalg.norm(live[n], axis=1) / np.linalg.norm(ref[n], axis=1)
        assert abs(np.median(ratio) - 1) < 1e-2


def test_bad_input_errors(tmp_path, gpt2_dir, tokenizer, data):
    model = _model(gpt2_dir).train()
    b = collate(data.input_ids[:4], data.labels[:4], tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="gradindex_row"), GradIndexCapture(model, tmp_path / "a"):
        model(**b).loss.backward()
    with pytest.raises(ValueError, match="4 examples"), GradIndexCapture(model, tmp_path / "b") as cap:
        cap.batch([0, 1])
        model(**b)
    with pytest.raises(ValueError, match="per-example weights"), GradIndexCapture(model, tmp_path / "c") as cap:
        cap.batch(range(4))
        logits = model(**b).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), b["labels"][:, 1:], reduction="none")
        (loss.sum(1) * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
        cap.live.flush()
    with torch.no_grad():  # peaky predictions: at uniform ones label smoothing is a pure rescaling
        model.transformer.wte.weight.mul_(30)
    with pytest.raises(ValueError, match="label smoothing"), GradIndexCapture(model, tmp_path / "c2") as cap:
        cap.batch(range(4))
        logits = model(**b).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), b["labels"][:, 1:],
                                          label_smoothing=0.1).backward()
        cap.live.flush()
    model.transformer.h[0].requires_grad_(False)
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"), GradIndexCapture(model, tmp_path / "d") as cap:
        cap.batch(range(4))
        model(**b).loss.backward()
        cap.live.flush()
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        GradIndexCapture(model, tmp_path / "f")
    with pytest.raises(FileExistsError, match="refusing"):
        GradIndexCapture(model, tmp_path / "f", overwrite=True)
    assert (tmp_path / "f" / "notes.txt").exists()
    with pytest.raises(TypeError, match="unknown capture option"):
        GradIndexCapture(model, tmp_path / "e", projektion="8")


def test_keep_rows_carries_ids_past_a_collator_and_refuses_packing():
    from gradindex.integrations import keep_rows

    def plain(examples):  # drops every column it does not know, as TRL's collator does
        return {"input_ids": torch.tensor([e["input_ids"] for e in examples])}

    def packing(examples):
        return {"input_ids": torch.tensor([sum((e["input_ids"] for e in examples), [])])}

    ex = [{"input_ids": [1, 2], ROW_KEY: 7}, {"input_ids": [3, 4], ROW_KEY: 2}]
    assert keep_rows(plain)(ex)[ROW_KEY].tolist() == [7, 2]
    with pytest.raises(ValueError, match="packing"):
        keep_rows(packing)(ex)
    with pytest.raises(ValueError, match="gradindex_row"):
        keep_rows(plain)([{"input_ids": [1, 2]}])


@pytest.mark.parametrize("same_length", [True, False])
def test_two_forwards_summed_into_one_backward_are_refused(tmp_path, gpt2_dir, tokenizer, data, same_length):
    """Micro-batch losses summed before one backward: the first forward's rows were added to the second's (stored as
    good, off by up to 140% where the batches padded alike) or refused as a mixture-of-experts layer."""
    from gradindex.capture.hooks import TWO_FORWARDS

    model = _model(gpt2_dir).train()
    pad = tokenizer.pad_token_id
    a = collate(data.input_ids[:4], data.labels[:4], pad)
    b = collate(data.input_ids[4:8], data.labels[4:8], pad)
    if same_length:  # (padded to one length: the rows used to come out wrong without an error)
        L = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
        a, b = ({k: torch.nn.functional.pad(v, (0, L - v.shape[1]), value={"input_ids": pad, "labels": -100,
                                                                           "attention_mask": 0}[k])
                 for k, v in x.items()} for x in (a, b))
    with pytest.raises(RuntimeError, match="two forwards, one backward"), \
            GradIndexCapture(model, tmp_path / "two", projection="8", num_rows=8) as cap:
        cap.batch(range(4))
        first = model(**a).loss
        cap.batch(range(4, 8))
        second = model(**b).loss
        (first + second).backward()
    assert "one backward per forward" in TWO_FORWARDS


def test_a_capture_is_entered_once(tmp_path, gpt2_dir, tokenizer, data):
    """A second `with` on the same capture lost its rows, left two hooks on the model (later plain training failed
    for want of row ids) and emptied the manifest."""
    model = _model(gpt2_dir).train()
    b = collate(data.input_ids[:4], data.labels[:4], tokenizer.pad_token_id)
    cap = GradIndexCapture(model, tmp_path / "once", projection="8", num_rows=4)
    with cap:
        cap.batch(range(4))
        model(**b).loss.backward()
    assert cap.manifest["counts"]["examples"] == 4
    with pytest.raises(RuntimeError, match="a capture is entered once"), cap:
        pass
    assert cap.manifest["counts"]["examples"] == 4
    model(**b).loss.backward()  # (no hook left behind: plain training needs no row ids)
    with pytest.raises(RuntimeError, match=r"cap.batch\(\) was called after the capture's `with` block"):
        cap.batch(range(4))


def test_a_capture_never_entered_is_named_not_silent(tmp_path, gpt2_dir, tokenizer, data):
    """A capture made but never entered with `with` hooked nothing: the loop trained and nothing was captured."""
    import gc

    model = _model(gpt2_dir).train()
    b = collate(data.input_ids[:4], data.labels[:4], tokenizer.pad_token_id)
    cap = GradIndexCapture(model, tmp_path / "never", projection="8", num_rows=4)
    with pytest.raises(RuntimeError, match=r"cap.batch\(\) was called before the capture's `with` block"):
        cap.batch(range(4))
    model(**b).loss.backward()
    with pytest.warns(UserWarning, match=r"'.*never' was never entered, so it captured nothing"):
        del cap
        gc.collect()
    with GradIndexCapture(model, tmp_path / "entered", projection="8", num_rows=4) as cap:  # (entered: no warning)
        cap.batch(range(4))
        model(**b).loss.backward()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del cap
        gc.collect()


def test_the_trainer_callback_refuses_a_resume_and_out_of_range_ids_before_training(tmp_path, gpt2_dir, tokenizer,
                                                                                     data):
    """A run resumed from a checkpoint (with overwrite=True) stored 16 of 40 rows as zeros with a log line; ids of a
    shuffled-then-selected data set were refused only after the whole run had trained."""
    from types import SimpleNamespace

    import datasets
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from gradindex.integrations import GradIndexCallback

    pytest.importorskip("accelerate")
    model = _model(gpt2_dir)
    cb = GradIndexCallback(tmp_path / "resumed")
    args = SimpleNamespace(remove_unused_columns=False, output_dir=str(tmp_path / "tr"))
    with pytest.raises(ValueError, match="resumes from a checkpoint at step 2: a live capture records whole runs"):
        cb.on_train_begin(args, SimpleNamespace(global_step=2, epoch=0.5), None, model=model, optimizer=None)
    smoothed = SimpleNamespace(**vars(args), label_smoothing_factor=0.1)  # (it said: pass labels to the model)
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0\.1\): a label-smoothed loss"):
        cb.on_train_begin(smoothed, SimpleNamespace(global_step=0, epoch=0.0), None, model=model, optimizer=None)
    ds = with_row_ids(datasets.Dataset.from_dict({"input_ids": data.input_ids})).shuffle(seed=1).select(range(16))
    before = [p.detach().clone() for p in model.parameters()]
    targs = TrainingArguments(str(tmp_path / "tr"), per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
                              use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                              remove_unused_columns=False)
    t = Trainer(model, targs, train_dataset=ds, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                callbacks=[GradIndexCallback(tmp_path / "sel")])
    with pytest.raises(ValueError, match=r"'gradindex_row' ids run \d+\.\.\d+, outside a data set of 16 rows"):
        t.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # (refused before a step)


def test_row_ids_are_whole_numbers_and_wait_past_an_eval_forward(tmp_path, gpt2_dir, tokenizer, data):
    """Float ids were truncated (1.7 stored as 1), string ids failed inside numpy; a no-grad forward between
    capture.batch() and the training forward used the ids up ("carries no row ids ... call capture.batch")."""
    model = _model(gpt2_dir).train()
    b = collate(data.input_ids[:4], data.labels[:4], tokenizer.pad_token_id)
    for bad in (torch.tensor([0.0, 1.7, 2.2, 3.9]), ["ex-0", "ex-1", "ex-2", "ex-3"]):
        with pytest.raises(ValueError, match="row ids must be whole numbers"), \
                GradIndexCapture(model, tmp_path / "bad", projection="8", num_rows=4):
            model(**b, **{ROW_KEY: bad}).loss.backward()
    with GradIndexCapture(model, tmp_path / "eval", projection="8", num_rows=4) as cap:
        cap.batch([3, 2, 1, 0])
        with torch.no_grad():
            model(**b)  # (an eval forward: not the training one)
        model(**b).loss.backward()
    ids, rows = _rows(tmp_path / "eval")
    assert ids.tolist() == [0, 1, 2, 3] and all(np.abs(v).sum(1).min() > 0 for v in rows.values())


def test_a_negative_row_id_is_named_as_such(tmp_path, gpt2_dir, tokenizer, data):
    """Its error said to pass num_rows=, which does not mend a negative id."""
    model = _model(gpt2_dir).train()
    b = collate(data.input_ids[:4], data.labels[:4], tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="include -1: row ids are the examples' 0-based positions"), \
            GradIndexCapture(model, tmp_path / "neg", projection="8", num_rows=4) as cap:
        cap.batch([-1, 0, 1, 2])
        model(**b).loss.backward()


def test_the_last_epoch_is_kept_whatever_order_the_ranks_logs_are_read_in():
    """Under DDP without optimizer= every row's step is 0 and the ranks' logs are read rank by rank: `keep="last"`
    kept a row's epoch-0 occurrence whenever a lower rank logged it (13 of 37 rows in a 2-rank trial)."""
    from gradindex.integrations.assemble import _choose

    ids = np.array([0, 1, 1, 0])  # rank 0 logged id 0 in epoch 1 and id 1 in epoch 0; rank 1 the reverse
    epoch = np.array([1.0, 0.0, 1.0, 0.0])
    step, part, local = np.zeros(4, np.int64), np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])
    assert epoch[_choose(ids, epoch, step, part, local, "last")].tolist() == [1.0, 1.0]
    assert epoch[_choose(ids, epoch, step, part, local, "first")].tolist() == [0.0, 0.0]
    step = np.array([7, 1, 9, 3])  # (a loop that set its epochs from 0 again: the steps still order it)
    epoch = np.array([0.0, 1.0, 0.0, 1.0])
    assert step[_choose(ids, epoch, step, part, local, "last")].tolist() == [7, 9]


def test_one_capture_a_model_one_writer_a_folder_and_a_killed_capture_named(tmp_path, gpt2_dir, tokenizer, data):
    """A second capture on a captured model blamed the batch for its missing row ids; two runs into one out_dir
    both reported success with the second's rows; a folder a killed capture left was "not a gradindex index"."""
    import subprocess
    import sys

    from gradindex.lock import IndexBusyError
    from gradindex.spec.manifest import no_manifest

    model = _model(gpt2_dir).train()
    with GradIndexCapture(model, tmp_path / "a", projection="8", num_rows=4) as cap:
        with pytest.raises(RuntimeError, match="already under another live capture"), \
                GradIndexCapture(model, tmp_path / "b", projection="8", num_rows=4):
            pass
        cap.batch(range(4))
        model(**collate(data.input_ids[:4], data.labels[:4], tokenizer.pad_token_id)).loss.backward()
    assert cap.manifest["counts"]["examples"] == 4
    out = tmp_path / "shared"
    code = (f"import sys, time, torch; from transformers import AutoModelForCausalLM; "
            f"from gradindex.integrations import GradIndexCapture; "
            f"m = AutoModelForCausalLM.from_pretrained({str(gpt2_dir)!r}); "
            f"c = GradIndexCapture(m, {str(out)!r}, projection='8', num_rows=4); c.__enter__(); "
            f"print('ready', flush=True); time.sleep(120)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        with pytest.raises(IndexBusyError, match=r"being written by another process \(pid \d+: live capture\)"):
            GradIndexCapture(_model(gpt2_dir), out, projection="8", num_rows=4, overwrite=True)
    finally:
        other.kill()
        other.wait()
    assert "holds an unfinished live capture" in no_manifest(out) and "overwrite=True" in no_manifest(out)
    from click.testing import CliRunner

    from gradindex.cli import main

    for cmd in (["info", str(out)], ["verify", str(out)], ["query", str(out), "--text", "a"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code != 0 and "holds an unfinished live capture" in r.output, (cmd, r.output)
    with GradIndexCapture(_model(gpt2_dir), out, projection="8", num_rows=4, overwrite=True):
        with pytest.raises(IndexBusyError, match="being written by this process already"):
            GradIndexCapture(_model(gpt2_dir), out, projection="8", num_rows=4, overwrite=True)
    with pytest.raises(ValueError, match="typo"):  # (a capture refused while being made leaves the folder as it was)
        GradIndexCapture(model, tmp_path / "new", projection="8", layers=["typo*"])
    assert not (tmp_path / "new").exists()
    with GradIndexCapture(model, tmp_path / "new", projection="8", num_rows=4):
        pass


def test_a_run_that_raised_leaves_a_capture_that_end_capture_ends(tmp_path, gpt2_dir, tokenizer, data):
    """A Trainer run that raises never reaches on_train_end: its hooks stayed on the model, and a retry was refused
    with nothing to end them by."""
    from gradindex.integrations import end_capture

    model = _model(gpt2_dir).train()
    cap = GradIndexCapture(model, tmp_path / "a", projection="8", num_rows=4)
    cap.__enter__()  # (the run raised: no __exit__)
    with pytest.raises(RuntimeError, match=r"end_capture\(model\) ends it"):
        GradIndexCapture(model, tmp_path / "b", projection="8", num_rows=4)
    assert not (tmp_path / "b").exists()  # (refused before its folder was touched)
    assert end_capture(model) and not end_capture(model)
    with GradIndexCapture(model, tmp_path / "a", projection="8", num_rows=4, overwrite=True) as again:
        again.batch(range(4))
        model(**collate(data.input_ids[:4], data.labels[:4], tokenizer.pad_token_id)).loss.backward()
    assert again.manifest["counts"]["examples"] == 4


def test_a_script_that_captured_exits_quietly(tmp_path, gpt2_dir):
    """A finished capture's object released its lock again at interpreter exit, printing a traceback."""
    import subprocess
    import sys

    code = (f"import torch; from transformers import AutoModelForCausalLM; "
            f"from gradindex.integrations import GradIndexCapture; "
            f"m = AutoModelForCausalLM.from_pretrained({str(gpt2_dir)!r}).train()\n"
            f"with GradIndexCapture(m, {str(tmp_path / 'x')!r}, projection='8', num_rows=2) as cap:\n"
            f"    cap.batch([0, 1]); m(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), "
            f"labels=torch.tensor([[1, 2, 3], [4, 5, 6]])).loss.backward()\n"
            f"never = GradIndexCapture(m, {str(tmp_path / 'y')!r}, projection='8')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_trl_chats_trained_on_every_token_are_refused_before_training(tmp_path):
    """TRL trains chats on every token by default; the index's chats take the loss on the assistant turns, so
    every row differed from its conversation's gradient by 270-460% (at lr 0), silently."""
    trl = pytest.importorskip("trl")
    import types

    import datasets
    from transformers import TrainerControl, TrainerState

    from gradindex.integrations import GradIndexCallback

    chats = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}], ROW_KEY: 0}])
    cb = GradIndexCallback(tmp_path / "idx", text_field="messages", chat_template="{{ x }}")
    args = trl.SFTConfig(str(tmp_path / "run"), assistant_only_loss=False, report_to=[], use_cpu=True,
                         remove_unused_columns=False)
    with pytest.raises(ValueError, match=r"assistant_only_loss=False\) trains each chat on every token"):
        cb.on_train_begin(args, TrainerState(), TrainerControl(), model=None,
                          train_dataloader=types.SimpleNamespace(dataset=chats))
    assert not (tmp_path / "idx").exists()


def test_tokens_that_differ_name_the_loop_for_a_live_capture():
    from gradindex.spec.manifest import tokens_differ

    assert "TRL appends an end-of-sequence token" in tokens_differ({"training": {"source": "in-loop capture"}})
    assert tokens_differ({}).startswith("the file changed since the build")


def _trained(tmp_path, name: str, gpt2_dir, tokenizer, ds, collator, jsonl, **options):
    """One epoch of the HF Trainer at learning rate 0 over ``ds`` with a live capture into ``tmp_path / name``
    (``data_id`` the file ``jsonl``); the callback."""
    from transformers import Trainer, TrainingArguments

    from gradindex.integrations import GradIndexCallback

    cb = GradIndexCallback(tmp_path / name, projection="8", shard_size=16, model_id=str(gpt2_dir), data_id=str(jsonl),
                           max_length=64, **options)
    args = TrainingArguments(str(tmp_path / "tr"), per_device_train_batch_size=8, learning_rate=0.0,
                             num_train_epochs=1, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    Trainer(_model(gpt2_dir), args, train_dataset=ds, processing_class=tokenizer, callbacks=[cb],
            data_collator=collator).train()
    return cb


def test_a_trainer_that_dropped_the_last_examples_is_named_and_num_rows_keeps_them(tmp_path, gpt2_dir, tokenizer,
                                                                                    data):
    """TRL drops examples left with no loss token: where it dropped the last ones, the ids stayed in range and the
    index silently held fewer rows than its data file. The end of the run now says so, and num_rows= keeps them."""
    pytest.importorskip("accelerate")
    import datasets

    from gradindex.spec.manifest import read_manifest

    def collator(examples):
        b = collate([e["input_ids"] for e in examples], [e["labels"] for e in examples], tokenizer.pad_token_id)
        return b | {ROW_KEY: torch.tensor([e[ROW_KEY] for e in examples])}

    jsonl = tmp_path / "train.jsonl"
    records_from_texts(make_texts(N, seed=3, max_words=20)).to_json(jsonl)
    ds = with_row_ids(datasets.Dataset.from_dict({"input_ids": data.input_ids, "labels": data.labels})).select(
        range(N - 2))  # (the trainer's set: the file's last 2 examples dropped)
    notes, manifests = [], []
    for rows in (None, N):
        cb = _trained(tmp_path, f"live{rows}", gpt2_dir, tokenizer, ds, collator, jsonl, num_rows=rows)
        notes.append(cb.tokens_note)
        manifests.append(read_manifest(tmp_path / f"live{rows}"))
    assert notes[0] is not None and f"the index holds {N - 2} rows and" in notes[0], notes[0]
    assert f"pass num_rows={N}" in notes[0] and "other tokens" not in notes[0], notes[0]
    assert manifests[0]["counts"]["examples"] == N - 2
    assert notes[1] is None, notes[1]
    assert manifests[1]["counts"]["examples"] == N and manifests[1]["training"]["unseen_ids"] == [N - 2, N - 1]


def test_a_trainer_that_appends_an_end_of_sequence_token_is_named_at_the_end(tmp_path, gpt2_dir, tokenizer, data):
    """TRL appends an end-of-sequence token to text: the index then did not match its data file, and only later
    commands said so, blaming the file ("changed since the build")."""
    pytest.importorskip("accelerate")
    import datasets


    def collator(examples):  # (the appended token carries loss, as TRL's does)
        b = collate([e["input_ids"] for e in examples], [e["input_ids"] for e in examples], tokenizer.pad_token_id)
        return b | {ROW_KEY: torch.tensor([e[ROW_KEY] for e in examples])}

    jsonl = tmp_path / "train.jsonl"
    records_from_texts(make_texts(N, seed=3, max_words=20)).to_json(jsonl)
    notes = []
    for eos in (False, True):
        ids = [list(x) + [tokenizer.eos_token_id] * eos for x in data.input_ids]
        ds = with_row_ids(datasets.Dataset.from_dict({"input_ids": ids}))
        notes.append(_trained(tmp_path, f"live{eos}", gpt2_dir, tokenizer, ds, collator, jsonl).tokens_note)
    assert notes[0] is None, notes[0]
    assert notes[1] is not None and f"{N} of {N} examples checked were trained as other tokens" in notes[1]
    assert "an end-of-sequence token appended, as TRL does" in notes[1] and "tokenize_records" in notes[1]
