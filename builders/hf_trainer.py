"""Recipe: build an influence index while training with the Hugging Face Trainer.

    python builders/hf_trainer.py --model MODEL_DIR --data train.jsonl --out my-index
    python -m gradindex index my-index && python -m gradindex query my-index --text "..."

Three changes to a usual Trainer script: a ``gradindex_row`` column (``with_row_ids``),
``remove_unused_columns=False`` so the collator keeps it, and the callback.
"""

from __future__ import annotations

import os
import sys

import datasets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser  # noqa: E402
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments  # noqa: E402

from gradindex.data import load_records, tokenize_records  # noqa: E402
from gradindex.integrations import GradIndexCallback, with_row_ids  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    model, tok = load_causal_lm(args.model, device=args.device)
    data = tokenize_records(load_records(args.data), tok, args.max_length)
    train = with_row_ids(datasets.Dataset.from_dict({"input_ids": list(data.input_ids)}))
    model_out = args.model_out or args.out.rstrip("/") + "-model"
    callback = GradIndexCallback(args.out, projection=args.projection, max_length=args.max_length,
                                 model_id=os.path.abspath(model_out), data_id=os.path.abspath(args.data))
    targs = TrainingArguments(
        output_dir=model_out, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accum,
        learning_rate=args.lr, num_train_epochs=args.epochs, seed=args.seed, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, use_cpu=args.device == "cpu",
        remove_unused_columns=False,  # keeps 'gradindex_row' for the callback
    )
    trainer = Trainer(model, targs, train_dataset=train, callbacks=[callback],
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    trainer.save_model(model_out)
    tok.save_pretrained(model_out)
    m = callback.manifest
    print(f"captured {m['counts']['examples']} examples over {m['training']['steps']} steps into {args.out}; "
          f"model saved to {model_out}")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # under torchrun the Trainer made the process group: end it
        del trainer, model  # DDP's reducer holds the group
        dist.barrier()  # every rank's outstanding work done first: destroying gloo's group with work still in
        dist.destroy_process_group()  # flight deadlocked (its loop thread waited for the GIL the join held)
        from gradindex.distributed import exit_rank

        exit_rank(0)  # (gloo's threads can abort the interpreter's teardown: "terminate called without ...")


if __name__ == "__main__":
    main()
