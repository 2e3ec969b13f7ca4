"""Recipe: build an influence index while fine-tuning with TRL's SFTTrainer (``pip install gradindex[trl]``).

    python builders/trl_sft.py --model MODEL_DIR --data train.jsonl --out my-index

The data is tokenized as gradindex tokenizes it (so `gradindex precondition` can re-read it), and
TRL's collator, which drops columns it does not know, is wrapped by ``keep_rows`` so each batch
keeps its ``gradindex_row``. Packing and padding-free batches mix examples in one row: keep them off.
"""

from __future__ import annotations

import os
import sys

import datasets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

from gradindex.data import load_records, tokenize_records  # noqa: E402
from gradindex.integrations import GradIndexCallback, keep_rows, with_row_ids  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402


def main(argv=None) -> None:
    args = parser(__doc__).parse_args(argv)
    model, tok = load_causal_lm(args.model, device=args.device)
    data = tokenize_records(load_records(args.data), tok, args.max_length)
    train = with_row_ids(datasets.Dataset.from_dict({"input_ids": list(data.input_ids)}))
    model_out = args.model_out or args.out.rstrip("/") + "-model"
    callback = GradIndexCallback(args.out, projection=args.projection, max_length=args.max_length,
                                 model_id=os.path.abspath(model_out), data_id=os.path.abspath(args.data))
    cfg = SFTConfig(
        output_dir=model_out, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.accum,
        learning_rate=args.lr, num_train_epochs=args.epochs, seed=args.seed, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, use_cpu=args.device == "cpu", max_length=args.max_length,
        packing=False, remove_unused_columns=False,
    )
    collator = keep_rows(DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id))
    trainer = SFTTrainer(model, args=cfg, train_dataset=train, processing_class=tok, data_collator=collator,
                         callbacks=[callback])
    trainer.train()
    trainer.save_model(model_out)
    tok.save_pretrained(model_out)
    m = callback.manifest
    print(f"captured {m['counts']['examples']} examples over {m['training']['steps']} steps into {args.out}; "
          f"model saved to {model_out}")


if __name__ == "__main__":
    main()
