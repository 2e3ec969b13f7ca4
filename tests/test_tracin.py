"""TracIn-CP over 3 checkpoints (`gradindex trajectory`, `query --method tracin`) equals a brute-force sum."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch.func import functional_call, grad

from gradindex.capture.batch import per_example_loss
from gradindex.capture.hooks import select_layers
from gradindex.cli import main
from gradindex.model import load_causal_lm
from tests.conftest import make_texts

LRS = [1e-3, 2e-3, 5e-4]
QUERY = "the cat sat on a mat near the river"


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    from fixtures.tiny import save_model_dir, tiny_gpt2, train_lm

    d = tmp_path_factory.mktemp("tracin")
    texts = make_texts(12, seed=11, max_words=12)
    (d / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    model = tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=32, n_head=4)
    seqs = [tokenizer(t)["input_ids"] for t in texts]
    dirs = []
    for step in (5, 10, 15):
        train_lm(model, seqs, steps=5, batch_size=4, lr=3e-3, pad_id=tokenizer.pad_token_id, seed=step)
        dirs.append(save_model_dir(model, tokenizer, d / f"checkpoint-{step}"))
    return d, texts, dirs


def _brute_force(model_dir, texts: list[str], query: str) -> np.ndarray:
    """``⟨g_q, g_t⟩`` over every hooked layer's weight and bias, from torch.func per-example gradients."""
    model, tok = load_causal_lm(model_dir, device="cpu")
    names = [f"{n}.{w}" for n in select_layers(model) for w in ("weight", "bias")]
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_fn(p, x):
        logits = functional_call(model, {**params, **p}, (x.unsqueeze(0),)).logits
        return per_example_loss(logits, x.unsqueeze(0))[0].sum()

    def g(text):
        x = torch.tensor(tok(text)["input_ids"])
        out = grad(loss_fn)({n: params[n] for n in names}, x)
        return torch.cat([out[n].reshape(-1) for n in names]).double()

    q = g(query)
    return np.array([float(q @ g(t)) for t in texts])


