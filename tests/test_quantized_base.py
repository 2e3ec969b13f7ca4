"""A quantized base under a LoRA adapter (``--base-quantization int8|nf4``, bitsandbytes; issue 31 item 3).

The capture's lora_A/lora_B rows under a bitsandbytes-quantized base equal an independent per-example loop of
``loss.backward()`` on the same quantized model; ``gradindex build --base-quantization`` runs end to end and its
graddot scores equal that loop's gradient dot products; the quantization is recorded, reloaded by the query and
refused when another is given; hooking a quantized layer, quantizing without an adapter, and a missing
bitsandbytes are each refused in one line, nothing written."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("peft", reason="peft is not installed (pip install 'gradindex[peft]' or '[dev]')")

from test_adapter import TARGETS, make_adapter  # noqa: E402

from gradindex.cli import main  # noqa: E402
from gradindex.data import per_example_loss  # noqa: E402

HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAVE_BNB, reason="bitsandbytes is not installed (pip install 'gradindex[quantize]' "
                                                     "or '[dev]'): the quantized-base tests need it")
QUANTS = ["int8", "nf4"]


@pytest.fixture(scope="module")
def lora(tmp_path_factory, tokenizer):
    from fixtures.tiny import save_model_dir, tiny_qwen2

    root = tmp_path_factory.mktemp("qlora")
    base = save_model_dir(tiny_qwen2(vocab_size=len(tokenizer)), tokenizer, root / "base")
    return base, make_adapter(base, root / "adapter")


def _load(lora, quant):
    """The tiny base loaded ``quant`` under its adapter; the test is skipped, saying why, where bitsandbytes'
    backend cannot run here."""
    from gradindex.model import load_causal_lm

    base, adapter = lora
    try:
        return load_causal_lm(base, device="cpu", adapter=adapter, base_quantization=quant)
    except (RuntimeError, NotImplementedError) as e:  # a bitsandbytes without a backend for this CPU
        pytest.skip(f"bitsandbytes cannot run {quant} here: {type(e).__name__}: {str(e)[:160]}")


def _lora_params(model) -> dict[str, torch.nn.Parameter]:
    return {n.removesuffix(".weight"): p for n, p in model.named_parameters() if ".lora_" in n}


def loop_gradients(model, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per-example gradients ``{lora layer: [B, n_out * n_in]}``, one ``backward()`` per example (no hooks)."""
    params = _lora_params(model)
    out: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    for p in params.values():
        p.requires_grad_(True)
    try:
        for ids in seqs:
            x = torch.tensor([ids])
            for p in params.values():
                p.grad = None
            per_example_loss(model(input_ids=x, use_cache=False).logits, x)[0].sum().backward()
            for n, p in params.items():
                out[n].append(p.grad.detach().reshape(-1).clone())
    finally:
        for p in params.values():
            p.requires_grad_(False)
            p.grad = None
    return {n: torch.stack(v) for n, v in out.items()}


@needs_bnb
@pytest.mark.parametrize("quant", QUANTS)
def test_lora_rows_under_a_quantized_base_equal_a_backward_loop(lora, quant):
    from gradindex.adapter import adapter_layers
    from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace
    from gradindex.capture.batch import batch_gradients
    from gradindex.quantize import base_quantization, quantized_kind

    model, _ = _load(lora, quant)
    assert base_quantization(model) == quant
    q_proj = model.model.layers[0].self_attn.q_proj  # PEFT's bitsandbytes LoRA wrapper around the quantized linear
    assert quantized_kind(q_proj.base_layer.weight) == quant and type(q_proj).__module__.endswith(".bnb")
    seqs = [[5, 9, 12, 40, 7, 3, 22], [8, 1, 30], [14, 2, 2, 9, 60]]
    with GradientCapture(model, None, ProjectedRows(RowSpace(ProjectionSpec(kind="none", k_a=0, k_g=0)))) as cap:
        assert sorted(cap.modules) == sorted(adapter_layers(dict(model.named_modules())))
        assert len(cap.modules) == 2 * len(TARGETS) * 2  # A and B of every target, 2 blocks
        rows = batch_gradients(model, cap, seqs, seqs, pad_id=0).grads
    want = loop_gradients(model, seqs)
    worst = max(float((rows[n][b] - want[n][b]).norm() / want[n][b].norm()) for n in cap.modules
                for b in range(len(seqs)))
    assert worst <= 1e-4, worst


