"""Recipe: LoRA SFT of a chat model with TRL, the influence index captured during training, then a chat query,
its token explanation and an audit report (``pip install 'gradindex[trl,peft]'``).

    python builders/trl_lora_chat.py --out my-index                          # a tiny demo, made in place
    python builders/trl_lora_chat.py --model BASE --data chats.jsonl --out my-index

``--data`` holds TRL's conversational records (``{"messages": [{"role", "content"}, ...]}``). They are
tokenized by gradindex with the tokenizer's chat template, loss on the assistant turns (the labels TRL's
``assistant_only_loss`` gives), and handed to ``SFTTrainer`` pre-tokenized, so training, the index and
later queries see the same tokens. ``SFTTrainer(peft_config=...)`` wraps the model in a ``PeftModel``;
``GradIndexCallback`` hooks its ``lora_A``/``lora_B`` layers. After training the adapter is saved (its
folder is the index's model: its config names the base), EK-FAC is fitted on the captured rows, and the
query is answered. Without ``--model``/``--data`` a tiny Qwen2-architecture chat model is made from a
config and a chat file with planted facts is written beside ``--out``; the query asks one of the facts
in other words, and the recipe prints the rank of the conversation that taught it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import datasets

ROOT = Path(__file__).resolve().parents[1]
FACTS = [("zorbia", "quillstone"), ("mervale", "tintaport"), ("oskarn", "bellhaven"), ("pentor", "yarrowmede")]
FILLER = ["the cat sat on a mat", "a dog ran far from home", "the sun rose over green hills",
          "some fish swam in the river", "bread is baked at noon", "the old town is quiet"]


def demo_chats(n_filler: int = 48) -> list[dict]:
    """Chat records: one per planted fact (a capital), and filler conversations."""
    out = [{"messages": [{"role": "user", "content": f"what is the capital of {c}"},
                         {"role": "assistant", "content": f"the capital of {c} is {t}"}]} for c, t in FACTS]
    for i in range(n_filler):
        a, b = FILLER[i % len(FILLER)], FILLER[(i * 5 + 1) % len(FILLER)]
        out.append({"messages": [{"role": "user", "content": f"tell me something {i}"},
                                 {"role": "assistant", "content": f"{a} and {b}"}]})
    return out


def demo_query(fact: int = 0) -> dict:
    """A planted fact asked in other words, in chat form."""
    c, t = FACTS[fact]
    return {"messages": [{"role": "user", "content": f"name the capital city of {c}"},
                         {"role": "assistant", "content": f"{c} has {t} as its capital"}]}


def make_demo(where: Path) -> tuple[Path, Path]:
    """A tiny Qwen2 chat model (from a config, ChatML template with generation markers) and a chat file."""
    sys.path.insert(0, str(ROOT))
    from fixtures.tiny import chat_tokenizer, save_model_dir, tiny_qwen2

    where.mkdir(parents=True, exist_ok=True)
    chats = demo_chats()
    data = where / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats))
    texts = [m["content"] for r in chats + [demo_query(i) for i in range(len(FACTS))] for m in r["messages"]]
    tok = chat_tokenizer(texts, vocab_size=400)
    base = save_model_dir(tiny_qwen2(vocab_size=len(tok), hidden=64, n_layer=2, intermediate=128), tok, where / "base")
    return base, data


def train(args, base: Path, data: Path, adapter_out: Path) -> dict:
    """LoRA SFT with TRL, capturing the index with GradIndexCallback; returns the index's manifest."""
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from gradindex.data import load_records, tokenize_records
    from gradindex.integrations import GradIndexCallback, keep_rows, with_row_ids
    from gradindex.model import load_causal_lm

    model, tok = load_causal_lm(base, device=args.device, chat_template=args.chat_template)
    toks = tokenize_records(load_records(data), tok, args.max_length)
    train_set = with_row_ids(datasets.Dataset.from_dict({"input_ids": list(toks.input_ids),
                                                         "labels": list(toks.labels)}))
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    callback = GradIndexCallback(args.out, projection=args.projection, max_length=args.max_length,
                                 model_id=str(adapter_out.resolve()), data_id=str(data.resolve()),
                                 text_field=toks.field)
    cfg = SFTConfig(output_dir=str(adapter_out), per_device_train_batch_size=args.batch_size,
                    learning_rate=args.lr, num_train_epochs=args.epochs, seed=args.seed, report_to=[],
                    save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=args.device == "cpu",
                    max_length=args.max_length, packing=False, remove_unused_columns=False)
    collator = keep_rows(DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id))
    trainer = SFTTrainer(model, args=cfg, train_dataset=train_set, processing_class=tok, data_collator=collator,
                         peft_config=lora, callbacks=[callback])
    trainer.train()
    trainer.save_model(str(adapter_out))  # the adapter: its config names the base model
    tok.save_pretrained(str(adapter_out))
    return callback.manifest


