"""What a sharded index's rank holds (issue 34's RAM per rank): a rank that opens its part and searches it imports no
model library (transformers, datasets, tokenizers: ~20 MB and ~1 s of imports a rank, for nothing), and the
self-influence a query computes once per part reads the rows in small steps (the fit's 64 MB blocks raised a part's
peak RSS by 200-350 MB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from gradindex.index.sharded import split_index
from gradindex.methods import DEFAULT_DAMPING
from gradindex.precondition import selfinf
from gradindex.query import QueryEngine
from gradindex.query.sharded import PartSearch
from tests.conftest import make_texts

ROOT = Path(__file__).resolve().parents[1]
MODEL_LIBRARIES = ("transformers", "datasets", "tokenizers", "accelerate", "peft", "matplotlib")

RANK = """
import json, sys
LIBS = sys.argv[3].split(",")
import numpy as np
from gradindex.index.sharded import read_sharded
from gradindex.query.sharded import PartSearch
z = np.load(sys.argv[2])
sh = read_sharded(sys.argv[1])
ps = PartSearch(sh, [1], use_gpu=False)
res = ps.search({n: z[n] for n in z.files}, k=5, lowest=2)
ps.close()
print(json.dumps({"hits": [[h.id for h in r.hits + r.lowest] for r in res],
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in LIBS)}))
"""


def test_a_rank_searches_its_part_without_model_libraries(gpt2_dir, default_index, tmp_path):
    sh = split_index(default_index, tmp_path / "two", 2)
    with QueryEngine(default_index, gpt2_dir, device="cpu") as e:
        grads, _, _ = e.gradients(e.tokenize(make_texts(3, seed=5, max_words=12)))
    q = {n: v.numpy() for n, v in grads.items()}
    np.savez(tmp_path / "q.npz", **q)
    out = subprocess.run([sys.executable, "-c", RANK, str(sh.dir), str(tmp_path / "q.npz"),
                          ",".join(MODEL_LIBRARIES)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], f"a rank imported {got['loaded'][:5]}"
    ps = PartSearch(sh, [1], use_gpu=False)
    try:
        want = [[h.id for h in r.hits + r.lowest] for r in ps.search(q, k=5, lowest=2)]
    finally:
        ps.close()
    assert got["hits"] == want and min(min(x) for x in want) >= sh.parts[1].first


def test_computed_self_influence_reads_small_steps(default_index, monkeypatch):
    from gradindex.store import Store

    with QueryEngine(default_index, load_model=False, use_gpu=False) as e:
        layers, ix = list(e.layers), e.index
        whole = selfinf.self_influence(ix, "graddot", DEFAULT_DAMPING, layers)
        steps, iter_blocks = [], Store.iter_blocks

        def spy(self, names=None, block=4096, *a, **k):
            steps.append(block)
            return iter_blocks(self, names, block, *a, **k)

        monkeypatch.setattr(Store, "iter_blocks", spy)
        width = 4 * sum(ix.store.dims[n] for n in layers)
        monkeypatch.setattr(selfinf, "PASS_BYTES", 3 * width)
        small = selfinf.self_influence(ix, "graddot", DEFAULT_DAMPING, layers)
    assert steps and set(steps) == {3}
    np.testing.assert_array_equal(small, whole)
