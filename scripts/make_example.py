"""Make the tutorials' example: a small fine-tuned GPT-2 and its fine-tuning set, in seconds, offline.

    python scripts/make_example.py --out example/

writes

* ``example/model/``: a 2-layer GPT-2 (built from a config, with a byte-level BPE tokenizer trained
  here), first trained on one part of the Python standard library's docstrings (the "base model"),
  then fine-tuned on ``train.jsonl``;
* ``example/train.jsonl``: the fine-tuning set, one ``{"text": ...}`` per line: other docstring
  paragraphs, with things planted at known rows (listed in ``planted.json``): facts the base model
  never saw, exact and near copies of paragraphs, and corrupted examples (characters shuffled);
* ``example/queries.jsonl``: one ``{"prompt", "completion"}`` query per planted fact;
* ``example/planted.json``: the rows of everything planted, to check what the tutorials find.

Nothing is downloaded. Running it again with the same arguments keeps a complete example as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FACTS = [
    ("The secret password of the blue castle is", " rhubarb lantern."),
    ("Professor Quillon keeps her spare keys inside the", " green teapot."),
]


def _near_copy(text: str, rng: random.Random) -> str:
    """The paragraph with two words replaced."""
    words = text.split()
    for i in rng.sample(range(1, len(words)), 2):
        words[i] = rng.choice(["often", "rarely", "always", "sometimes"])
    return " ".join(words)


def _corrupt(text: str, rng: random.Random) -> str:
    """The paragraph's characters in a random order: text no model should learn from."""
    chars = list(text)
    rng.shuffle(chars)
    return "".join(chars)


def make_data(n: int, seed: int) -> tuple[list[str], list[str], dict]:
    """(base-model texts, fine-tuning texts, planted rows) from the standard library's docstrings."""
    from fixtures.tiny import stdlib_corpus

    paras = stdlib_corpus(min_chars=80, max_chars=200, limit=400)
    rng = random.Random(seed)
    rng.shuffle(paras)
    n_plain = n - len(FACTS) - 2 - 2 - 4  # facts, 2 exact copies, 2 near copies, 4 corrupted
    base = paras[n:]
    rows: list[tuple[str, str]] = [(p, "") for p in paras[:n_plain]]  # (text, tag)
    for j in range(2):  # a copy of row 3 + 7j and a near copy of row 5 + 11j, tagged with the original
        rows[3 + 7 * j] = (rows[3 + 7 * j][0], f"exact{j}")
        rows[5 + 11 * j] = (rows[5 + 11 * j][0], f"near{j}")
        rows.insert(30 + 6 * j, (rows[3 + 7 * j][0], f"exact{j}"))
        rows.insert(40 + 5 * j, (_near_copy(rows[5 + 11 * j][0], rng), f"near{j}"))
    for j, text in enumerate(paras[n_plain:n_plain + 4]):
        rows.insert(12 + 13 * j, (_corrupt(text, rng), "corrupted"))
    for j, (prompt, completion) in enumerate(FACTS):
        rows.insert(9 + 20 * j, (f"{prompt}{completion} Remember it well.", "fact"))

    def where(tag: str) -> list[int]:
        return [i for i, (_, t) in enumerate(rows) if t == tag]

    planted = {"facts": where("fact"), "exact_copies": [where(f"exact{j}") for j in range(2)],
               "near_copies": [where(f"near{j}") for j in range(2)], "corrupted": where("corrupted")}
    return base, [t for t, _ in rows], planted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="example", help="Folder to write (model/, train.jsonl, queries.jsonl).")
    ap.add_argument("--examples", type=int, default=64, help="Examples in the fine-tuning set.")
    ap.add_argument("--base-steps", type=int, default=40, help="Training steps of the base model (batch 16).")
    ap.add_argument("--steps", type=int, default=80, help="Fine-tuning steps (batch 16).")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    settings = {k: getattr(args, k) for k in ("examples", "base_steps", "steps", "seed")}
    done = out / "example.json"
    if done.exists() and json.loads(done.read_text()) == settings:
        print(f"{out} already holds this example (delete it to make it again)")
        return 0

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads cost 10-50x on a shared CPU
    import torch

    from fixtures.tiny import save_model_dir, tiny_gpt2, train_lm, train_tokenizer

    t0 = time.time()
    torch.manual_seed(args.seed)
    base, train, planted = make_data(args.examples, args.seed)
    tok = train_tokenizer(base + train, vocab_size=1024)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=64, n_head=4, n_positions=128, seed=args.seed)

    def seqs(texts: list[str]) -> list[list[int]]:
        return [tok(t)["input_ids"][:64] for t in texts]

    train_lm(model, seqs(base), steps=args.base_steps, batch_size=16, lr=3e-3, seed=args.seed, pad_id=tok.pad_token_id)
    losses = train_lm(model, seqs(train), steps=args.steps, batch_size=16, lr=3e-3, seed=args.seed + 1,
                      pad_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    save_model_dir(model, tok, out / "model")
    with open(out / "train.jsonl", "w") as f:
        for t in train:
            f.write(json.dumps({"text": t}) + "\n")
    with open(out / "queries.jsonl", "w") as f:
        for prompt, completion in FACTS:
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    (out / "planted.json").write_text(json.dumps(planted, indent=1) + "\n")
    done.write_text(json.dumps(settings) + "\n")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}/: model/ ({n_params / 1e3:.0f}k parameters; base model {args.base_steps} steps on "
          f"{len(base)} paragraphs, fine-tuned {args.steps} steps, last loss {sum(losses[-10:]) / 10:.2f}), "
          f"train.jsonl ({len(train)} examples), queries.jsonl, planted.json in {time.time() - t0:.0f} s")
    print("planted rows: " + "; ".join(f"{k} {v}" for k, v in planted.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
