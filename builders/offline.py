"""Recipe: build an influence index offline, from a finished checkpoint (what `gradindex build` runs).

    python builders/offline.py --model MODEL_DIR --data train.jsonl --out my-index --precondition ekfac
    python -m gradindex query my-index --method ekfac --text "..."
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser  # noqa: E402

from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import load_records, tokenize_records  # noqa: E402
from gradindex.index import IndexConfig  # noqa: E402
from gradindex.model import load_causal_lm  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402


def main(argv=None) -> None:
    p = parser(__doc__, training=False)
    p.add_argument("--precondition", default="none", choices=["none", "kfac", "ekfac"])
    p.add_argument("--no-index", action="store_true", help="Stop after the store (and preconditioner).")
    args = p.parse_args(argv)
    model, tok = load_causal_lm(args.model, device=args.device)
    data = tokenize_records(load_records(args.data), tok, args.max_length)
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse(args.projection), max_length=args.max_length,
                      batch_size=args.batch_size, precondition=args.precondition)
    res, _ = build_index(model, tok, data, args.out, cfg, index=None if args.no_index else IndexConfig(gpu=False),
                         model_id=os.path.abspath(args.model), data_id=os.path.abspath(args.data), progress=False)
    print(f"built {args.out}: {res.manifest['counts']['examples']} examples in {res.seconds:.1f} s")


if __name__ == "__main__":
    main()
