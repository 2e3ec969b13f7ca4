"""Cost of the full model fingerprint next to a capture pass, on the demo model and a ~100M model.

For each model (built from a config, one thread): seconds of
:func:`gradindex.fingerprint.model_fingerprint` (every parameter hashed), seconds of capturing one
batch of 8 sequences of 128 tokens with the default projection, and the ratio: how many such
sequences the fingerprint costs. Prints a table, writes ``benchmarks/results/fingerprint.json``.

    python -m benchmarks.fingerprint           # demo model and GPT-2 of ~100M parameters
    python -m benchmarks.fingerprint --quick   # demo model only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fixtures.tiny import tiny_gpt2  # noqa: E402
from gradindex.capture import GradientCapture, ProjectedRows, ProjectionSpec, RowSpace  # noqa: E402
from gradindex.capture.batch import batch_gradients  # noqa: E402
from gradindex.fingerprint import model_fingerprint  # noqa: E402

MODELS = {
    "demo (2x128, vocab 2048)": dict(vocab_size=2048, n_layer=2, n_embd=128, n_head=4, n_positions=128),
    "gpt2 ~100M (12x768, vocab 32000)": dict(vocab_size=32000, n_layer=12, n_embd=768, n_head=12,
                                             n_positions=128),
}


def fastest(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(name: str, kw: dict, rounds: int, batch: int = 8, seq_len: int = 128) -> dict:
    model = tiny_gpt2(**kw).eval()
    n_params = sum(p.numel() for p in model.parameters())
    fp = fastest(lambda: model_fingerprint(model), rounds)
    seqs = torch.randint(kw["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(0)).tolist()
    model.requires_grad_(False)
    with GradientCapture(model, None, ProjectedRows(RowSpace(ProjectionSpec.parse("16")))) as cap:
        cap_s = fastest(lambda: batch_gradients(model, cap, seqs, seqs, 0), rounds)
    per_seq = cap_s / batch
    return {"model": name, "parameters": n_params, "fingerprint_s": round(fp, 4),
            "fingerprint_MB_per_s": round(4 * n_params / fp / 1e6, 1),
            "capture_s_per_sequence": round(per_seq, 4), "fingerprint_in_sequences": round(fp / per_seq, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="demo model only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fingerprint.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = list(MODELS)[:1] if args.quick else list(MODELS)
    rows = [measure(n, MODELS[n], args.rounds) for n in names]
    print(f"{'model':36} {'params':>12} {'fingerprint s':>14} {'MB/s':>8} {'capture s/seq':>14} {'= seqs':>8}")
    for r in rows:
        print(f"{r['model']:36} {r['parameters']:>12,} {r['fingerprint_s']:>14.3f} {r['fingerprint_MB_per_s']:>8.0f} "
              f"{r['capture_s_per_sequence']:>14.4f} {r['fingerprint_in_sequences']:>8.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": 1, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
