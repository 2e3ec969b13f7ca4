"""Recipe: train with online data selection toward a target set, in a plain PyTorch loop.

    python builders/select_plain_loop.py --model MODEL_DIR --data train.jsonl --target target.jsonl \
        --out trained-model --keep 0.25

Each batch is scored against the target set's gradient (mean token loss, projected like an index's
rows) before the loop sees it; the loop trains on the kept examples (``--policy top``: the best
``--keep`` fraction; ``threshold``: cosine at least ``--min-score``; ``reweight``: all, weighted by
a softmax of the scores; ``random``: a random ``--keep`` fraction, the baseline). The loop is an
ordinary one; selection adds two lines: the selector, and ``SelectingLoader`` around the batches.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser  # noqa: E402

from gradindex.data import collate, load_records, tokenize_records  # noqa: E402
from gradindex.integrations import (  # noqa: E402
    OnlineSelector,
    RandomFraction,
    Reweight,
    SelectingLoader,
    Threshold,
    TopFraction,
)
from gradindex.model import load_causal_lm  # noqa: E402


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--target", required=True, help="Target set (same formats as --data): what to get better at.")
    p.add_argument("--policy", default="top", choices=["top", "threshold", "reweight", "random"])
    p.add_argument("--keep", type=float, default=0.25, help="Fraction kept per batch (top, random).")
    p.add_argument("--min-score", type=float, default=0.0, help="Cosine kept at or above (threshold).")
    p.add_argument("--temperature", type=float, default=0.1, help="Softmax temperature (reweight).")
    p.add_argument("--precondition", default="adam", choices=["none", "adam", "diagonal"])
    p.add_argument("--refresh-every", type=int, default=50, help="Optimizer steps between target refreshes.")
    next(a for a in p._actions if a.dest == "out").help = "Where the trained model goes."
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    model, tok = load_causal_lm(args.model, device=args.device)
    device = next(model.parameters()).device
    data = tokenize_records(load_records(args.data), tok, args.max_length)
    target = tokenize_records(load_records(args.target), tok, args.max_length)
    model_out = args.model_out or args.out
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    policy = {"top": TopFraction(args.keep), "threshold": Threshold(args.min_score),
              "reweight": Reweight(args.temperature), "random": RandomFraction(args.keep, seed=args.seed)}[args.policy]
    selector = OnlineSelector(model, target, policy, optimizer=opt, projection=args.projection,
                              precondition=args.precondition, refresh_every=args.refresh_every)
    order_rng = torch.Generator().manual_seed(args.seed)
    model.train()
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        order = torch.randperm(len(data), generator=order_rng).tolist()
        batches = [order[s:s + args.batch_size] for s in range(0, len(order), args.batch_size)]
        loader = ({name: t.to(device) for name, t in collate([data.input_ids[i] for i in rows],
                                                              [data.labels[i] for i in rows], tok.pad_token_id).items()}
                  for rows in batches)
        for k, batch in enumerate(SelectingLoader(loader, selector)):  # the kept examples of each batch
            loss = model(**batch).loss / args.accum
            loss.backward()
            if (k + 1) % args.accum == 0 or k + 1 == len(batches):
                opt.step()
                opt.zero_grad()
    selector.close()
    model.save_pretrained(model_out)
    tok.save_pretrained(model_out)
    st = selector.stats
    print(f"trained on {st['kept']} of {st['examples']} examples ({args.policy}) in {time.perf_counter() - t0:.1f} s "
          f"(scoring {st['scoring_s']:.1f} s, {st['refreshes']} target refreshes); model saved to {model_out}")


if __name__ == "__main__":
    main()