def answer(args, query: dict) -> dict:
    """EK-FAC on the captured rows, then the query, the top result's token explanation and an audit report."""
    from gradindex.apps.explain import Explainer
    from gradindex.apps.report import ReportConfig, build_report
    from gradindex.index import build_indices
    from gradindex.precondition import FitConfig, fit_preconditioner
    from gradindex.query import QueryEngine

    fit_preconditioner(args.out, FitConfig(method="ekfac", device=args.device), progress=False)
    build_indices(args.out, progress=False)
    with QueryEngine(args.out, device=args.device) as engine:
        res = engine.query(query, k=5, method="ekfac")
        top = res.hits[0]
        expl = Explainer(engine).explain(query, [top.id], "ekfac")[0]
        summary = build_report(engine, [query], args.out.rstrip("/") + "-audit", ReportConfig(k=5, dedup=False))
    return {"hits": [(h.id, h.score, h.text) for h in res.hits], "explanation": expl, "audit": summary}


def planted_ranks(index_dir: str, device: str) -> dict[str, list[int | None]]:
    """Per method, the rank of each planted fact's conversation (row i) for its reworded query (None: past 10)."""
    from gradindex.query import QueryEngine

    out: dict[str, list[int | None]] = {}
    with QueryEngine(index_dir, device=device) as engine:
        for method in ("ekfac", "graddot"):
            ids = [[h.id for h in r.hits] for r in engine.query_batch([demo_query(i) for i in range(len(FACTS))],
                                                                     k=10, method=method)]
            out[method] = [row.index(i) + 1 if i in row else None for i, row in enumerate(ids)]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", required=True, help="Index directory to write.")
    p.add_argument("--model", default=None, help="Base model directory (default: a tiny demo chat model).")
    p.add_argument("--data", default=None, help="Chat .jsonl with 'messages' (default: the demo's planted facts).")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file, when the tokenizer has none.")
    p.add_argument("--query", default=None, help="A chat query as JSON turns (default: the demo's first fact).")
    p.add_argument("--projection", default="none", help="K, KAxKG or none (LoRA gradients are small).")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank.")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    work = Path(args.out.rstrip("/") + "-work")
    base, data = (Path(args.model), Path(args.data)) if args.model and args.data else make_demo(work)
    manifest = train(args, base, data, work / "adapter")
    query = {"messages": json.loads(args.query)} if args.query else demo_query(0)
    out = answer(args, query)
    print(f"captured {manifest['counts']['examples']} chats over {manifest['training']['steps']} steps into "
          f"{args.out} ({len(manifest['build']['layers'])} LoRA layers); adapter in {work / 'adapter'}")
    print("query:", " | ".join(f"[{m['role']}] {m['content']}" for m in query["messages"]))
    for rank, (i, score, text) in enumerate(out["hits"], start=1):
        print(f"  {rank}. row {i}  {score:.4g}  {' '.join(str(text).split())[:100]}")
    e = out["explanation"]
    best = sorted(range(len(e.train.scores)), key=lambda t: -abs(e.train.scores[t]))[:3]
    print("top result's largest token terms:", ", ".join(repr(e.train.tokens[t]) for t in best))
    print(f"audit report: {args.out.rstrip('/')}-audit/report.html")
    if not (args.model and args.data):
        ranks = planted_ranks(args.out, args.device)
        print(f"planted facts (rows 0-{len(FACTS) - 1}) asked in other words, their ranks: "
              + "; ".join(f"{m} {r}" for m, r in ranks.items()))
        print(json.dumps({"planted_ranks": ranks}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
