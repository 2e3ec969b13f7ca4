"""PEFT/LoRA adapters: per-example lora_A/lora_B gradients equal torch.func's, `build BASE --adapter DIR`
end to end, a changed adapter refused like a changed model, an adapter that does not fit refused."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'gradindex[peft]' or '[dev]')")

from fixtures.tiny import save_model_dir, tiny_qwen2  # noqa: E402
from gradindex.adapter import adapter_layers  # noqa: E402
from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace  # noqa: E402
from gradindex.capture.batch import batch_gradients  # noqa: E402
from gradindex.cli import main  # noqa: E402
from gradindex.data import per_example_loss  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def make_adapter(base_dir, out_dir, rank: int = 4, seed: int = 1, hidden: int = 32):
    """A LoRA adapter of the model in ``base_dir`` with random (trained-looking) A and B, saved to ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def lora(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lora")
    base_dir = save_model_dir(tiny_qwen2(vocab_size=len(tokenizer)), tokenizer, root / "base")
    return base_dir, make_adapter(base_dir, root / "adapter")


def test_per_example_adapter_gradients_equal_torch_func(lora):
    base_dir, adapter_dir = lora
    model, _ = load_causal_lm(base_dir, device="cpu", adapter=adapter_dir)
    seqs = [[5, 9, 12, 40, 7, 3, 22], [8, 1, 30], [14, 2, 2, 9, 60]]
    with GradientCapture(model, None, ProjectedRows(RowSpace(ProjectionSpec(kind="none", k_a=0, k_g=0)))) as cap:
        assert sorted(cap.modules) == sorted(adapter_layers(dict(model.named_modules())))
        assert len(cap.modules) == 2 * len(TARGETS) * 2  # A and B of every target, 2 blocks
        rows = batch_gradients(model, cap, seqs, seqs, pad_id=0).grads
    params = {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}

    def loss_of(lora_params, ids):
        x = torch.tensor([ids])
        out = torch.func.functional_call(model, {**dict(model.named_parameters()), **lora_params},
                                         kwargs={"input_ids": x, "use_cache": False})
        return per_example_loss(out.logits, x)[0].sum()

    worst = 0.0
    for b, ids in enumerate(seqs):
        ref = torch.func.grad(loss_of)(params, ids)
        for name in cap.modules:
            want = ref[name + ".weight"].reshape(-1)
            got = rows[name][b]
            worst = max(worst, float((got - want).norm() / want.norm()))
    assert worst <= 1e-5, worst


def _build(base_dir, data, out, *extra):
    return CliRunner().invoke(main, ["build", str(base_dir), str(data), "--out", str(out), "--projection", "none",
                                     "--device", "cpu", "--quiet", "--precondition", "none", *map(str, extra)])


def test_build_with_an_adapter_and_a_changed_adapter_refused(lora, text_jsonl, tmp_path):
    from gradindex.query import QueryEngine

    base_dir, _ = lora
    adapter_dir = make_adapter(base_dir, tmp_path / "adapter")
    out = tmp_path / "index"
    r = _build(base_dir, text_jsonl, out, "--adapter", adapter_dir)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["adapter_id"] == str(adapter_dir.resolve()) and m["build"]["adapter_fingerprint"]
    assert m["build"]["layers"] and all(".lora_" in n for n in m["build"]["layers"])
    with QueryEngine(out, device="cpu") as engine:
        assert len(engine.query("the cat sat on a mat", k=3, method="graddot").hits) == 3
    make_adapter(base_dir, adapter_dir, seed=2)  # the adapter changes after the build
    with pytest.raises(ValueError, match=r"adapter \(--adapter\) differs"):
        QueryEngine(out, device="cpu")
    make_adapter(base_dir, adapter_dir, seed=1)
    # the adapter folder alone is a model too (its config names the base)
    r = _build(adapter_dir, text_jsonl, tmp_path / "alone", "--batch-size", 3)
    assert r.exit_code == 0, r.output
    m2 = json.loads((tmp_path / "alone" / "manifest.json").read_text())
    assert m2["build"]["adapter_fingerprint"] == m["build"]["adapter_fingerprint"]
    assert m2["build"]["model_fingerprint"] == m["build"]["model_fingerprint"]


def test_an_adapter_that_does_not_fit_the_base_is_one_line(lora, tokenizer, text_jsonl, tmp_path):
    base_dir, _ = lora
    other = save_model_dir(tiny_qwen2(vocab_size=len(tokenizer), hidden=48, n_head=4, intermediate=64),
                           tokenizer, tmp_path / "other")
    wrong = make_adapter(other, tmp_path / "wrong")
    r = _build(base_dir, text_jsonl, tmp_path / "x", "--adapter", wrong)
    assert r.exit_code != 0
    err = r.output.strip().splitlines()[-1]
    assert "does not fit this base model" in err and "base model it was trained from" in err
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_a_peft_models_adam_state_is_read_for_the_adapter_build(lora, tmp_path):
    """A LoRA training loop saves its second moments under the ``PeftModel``'s names (``base_model.model.``...);
    ``build BASE --adapter DIR --optimizer-state`` loads the injected model (no wrapper) and reads them alike."""
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from gradindex.capture.adam import load_second_moments

    base_dir, adapter_dir = lora
    wrapped = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir))
    lora_names = [n for n, _ in wrapped.named_parameters() if ".lora_" in n]
    assert lora_names and all(n.startswith("base_model.model.") for n in lora_names)
    state = {f"{n}.exp_avg_sq": torch.full(p.shape, float(i + 1)) for i, (n, p) in
             enumerate((n, p) for n, p in wrapped.named_parameters() if ".lora_" in n)}
    save_file(state, str(tmp_path / "adam.safetensors"))
    model, _ = load_causal_lm(base_dir, device="cpu", adapter=adapter_dir)
    moments = load_second_moments(tmp_path / "adam.safetensors", model)
    assert sorted(moments.v) == sorted(n.removeprefix("base_model.model.") for n in lora_names)
    assert all(float(moments.v[n.removeprefix("base_model.model.")][0, 0]) == i + 1 for i, n in enumerate(lora_names))
    save_file({"base_model.model.no.such.weight.exp_avg_sq": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="this model does not have"):  # a name of neither form is still refused
        load_second_moments(tmp_path / "other.safetensors", model)


def test_an_adapter_naming_its_base_by_a_relative_path_is_found_from_any_folder(lora, text_jsonl, tmp_path,
                                                                                  monkeypatch):
    """PEFT records the base as the training script gave it ("base"): an index built as `build ADAPTER_DIR` from the
    folder holding both was refused by queries run from another folder ("not on this machine")."""
    import json
    import shutil

    from click.testing import CliRunner

    from gradindex.cli import main

    base_dir, adapter = lora
    run = tmp_path / "run"
    shutil.copytree(base_dir, run / "base")
    shutil.copytree(adapter, run / "adapter")
    cfg = run / "adapter" / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "base_model_name_or_path": "base"}))
    monkeypatch.chdir(run)
    res = CliRunner().invoke(main, ["build", "adapter", str(text_jsonl), "--out", str(tmp_path / "idx"),
                                    "--max-length", "32", "--device", "cpu", "--quiet"])
    assert res.exit_code == 0, res.output
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    res = CliRunner().invoke(main, ["query", str(tmp_path / "idx"), "--text", "the cat sat", "-k", "2",
                                    "--device", "cpu"])
    assert res.exit_code == 0 and "most influential" in res.output, res.output


def test_a_misfit_adapter_whose_base_is_gone_names_the_mismatch(lora, tokenizer, text_jsonl, tmp_path):
    """Its named base not on this machine, PEFT's error is what is left; it said only torch's header line "Error(s)
    in loading state_dict for PeftModel:", the mismatch cut off."""
    import shutil

    base_dir, _ = lora
    other = save_model_dir(tiny_qwen2(vocab_size=len(tokenizer), hidden=48, n_head=4, intermediate=64),
                           tokenizer, tmp_path / "other")
    wrong = make_adapter(other, tmp_path / "wrong")
    shutil.rmtree(other)
    r = _build(base_dir, text_jsonl, tmp_path / "x", "--adapter", wrong)
    err = r.output.strip().splitlines()[-1]
    assert r.exit_code != 0 and "does not fit this base model" in err and "size mismatch for" in err, r.output
