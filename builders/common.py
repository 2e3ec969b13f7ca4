"""Arguments the recipes share (each recipe is also readable alone: this only parses)."""

from __future__ import annotations

import argparse


def parser(doc: str, training: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--model", required=True, help="Local transformers causal-LM directory (model + tokenizer).")
    p.add_argument("--data", required=True, help="Training data: .jsonl/.json/.csv/.parquet with a 'text' field.")
    p.add_argument("--out", required=True, help="Index directory to write.")
    p.add_argument("--projection", default="16", help="K, KAxKG or none.")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto")
    if training:
        p.add_argument("--model-out", default=None, help="Where the trained model goes (default: OUT-model).")
        p.add_argument("--epochs", type=int, default=1)
        p.add_argument("--accum", type=int, default=1, help="Gradient accumulation steps.")
        p.add_argument("--lr", type=float, default=5e-5)
        p.add_argument("--seed", type=int, default=0)
    return p