def _build(base, data, out, *extra):
    return CliRunner().invoke(main, ["build", str(base), str(data), "--out", str(out), "--projection", "none",
                                     "--device", "cpu", "--quiet", "--precondition", "none", "--storage", "fp32",
                                     "--max-length", "32", *map(str, extra)])


@needs_bnb
@pytest.mark.parametrize("quant", QUANTS)
def test_build_with_a_quantized_base_end_to_end_and_its_scores_equal_the_loop(lora, text_jsonl, tmp_path, quant):
    from gradindex.data import load_records, tokenize_records
    from gradindex.errors import IndexMismatchError
    from gradindex.model import load_causal_lm
    from gradindex.quantize import quantized_kind
    from gradindex.query import QueryEngine
    from gradindex.spec.manifest import build_command

    base, adapter = lora
    model, tok = _load(lora, quant)
    out = tmp_path / "index"  # (batches of 8: an example's row must not depend on the others in its batch)
    r = _build(base, text_jsonl, out, "--adapter", adapter, "--base-quantization", quant, "--batch-size", 8)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["build"]["base_quantization"] == quant and m["build"]["adapter_fingerprint"]
    assert m["build"]["layers"] and all(".lora_" in n for n in m["build"]["layers"])
    assert f"--base-quantization {quant}" in build_command(out, m)
    r = CliRunner().invoke(main, ["query", str(out), "--text", "the cat sat", "-k", "3", "--method", "graddot",
                                  "--device", "cpu"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["plan", str(base), str(text_jsonl), "--adapter", str(adapter), "--device", "cpu",
                                  "--base-quantization", quant, "--max-length", "32", "--batches", "1"])
    assert r.exit_code == 0, r.output

    train = tokenize_records(load_records(text_jsonl), tok, 32).input_ids
    query = "the cat sat on a mat"
    qids = tok(query)["input_ids"]
    G, Gq = loop_gradients(model, train), loop_gradients(model, [qids])
    want = sum(Gq[n].double() @ G[n].double().T for n in G)[0]
    with QueryEngine(out, device="cpu") as engine:  # reloads the base quantized, as the index records
        got = torch.from_numpy(engine.scores([query], method="graddot")[0])
        assert quantized_kind(engine.model.model.layers[0].self_attn.k_proj.weight) == quant
    assert float((got - want).norm() / want.norm()) <= 1e-3
    assert int(got.argmax()) == int(want.argmax())

    # a model whose base is loaded otherwise is refused, the quantization named (not "the model differs")
    for other in (None, *(q for q in QUANTS if q != quant)):
        m2, t2 = load_causal_lm(base, device="cpu", adapter=adapter, base_quantization=other)
        with pytest.raises(IndexMismatchError, match=r"base quantization \(--base-quantization\) differs") as e:
            QueryEngine(out, model=m2, tokenizer=t2, device="cpu")
        assert "model differs" not in str(e.value)


def _last_line(r) -> str:
    return r.output.strip().splitlines()[-1]


def test_a_quantized_base_without_an_adapter_is_one_line(lora, text_jsonl, tmp_path):
    base, _ = lora
    r = _build(base, text_jsonl, tmp_path / "x", "--base-quantization", "int8")
    assert r.exit_code != 0
    err = _last_line(r)
    assert "no weight gradient" in err and "--adapter DIR" in err and "leave --base-quantization out" in err
    assert not (tmp_path / "x" / "manifest.json").exists()


@needs_bnb
@pytest.mark.parametrize("quant", QUANTS)
def test_hooking_a_quantized_layer_is_one_line(lora, text_jsonl, tmp_path, quant):
    base, adapter = lora
    r = _build(base, text_jsonl, tmp_path / "x", "--adapter", adapter, "--base-quantization", quant,
               "--layers", "*k_proj")
    assert r.exit_code != 0
    err = _last_line(r)
    assert "quantized base layer" in err and "no gradient" in err and "leave --base-quantization out" in err
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_missing_bitsandbytes_names_the_extra(lora, monkeypatch):
    import sys

    from gradindex.quantize import check_base_quantization

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # (import fails as when it is not installed)
    with pytest.raises(ValueError, match=r"pip install 'gradindex\[quantize\]'"):
        check_base_quantization("nf4", lora[1])


def test_a_config_only_plan_refuses_a_quantized_base(tmp_path, text_jsonl):
    from fixtures.tiny import tiny_qwen2

    tiny_qwen2().config.save_pretrained(tmp_path / "cfg")
    r = CliRunner().invoke(main, ["plan", str(tmp_path / "cfg"), str(text_jsonl), "--base-quantization", "nf4",
                                  "--tokens-per-example", "16"])
    assert r.exit_code != 0 and "--base-quantization needs the base model's weights" in _last_line(r)


@needs_bnb
def test_qlora_training_loop_capture_is_queried_with_its_base_reloaded_quantized(tokenizer, text_jsonl, tmp_path):
    """QLoRA proper: LoRA trained on an nf4 base with the in-loop capture; the CLI query reloads the saved adapter onto
    the base quantized as the index records, and the model's fingerprint is the trained one's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fixtures.tiny import save_model_dir, tiny_qwen2
    from gradindex.data import collate, load_records, tokenize_records
    from gradindex.integrations import GradIndexCapture
    from gradindex.quantize import prepare, quantization_config

    base = save_model_dir(tiny_qwen2(vocab_size=len(tokenizer)), tokenizer, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization_config("nf4", torch.float32),
                                                 device_map={"": "cpu"})
    model = get_peft_model(prepare(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    data = tokenize_records(load_records(text_jsonl), tokenizer, 32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    out, adapter = tmp_path / "idx", tmp_path / "adapter"
    with GradIndexCapture(model, str(out), optimizer=opt, projection="none", num_rows=len(data), max_length=32,
                          model_id=str(adapter), data_id=str(text_jsonl)):
        for s in range(0, len(data), 8):
            rows = list(range(s, min(s + 8, len(data))))
            batch = collate([data.input_ids[i] for i in rows], [data.labels[i] for i in rows], tokenizer.pad_token_id)
            batch["gradindex_row"] = torch.tensor(rows)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    model.save_pretrained(adapter)
    m = json.loads((out / "manifest.json").read_text())
    assert m["build"]["base_quantization"] == "nf4" and all(".lora_" in n for n in m["build"]["layers"])
    r = CliRunner().invoke(main, ["index", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["query", str(out), "--text", "the cat sat", "-k", "3", "--method", "graddot",
                                  "--device", "cpu"])
    assert r.exit_code == 0, r.output


def test_a_base_quantized_otherwise_by_the_training_loop_is_refused_naming_what_to_do(default_index, tmp_path):
    """The in-loop capture records the training loop's quantization as it finds it: bitsandbytes' default 4-bit type
    is ``fp4``, which gradindex cannot load a base as. A query (which reloads the base as the index records) says
    so and what to do; it said ``--base-quantization 'fp4' is not one of ...``, an option the user never gave."""
    import shutil

    idx = tmp_path / "idx"
    shutil.copytree(default_index, idx)
    m = json.loads((idx / "manifest.json").read_text())
    m["build"]["base_quantization"] = "fp4"
    (idx / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["query", str(idx), "--text", "the cat sat", "-k", "3", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    err = _last_line(r)
    assert err.startswith("Error") and "quantized as 'fp4'" in err and "model=" in err, err
    assert "not one of" not in err, err