def test_tracin_query_equals_the_lr_weighted_sum_over_checkpoints(run):
    d, texts, dirs = run
    args = ["trajectory", str(d / "train.jsonl"), "--out", str(d / "traj"), "--projection", "none",
            "--storage", "fp32", "--device", "cpu", "--quiet"]
    for c, lr in zip(dirs, LRS, strict=True):
        args += ["--checkpoint", str(c), "--lr", str(lr)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "at steps 5 (lr 0.001), 10 (lr 0.002), 15 (lr 0.0005)" in res.output
    res = CliRunner().invoke(main, ["query", str(d / "traj"), "--text", QUERY, "--method", "tracin", "-k",
                                    str(len(texts)), "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    hits = json.loads(res.output.splitlines()[0])
    got = np.zeros(len(texts))
    for h in hits:
        got[h["id"]] = h["score"]
    ref = sum(lr * _brute_force(c, texts, QUERY) for c, lr in zip(dirs, LRS, strict=True))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
    assert [h["id"] for h in hits] == list(np.argsort(-ref, kind="stable"))
    res = CliRunner().invoke(main, ["query", str(d / "traj"), "--text", QUERY, "--method", "graddot"])
    assert res.exit_code == 2 and "--method tracin" in res.output


def test_bad_checkpoint_lists_are_refused(run):
    d, _, dirs = run
    base = ["trajectory", str(d / "train.jsonl"), "--out", str(d / "bad"), "--quiet", "--device", "cpu"]
    res = CliRunner().invoke(main, [*base, "--checkpoint", str(dirs[1]), "--checkpoint", str(dirs[0]),
                                    "--lr", "1e-3"])
    assert res.exit_code == 2 and "not in training order (steps [10, 5])" in res.output, res.output
    res = CliRunner().invoke(main, [*base, "--checkpoint", str(dirs[0]), "--checkpoint", str(dirs[1])])
    assert res.exit_code == 2 and "has no learning rate" in res.output and "--lr" in res.output, res.output
    res = CliRunner().invoke(main, [*base, *sum((["--checkpoint", str(c)] for c in dirs), []), "--lr", "1",
                                    "--lr", "2"])
    assert res.exit_code == 2 and "3 checkpoints and 2 learning rates" in res.output
    assert not (d / "bad").exists()


def test_tracin_needs_no_faiss_indices(run):
    """TracIn sums exact scores from the stores: the trajectory builds no FAISS files and ranks by them."""

    from gradindex.apps.tracin import TracInEngine

    d, texts, dirs = run
    out = d / "traj-exact"
    args = ["trajectory", str(d / "train.jsonl"), "--out", str(out), "--projection", "4", "--device", "cpu", "--quiet"]
    for c, lr in zip(dirs, LRS, strict=True):
        args += ["--checkpoint", str(c), "--lr", str(lr)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert len(list(out.glob("ckpt-*"))) == 3 and not any((c / "faiss").exists() for c in out.glob("ckpt-*"))
    with TracInEngine(out, device="cpu") as e:
        got = e.query_batch([QUERY], k=4, lowest=2)[0]
        scores = e.scores([QUERY])[0]
    order = np.lexsort((np.arange(len(texts)), -scores))
    assert [h.id for h in got.hits] == order[:4].tolist() and [h.id for h in got.lowest] == order[::-1][:2].tolist()
    assert [h.text for h in got.hits] == [texts[i] for i in order[:4]]


def test_trajectory_bad_outputs_and_checkpoints_are_refused(run, tokenizer, default_index):
    """An --out holding an index was taken (its queries then opened the trajectory), checkpoints of another width
    were summed as one run, and the text output of a tracin query ended in a TypeError traceback."""
    from fixtures.tiny import save_model_dir, tiny_gpt2
    from tests.conftest import refused

    d, _, dirs = run
    before = sorted(p.name for p in default_index.iterdir())
    base = ["trajectory", str(d / "train.jsonl"), "--quiet", "--device", "cpu", "--lr", "1e-3"]
    res = CliRunner().invoke(main, [*base, "--out", str(default_index), "--checkpoint", str(dirs[0])])
    refused(res.exit_code, res.output, None, "holds other files than a trajectory index", "another --out")
    assert sorted(p.name for p in default_index.iterdir()) == before
    wide = save_model_dir(tiny_gpt2(vocab_size=len(tokenizer), n_layer=2, n_embd=48, n_head=4), tokenizer,
                          d / "checkpoint-20")
    res = CliRunner().invoke(main, [*base, "--out", str(d / "wide"), "--checkpoint", str(dirs[0]),
                                    "--checkpoint", str(wide)])
    refused(res.exit_code, res.output, None, "checkpoint-20' is not the model of", "layers differ")
    assert not (d / "wide" / "trajectory.json").exists()
    res = CliRunner().invoke(main, [*base, "--out", str(d / "wide"), "--checkpoint", str(dirs[0]),
                                    "--checkpoint", str(dirs[1])])  # (resumes the first checkpoint's index)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["query", str(d / "wide"), "--text", QUERY, "-k", "2", "--device", "cpu"])
    assert res.exit_code == 0 and "method tracin" in res.output and "rank" in res.output, res.output


@pytest.mark.parametrize(("name", "step"), [("checkpoint-500", 500), ("step_20", 20), ("global_step300", 300),
                                            ("ckpt-7", 7), ("llama-3", None), ("run-v2", None), ("model", None)])
def test_a_checkpoint_step_is_read_only_from_a_name_that_states_one(tmp_path, name, step):
    from gradindex.apps.tracin import checkpoint_step

    d = tmp_path / name
    d.mkdir()
    assert checkpoint_step(d) == step
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 42}))
    assert checkpoint_step(d) == 42  # the Trainer's own record wins over the name


def test_folders_ending_in_version_numbers_are_not_read_as_out_of_order_steps(tmp_path):
    from gradindex.apps.tracin import checkpoints

    models = [tmp_path / "model-v2", tmp_path / "model-final-1"]
    for m in models:
        m.mkdir()
    assert [c.step for c in checkpoints([str(m) for m in models], [1e-3])] == [None, None]


def test_trajectory_overwrite_rebuilds_and_a_failed_first_run_leaves_no_folder(run):
    """A changed setting's refusal named --overwrite, which trajectory lacked; a layer glob matching nothing left an
    empty --out behind; the same checkpoint twice was summed twice."""
    from tests.conftest import refused

    d, _, dirs = run
    out = d / "over"
    base = ["trajectory", str(d / "train.jsonl"), "--out", str(out), "--quiet", "--device", "cpu", "--lr", "1e-3"]
    two = ["--checkpoint", str(dirs[0]), "--checkpoint", str(dirs[1])]
    res = CliRunner().invoke(main, [*base, *two, "--layers", "zzz*"])
    assert res.exit_code == 2 and not out.exists(), res.output
    res = CliRunner().invoke(main, [*base, "--checkpoint", str(dirs[0]), "--checkpoint", str(dirs[0])])
    refused(res.exit_code, res.output, None, "is given more than once")
    assert not out.exists()
    assert CliRunner().invoke(main, [*base, *two]).exit_code == 0
    res = CliRunner().invoke(main, [*base, *two, "--max-length", "24"])
    refused(res.exit_code, res.output, None, "--overwrite")
    res = CliRunner().invoke(main, [*base, "--checkpoint", str(dirs[2]), "--max-length", "24", "--overwrite"])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "trajectory.json").read_text())
    assert [c["step"] for c in meta["checkpoints"]] == [15] and sorted(p.name for p in out.glob("ckpt-*")) == \
        ["ckpt-00"]
    res = CliRunner().invoke(main, ["query", str(out), "--text", QUERY, "-k", "2", "--device", "cpu"])
    assert res.exit_code == 0 and "method tracin" in res.output, res.output
    for cmd in ("info", "verify"):  # (they said "not a gradindex index ... build one")
        res = CliRunner().invoke(main, [cmd, str(out)])
        refused(res.exit_code, res.output, None, "is a trajectory (TracIn) index", "--method tracin", "ckpt-00")
