"""Kronfluence's EK-FAC fit on the shared workload, through its public API (run by fullspace.py in its own venv).

Not part of gradindex: it needs ``kronfluence`` installed (``python -m venv /work/venvs/kronfluence &&
/work/venvs/kronfluence/bin/pip install kronfluence torch transformers``), and imports nothing from
gradindex. Kronfluence tracks ``nn.Linear``, so each GPT-2 block ``Conv1D`` (``y = x W + b``) is
replaced by the equal ``nn.Linear`` (weight ``Wᵀ``). Loss: the sum of next-token cross-entropy over
each sequence (gradindex's per-example loss), empirical Fisher (observed labels), as gradindex fits.
Prints one JSON line: seconds of ``fit_all_factors`` (covariance + eigendecomposition + lambda) and
where the factors went; with ``--dump LAYER`` also writes that layer's lambda matrix to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fixtures.tiny import tiny_gpt2  # noqa: E402


def to_linear(model: nn.Module) -> list[str]:
    """Replace every block Conv1D by an equal nn.Linear; return their names."""
    from transformers.pytorch_utils import Conv1D

    names = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Conv1D) and name.startswith("transformer.h."):
            n_in, n_out = mod.weight.shape
            lin = nn.Linear(n_in, n_out)
            with torch.no_grad():
                lin.weight.copy_(mod.weight.T)
                lin.bias.copy_(mod.bias)
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            setattr(parent, name.rsplit(".", 1)[1], lin)
            names.append(name)
    return names


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task

    model = tiny_gpt2(vocab_size=args.vocab, n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                      n_positions=max(128, args.seq_len), seed=args.seed)
    tracked = to_linear(model)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(args.vocab, (args.sequences, args.seq_len), generator=g)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i], "attention_mask": torch.ones_like(ids[i])}

    class LM(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
            logits = logits.reshape(-1, logits.shape[-1])
            if sample:
                with torch.no_grad():
                    labels = torch.multinomial(F.softmax(logits, -1), 1).flatten()
            else:
                labels = batch["labels"][:, 1:].reshape(-1)
            return F.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

        def get_influence_tracked_modules(self):
            return tracked

        def get_attention_mask(self, batch):
            return batch["attention_mask"]

    task = LM()
    model = prepare_model(model.eval(), task)
    with tempfile.TemporaryDirectory() as tmp:
        an = Analyzer("bench", model, task, cpu=True, disable_tqdm=True, output_dir=tmp)
        fa = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
        t0, c0 = time.perf_counter(), time.process_time()
        an.fit_all_factors("ekfac", Data(), per_device_batch_size=args.batch_size, factor_args=fa,
                           overwrite_output_dir=True)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if args.dump:
            f = an.load_all_factors("ekfac")
            np.savez(args.out, **{k: f[k][args.dump].double().numpy() for k in
                                  ("lambda_matrix", "num_lambda_processed", "activation_eigenvectors",
                                   "gradient_eigenvectors")})
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "sequences": args.sequences, "tracked": len(tracked)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
