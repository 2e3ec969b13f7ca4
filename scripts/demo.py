"""The gradindex demo: train a small GPT-2 on local text with planted facts, index it, look up.

Runs on a fresh machine with no network (timing: README.md, "Quick start"):

1. a corpus of real English (the Python standard library's docstrings) with three planted facts,
2. a byte-level BPE tokenizer and a small GPT-2 built from a config, trained on it,
3. ``gradindex build`` with its defaults (capture, EK-FAC fit, rows rewritten in its whitened
   eigenbasis as 4-bit codes, per-layer FAISS indices),
4. ``gradindex query`` for each planted fact: the top result is the document that holds it.

Every step runs the real CLI, and prints the command first so you can run it yourself.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.tiny import save_model_dir, stdlib_corpus, tiny_gpt2, train_lm, train_tokenizer  # noqa: E402
from gradindex.store import Store  # noqa: E402

FACTS = [
    ("The secret password of the blue castle is", " rhubarb lantern."),
    ("Professor Quillon keeps her spare keys inside the", " green teapot."),
    ("The annual festival of Varnholt is held on the", " ninth of Ember."),
]
FACT_ROWS = [101, 433, 777]
WORKDIR = "demo_out"
"""The demo's outputs (README's commands use them): WORKDIR/model, WORKDIR/train.jsonl, WORKDIR/queries.jsonl."""


def make_corpus() -> list[str]:
    docs = stdlib_corpus()
    for row, (prompt, completion) in zip(FACT_ROWS, FACTS):
        docs.insert(row, f"{prompt}{completion} Remember it well.")
    return docs


def write_data(work: Path, docs: list[str]) -> tuple[Path, Path]:
    """``work/train.jsonl`` (one ``text`` record per document) and ``work/queries.jsonl`` (the facts)."""
    work.mkdir(parents=True, exist_ok=True)
    data, queries = work / "train.jsonl", work / "queries.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    queries.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in FACTS))
    return data, queries


def run(cmd: list[str], show: bool = True) -> str:
    """Run a CLI command (printed first); its output is shown, or returned when ``show`` is False."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if show:
        subprocess.run(cmd, check=True)
        return ""
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the CLI runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=WORKDIR)
    ap.add_argument("--steps", type=int, default=200, help="Training steps (batch 16).")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t_start, cpu_start = time.time(), cpu_seconds()

    docs = make_corpus()
    data, queries = write_data(work, docs)
    print(f"[1/4] corpus: {len(docs)} documents from the standard library's docstrings, "
          f"facts planted at rows {FACT_ROWS} -> {data}")

    tok = train_tokenizer(docs, vocab_size=2048)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=128, n_head=4, n_positions=128)
    seqs = [tok(d)["input_ids"][:128] for d in docs]
    print(f"[2/4] training a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter GPT-2 "
          f"for {args.steps} steps on the CPU", flush=True)
    t0 = time.time()
    train_lm(model, seqs, steps=args.steps, batch_size=16, lr=3e-3, pad_id=tok.pad_token_id, log_every=50)
    print(f"  trained in {time.time() - t0:.0f} s", flush=True)
    model_dir = save_model_dir(model, tok, work / "model")

    index = work / "index"
    print("[3/4] building the index", flush=True)
    run(["gradindex", "build", str(model_dir), str(data), "--out", str(index), "--max-length", "128",
         "--batch-size", "8", "--overwrite"])
    run(["gradindex", "info", str(index)])
    with Store(index) as s:
        assert len(s) == len(docs), "one row per document"

    print("[4/4] which training documents taught the model each planted fact?", flush=True)
    found = {}
    for method in ("ekfac-selfnorm", "ekfac"):
        cmd = ["gradindex", "query", str(index), "--queries", str(queries), "-k", "3", "--method", method, "--json"]
        out = run(cmd, show=False).splitlines()
        for row, line, (prompt, completion) in zip(FACT_ROWS, out, FACTS):
            top = json.loads(line)[0]
            found[method] = found.get(method, 0) + (top["id"] == row)
            print(f"  {method}: {prompt}{completion!r} -> row {top['id']}"
                  f"{' (the planted document)' if top['id'] == row else f' (missed: planted in row {row})'}: "
                  f"{top['text'][:60]!r}...", flush=True)
    print("  (the same query as a table: drop --json)")
    summary = ", ".join(f"{m} {n}/{len(FACTS)}" for m, n in found.items())
    print(f"done in {time.time() - t_start:.0f} s ({cpu_seconds() - cpu_start:.0f} s of CPU): planted documents "
          f"ranked first: {summary}; the index is in {index}")
    if found["ekfac-selfnorm"] < len(FACTS):
        raise SystemExit("EK-FAC (self-normalized) should rank every planted document first")


if __name__ == "__main__":
    sys.exit(main())
