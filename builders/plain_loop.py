"""Recipe: build an influence index while training with a plain PyTorch loop.

    python builders/plain_loop.py --model MODEL_DIR --data train.jsonl --out my-index
    python -m gradindex index my-index && python -m gradindex query my-index --text "..."

The loop is an ordinary one; the capture adds two lines: the ``with`` block, and the batch's
``gradindex_row`` (each example's row in the data set), which the model never sees.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser  # noqa: E402

from gradindex.data import collate, load_records, tokenize_records  # noqa: E402
from gradindex.integrations import GradIndexCapture  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    torch.manual_seed(args.seed)
    model, tok = load_causal_lm(args.model, device=args.device)
    device = next(model.parameters()).device
    data = tokenize_records(load_records(args.data), tok, args.max_length)
    model_out = args.model_out or args.out.rstrip("/") + "-model"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    order_rng = torch.Generator().manual_seed(args.seed)
    model.train()
    with GradIndexCapture(model, args.out, optimizer=opt, projection=args.projection, num_rows=len(data),
                          max_length=args.max_length, model_id=os.path.abspath(model_out),
                          data_id=os.path.abspath(args.data)) as cap:
        for epoch in range(args.epochs):
            cap.epoch = epoch
            order = torch.randperm(len(data), generator=order_rng).tolist()
            batches = [order[s:s + args.batch_size] for s in range(0, len(order), args.batch_size)]
            for k, rows in enumerate(batches):
                batch = collate([data.input_ids[i] for i in rows], [data.labels[i] for i in rows], tok.pad_token_id)
                batch = {name: t.to(device) for name, t in batch.items()}
                batch["gradindex_row"] = torch.tensor(rows)  # the capture takes it; the model never sees it
                loss = model(**batch).loss / args.accum
                loss.backward()
                if (k + 1) % args.accum == 0 or k + 1 == len(batches):
                    opt.step()
                    opt.zero_grad()
    model.save_pretrained(model_out)
    tok.save_pretrained(model_out)
    m = cap.manifest
    print(f"captured {m['counts']['examples']} examples over {m['training']['steps']} steps into {args.out}; "
          f"model saved to {model_out}")


if __name__ == "__main__":
    main()
