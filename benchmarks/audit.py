"""Audit benchmarks: mislabeled examples found by self-influence, dedup precision/recall and scale.

1. **Outliers.** A labelled text task made here: each example is a sentence of 6-12 words drawn
   from a "sunny" or a "stormy" vocabulary (plus shared filler words), the prompt
   ``"<sentence> Weather:"`` and the completion ``" sunny"`` / ``" stormy"``. 10% of the labels
   are flipped. A small GPT-2 (from a config) is trained on the completions (AdamW), indexed
   (projection ``none``, EK-FAC), and the examples are ranked by self-influence (and per token,
   and by the training loss as a baseline). Reported: the share of flipped labels found in the
   top 5..50% of each ranking, against the random ranking's share (= the fraction), per seed.
2. **Dedup quality.** Real paragraphs (Python stdlib docstrings, ``fixtures/corpus.py``) plus
   planted pairs: exact copies, near copies (two words replaced), reordered copies (the
   paragraph's sentences rotated, a paraphrase that keeps the words), and topic pairs (two
   different paragraphs from one module, which must not be grouped). A small GPT-2 is trained
   on it, indexed (16x16), and ``find_duplicates`` runs at several thresholds: recall per kind
   of planted pair (both members in one group) and the share of topic pairs wrongly grouped.
   ``--dedup-index default``: the same on ``gradindex build``'s default index (whole gradient here,
   EK-FAC transcode, int4; ekfac, and graddot on its un-whitened rows) and on unprojected raw float32
   rows (graddot, ekfac), thresholds 0.3-0.95 (``dedup_default`` in the results; ``both``: and 16x16).
3. **Dedup scale** (``--scale N ...``): time (vectors / search / confirm) and peak memory of
   ``find_duplicates`` at threshold 0.95, each size in a fresh process, over the synthetic N-row
   stores of ``benchmarks/query.py`` (real rows of the demo model extended by random combinations;
   8 layers x 256 numbers). Then the candidate search's recall: for ``--recall-sample`` random rows
   (a quarter of it beyond 100k rows) their exact top-16 sketch neighbours over all N rows, and the
   share of those pairs the IVF self-join proposes (up to 100k rows also the FAISS IVFFlat search
   used before it), per band of sketched cosine; and the share of the exact pairs over the
   threshold whose members the timed run grouped.

    python -m benchmarks.audit                   # 1 and 2, ~5 min on 2 cores
    python -m benchmarks.audit --skip outliers dedup --scale 100000 1000000   # 3 only (~8 GB store)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fixtures.corpus import stdlib_paragraphs  # noqa: E402
from fixtures.tiny import tiny_gpt2, train_tokenizer  # noqa: E402
from gradindex.apps.dedup import DedupConfig, find_duplicates  # noqa: E402
from gradindex.apps.outliers import detection_curve, rank_outliers  # noqa: E402
from gradindex.capture import ProjectionSpec  # noqa: E402
from gradindex.data import collate, records_from_texts, tokenize_records  # noqa: E402
from gradindex.pipeline import BuildConfig, build_index  # noqa: E402

FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)
SUNNY = "bright warm clear golden calm blue gentle dry pleasant mild radiant cloudless".split()
STORMY = "dark cold wet thunder grey wild heavy lashing bitter gusty icy roaring".split()
FILLER = "the a over town today morning sky wind air hills river fields evening was felt".split()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_on(model, data, steps: int, batch: int = 32, lr: float = 3e-3, seed: int = 0, pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(data), (batch,), generator=g).tolist()
        b = collate([data.input_ids[i] for i in idx], [data.labels[i] for i in idx], pad)
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def outliers_experiment(work: Path, seed: int, n: int = 300, flip: float = 0.1, steps: int = 300,
                        dampings: tuple[float, ...] = ()) -> dict:
    rng = np.random.default_rng(seed)
    recs, flipped = [], np.zeros(n, dtype=bool)
    flipped[rng.choice(n, int(round(flip * n)), replace=False)] = True
    for i in range(n):
        sunny = bool(rng.integers(2))
        words = list(rng.choice(SUNNY if sunny else STORMY, 3)) + list(rng.choice(FILLER, int(rng.integers(3, 9))))
        rng.shuffle(words)
        label = sunny != flipped[i]
        recs.append({"prompt": " ".join(words) + " Weather:", "completion": " sunny" if label else " stormy"})
    import datasets

    ds = datasets.Dataset.from_list(recs)
    tok = train_tokenizer([r["prompt"] + r["completion"] for r in recs], vocab_size=600)
    data = tokenize_records(ds, tok, 64)
    torch.manual_seed(seed)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=64, n_head=4, n_positions=64, seed=seed)
    t0 = time.perf_counter()
    train_on(model, data, steps, seed=seed, pad=tok.pad_token_id)
    t_train = time.perf_counter() - t0
    out = work / f"outliers-{seed}"
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse("none"), batch_size=16, precondition="ekfac")
    t0 = time.perf_counter()
    build_index(model, tok, data, out, cfg, progress=False)
    t_build = time.perf_counter() - t0
    res = {"seed": seed, "n": n, "flipped": int(flipped.sum()), "train_s": t_train, "build_s": t_build,
           "fractions": list(FRACTIONS), "random": list(FRACTIONS)}
    for method in ("graddot", "ekfac"):
        r = rank_outliers(out, method)
        res[f"{method}_self_influence"] = detection_curve(r.order(), flipped, FRACTIONS)
        res[f"{method}_per_token"] = detection_curve(r.order("per_token"), flipped, FRACTIONS)
    for d in dampings:  # EK-FAC self-influence at other relative dampings than the library default
        res[f"ekfac_self_influence@{d:g}"] = detection_curve(rank_outliers(out, "ekfac", d).order(), flipped,
                                                             FRACTIONS)
    loss = rank_outliers(out, "graddot").loss
    res["training_loss"] = detection_curve(np.lexsort((np.arange(n), -loss)), flipped, FRACTIONS)
    return res


def _rotate(p: str) -> str:
    parts = [s for s in p.split(". ") if s]
    return ". ".join(parts[1:] + parts[:1]) if len(parts) > 1 else " ".join(p.split()[1:] + p.split()[:1])


def _dedup_corpus(per_kind: int, steps: int):
    """``(texts, planted pairs by kind, model, tokenized data, training seconds)`` of the dedup experiment."""
    paras = stdlib_paragraphs()[:600]
    rng = np.random.default_rng(0)
    texts = list(paras)
    pairs: dict[str, list[tuple[int, int]]] = {"exact": [], "near": [], "reordered": [], "topic": []}
    picks = rng.choice(len(paras), 3 * per_kind, replace=False)
    vocab = sorted({w for p in paras for w in p.split()})
    for kind, chunk in zip(("exact", "near", "reordered"), np.split(picks, 3), strict=True):
        for i in chunk.tolist():
            p = paras[i]
            if kind == "near":
                w = p.split()
                for j in rng.choice(len(w), 2, replace=False):
                    w[j] = vocab[int(rng.integers(len(vocab)))]
                p = " ".join(w)
            elif kind == "reordered":
                p = _rotate(p)
            pairs[kind].append((i, len(texts)))
            texts.append(p)
    # topic pairs: consecutive paragraphs (same module's docstrings), neither of them planted
    planted = set(picks.tolist())
    cand = [i for i in range(len(paras) - 1) if i not in planted and i + 1 not in planted]
    pairs["topic"] = [(i, i + 1) for i in rng.choice(cand, per_kind, replace=False).tolist()]
    tok = train_tokenizer(texts, vocab_size=1024)
    data = tokenize_records(records_from_texts(texts), tok, 96)
    model = tiny_gpt2(vocab_size=len(tok), n_layer=2, n_embd=64, n_head=4, n_positions=96, seed=0)
    t0 = time.perf_counter()
    train_on(model, data, steps, batch=16, pad=tok.pad_token_id)
    return texts, pairs, model, tok, data, time.perf_counter() - t0


def pair_cosines(index_dir: Path, method: str, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Exact cosines of ``pairs`` of rows under ``method``, as :func:`find_duplicates` confirms them."""
    from gradindex.apps.dedup import _space, _unit_rows
    from gradindex.store import Store
    from gradindex.store.rows import RowReader

    cfg = DedupConfig(method=method)
    layers, base, pre = _space(index_dir, cfg, None)
    ids = np.unique(np.asarray(pairs).ravel())
    with Store(index_dir) as store:
        u = _unit_rows(RowReader(store, layers).read(ids), layers, pre, base, cfg.damping)
    pos = {int(i): j for j, i in enumerate(ids)}
    return np.array([float(u[pos[a]] @ u[pos[b]]) for a, b in pairs])


DEDUP_INDEXES = {
    "16x16": ("16x16 projected raw fp32 rows", [("graddot", "graddot"), ("ekfac", "ekfac")]),
    "default": ("the default build (projection auto = whole gradient here, ekfac transcode, int4)",
                [("ekfac", "ekfac"), ("graddot", "graddot (un-whitened rows)")]),
    "raw": ("unprojected raw fp32 rows (--transcode none --storage fp32)", [("graddot", "graddot"),
                                                                             ("ekfac", "ekfac")]),
}


def _dedup_build_config(name: str) -> BuildConfig:
    if name == "16x16":
        return BuildConfig.raw(projection=ProjectionSpec(k_a=16, k_g=16), batch_size=16, precondition="ekfac")
    if name == "default":  # `gradindex build`'s defaults
        return BuildConfig(projection=ProjectionSpec(), budget="auto", batch_size=16, precondition="ekfac",
                           transcode="ekfac", storage="int4")
    return BuildConfig.raw(projection=ProjectionSpec(kind="none"), batch_size=16, precondition="ekfac", storage="fp32")


def dedup_experiment(work: Path, thresholds=(0.5, 0.6, 0.7, 0.8, 0.9, 0.95), per_kind: int = 30,
                     steps: int = 300, indexes: tuple[str, ...] = ("16x16",)) -> dict:
    """Recall per kind of planted pair at each threshold, per index in ``indexes`` (:data:`DEDUP_INDEXES`)."""
    import shutil

    texts, pairs, model, tok, data, t_train = _dedup_corpus(per_kind, steps)
    res: dict = {"n": len(texts), "train_s": t_train, "pairs_per_kind": per_kind}
    for name in indexes:
        out = work / f"dedup-{name}"
        shutil.rmtree(out, ignore_errors=True)
        build_index(model, tok, data, out, _dedup_build_config(name), progress=False)
        rows, cosines = [], {}
        for method, label in DEDUP_INDEXES[name][1]:
            cosines[method] = {k: np.round(pair_cosines(out, method, ps), 4).tolist() for k, ps in pairs.items()}
            for thr in thresholds:
                r = find_duplicates(out, DedupConfig(threshold=thr, method=method))
                group_of = {i: j for j, g in enumerate(r.groups) for i in g.ids}
                row = {"method": method, "threshold": thr, "groups": len(r.groups), "seconds": r.seconds["total"],
                       "grouped_examples": int(sum(len(g.ids) for g in r.groups))}
                for kind, ps in pairs.items():
                    same = [a in group_of and group_of.get(a) == group_of.get(b) for a, b in ps]
                    row[f"{kind}_grouped"] = float(np.mean(same))
                rows.append(row)
                log(f"dedup {name} {label} @ {thr}: " + ", ".join(f"{k} {row[f'{k}_grouped']:.2f}" for k in pairs))
        res[name] = {"index": DEDUP_INDEXES[name][0], "rows": rows, "pair_cosines": cosines}
    res["reading"] = ("per index: *_grouped: share of planted pairs whose two members share a group; topic_grouped "
                      "must stay near 0 (different paragraphs of one module); pair_cosines: each planted pair's "
                      "exact cosine under the method")
    return res


def _memory_mb() -> dict[str, float]:
    """This process's resident memory now, MB: anonymous, and file-backed (mapped files: store rows, libraries)."""
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def _scale_run(store: str, q) -> None:
    """Child process: one timed ``find_duplicates``; its own peak RSS (and, sampled every 0.1 s, the peaks
    of its anonymous memory and of its file-backed pages: the mapped store rows, libraries)."""
    import threading

    import faiss

    faiss.omp_set_num_threads(os.cpu_count() or 1)
    peaks, done = {"RssAnon": 0.0, "RssFile": 0.0}, threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            for k, v in _memory_mb().items():
                peaks[k] = max(peaks[k], v)

    threading.Thread(target=sample, daemon=True).start()
    l0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = find_duplicates(store, DedupConfig(threshold=SCALE_THRESHOLD), progress=False)
    secs = time.perf_counter() - t0
    done.set()
    q.put({"seconds": secs, "parts_s": r.seconds, "groups": len(r.groups),
           "grouped_examples": int(sum(len(g.ids) for g in r.groups)), "pairs_proposed": r.pairs_proposed,
           "pairs_checked": r.pairs_checked, "pairs_confirmed": r.pairs_confirmed, "peak_rss_mb": peak_rss_mb(),
           "peak_anon_mb": peaks["RssAnon"], "peak_file_backed_mb": peaks["RssFile"],
           "load_avg_1min": [round(l0, 2), round(os.getloadavg()[0], 2)],
           "group_of": {i: j for j, g in enumerate(r.groups) for i in g.ids}})


def _ivf_flat_pairs(x: np.ndarray, k: int, floor: float, seed: int = 0, block: int = 8192) -> np.ndarray:
    """The candidate search before the IVF self-join (FAISS IVFFlat, nlist √N, nprobe 8): for comparison."""
    import faiss

    from gradindex.index.factory import default_nlist

    nlist = default_nlist(len(x))
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(x.shape[1]), x.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    index.train(x[rng.choice(len(x), min(len(x), 64 * nlist), replace=False)])
    index.nprobe = max(8, nlist // 64)
    index.add(x)
    out = []
    for s in range(0, len(x), block):
        sims, nbr = index.search(x[s:s + block], k + 1)
        rows = np.repeat(np.arange(s, s + len(sims)), k + 1)
        ok = (nbr.ravel() >= 0) & (sims.ravel() >= floor) & (nbr.ravel() != rows)
        a, b = rows[ok], nbr.ravel()[ok]
        out.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
    return np.unique(np.concatenate(out), axis=0)


def candidate_recall(store: Path, sample: int, group_of: dict[int, int], before: bool) -> dict:
    """Pairs proposed by the large-N search (and, with ``before``, by the old IVFFlat search) against exact kNN
    over all rows for ``sample`` random rows, per band of sketched cosine; and the share of those exact pairs
    that pass the threshold whose members the timed run grouped together."""
    import faiss

    from gradindex.apps.dedup import _candidate_pairs, _confirm, _space, candidate_floor, candidate_vectors
    from gradindex.store import Store

    cfg = DedupConfig(threshold=SCALE_THRESHOLD, exact_max=0)
    x, nonzero, _ = candidate_vectors(store, cfg)
    N, floor, k = len(x), candidate_floor(cfg), cfg.neighbors
    t0 = time.perf_counter()
    found = {"ivf_join": _candidate_pairs(x, nonzero, cfg, floor)}
    secs = {"ivf_join": time.perf_counter() - t0}
    if before:
        t0 = time.perf_counter()
        found["ivf_flat_before"] = _ivf_flat_pairs(x, k, floor)
        secs["ivf_flat_before"] = time.perf_counter() - t0
    q = np.sort(np.random.default_rng(1).choice(N, min(sample, N), replace=False))
    t0 = time.perf_counter()
    sims, nbr = map(np.concatenate, zip(*(faiss.knn(x[q[s:s + 4096]], x, k + 1, metric=faiss.METRIC_INNER_PRODUCT)
                                          for s in range(0, len(q), 4096)), strict=True))
    t_exact = time.perf_counter() - t0
    del x
    ok = (nbr >= 0) & (nbr != q[:, None]) & (sims >= floor)
    a, b, s = np.repeat(q, k + 1).reshape(nbr.shape)[ok], nbr[ok], sims[ok]
    key, first = np.unique(np.minimum(a, b) * N + np.maximum(a, b), return_index=True)
    s = s[first]
    bands = {f">={lo:g}": s >= lo for lo in (floor, SCALE_THRESHOLD, 0.98)}
    out = {"sample": len(q), "exact_knn_s": t_exact, "search_s": secs, "exact_pairs": {b: int(m.sum()) for b, m in
                                                                                         bands.items()}}
    for name, pairs in found.items():
        hit = np.isin(key, pairs[:, 0] * N + pairs[:, 1])
        out[f"recall_{name}"] = {b: float(hit[m].mean()) if m.any() else None for b, m in bands.items()}
        out[f"pairs_{name}"] = len(pairs)
    layers, base, pre = _space(store, cfg, None)
    truth = np.stack([key // N, key % N], axis=1)
    with Store(store) as st:
        conf, _, _ = _confirm(st, layers, pre, base, cfg, truth, np.arange(N))
    same = [i in group_of and group_of[i] == group_of.get(j) for i, j in conf.tolist()]
    out["exact_pairs_over_threshold"] = len(conf)
    out["grouped_share"] = float(np.mean(same)) if same else None
    return out


SCALE_THRESHOLD = 0.95


def scale_experiment(work: Path, sizes: list[int], sample: int = 20000, before_max: int = 100_000
                     ) -> Iterator[dict]:
    """One result per size, as each finishes."""
    import multiprocessing as mp

    from benchmarks import query as qb

    docs, base_texts, _ = qb.corpus(16)
    model_dir = qb.demo_model(work / "scale", docs, 300)
    base = qb.base_store(work / "scale", model_dir, base_texts)
    for n in sizes:
        store = qb.synthetic_store(work / "scale", base, n)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_scale_run, args=(str(store), q))
        p.start()
        r = q.get()
        p.join()
        group_of = r.pop("group_of")
        r = {"examples": n, "threshold": SCALE_THRESHOLD, "cpus": os.cpu_count(), **r}
        log(f"dedup scale {n}: {r}")
        if sample:
            r["recall"] = candidate_recall(store, sample if n <= 100_000 else sample // 4, group_of, n <= before_max)
            log(f"dedup scale {n} recall: {r['recall']}")
        yield r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gradindex-audit-bench"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--scale", type=int, nargs="*", default=[])
    ap.add_argument("--recall-sample", type=int, default=20000,
                    help="rows checked against exact kNN at each --scale size (a quarter beyond 100k); 0: none")
    ap.add_argument("--skip", nargs="*", default=[], choices=["outliers", "dedup"])
    ap.add_argument("--dedup-index", default="16x16", choices=["16x16", "default", "both"],
                    help="dedup quality on the 16x16 projected index (results key 'dedup'), or on the default "
                         "build next to an unprojected raw fp32 one ('dedup_default'), or both")
    ap.add_argument("--dampings", type=float, nargs="*", default=[],
                    help="also rank outliers by EK-FAC self-influence at these relative dampings")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "audit.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"machine": platform.platform(), "torch": torch.__version__}
    if args.out.exists():
        res = {**json.loads(args.out.read_text()), **res}
    if "outliers" not in args.skip:
        res["outliers"] = [outliers_experiment(args.work_dir, s, dampings=tuple(args.dampings))
                           for s in range(args.seeds)]
        for r in res["outliers"]:
            log(f"outliers seed {r['seed']}: ekfac {np.round(r['ekfac_self_influence'], 2).tolist()} "
                f"graddot {np.round(r['graddot_self_influence'], 2).tolist()} loss "
                f"{np.round(r['training_loss'], 2).tolist()} random {list(FRACTIONS)}")
            for d in args.dampings:
                log(f"  ekfac @ damping {d:g}: {np.round(r[f'ekfac_self_influence@{d:g}'], 2).tolist()}")
        plot_outliers(res["outliers"], args.out.with_name("audit-outliers.png"))
    if "dedup" not in args.skip and args.dedup_index in ("16x16", "both"):
        d = dedup_experiment(args.work_dir)
        res["dedup"] = {**{k: v for k, v in d.items() if k != "16x16"}, "rows": d["16x16"]["rows"]}
    if "dedup" not in args.skip and args.dedup_index in ("default", "both"):
        res["dedup_default"] = dedup_experiment(args.work_dir, thresholds=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95),
                                                indexes=("default", "raw"))
    for r in scale_experiment(args.work_dir, args.scale, args.recall_sample) if args.scale else []:  # merged by size
        res["dedup_scale"] = sorted([e for e in res.get("dedup_scale", []) if e["examples"] != r["examples"]] + [r],
                                    key=lambda e: e["examples"])
        args.out.write_text(json.dumps(res, indent=2))
    args.out.write_text(json.dumps(res, indent=2))
    log(f"wrote {args.out}")


def plot_outliers(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [0.0, *FRACTIONS]
    for key, label in (("ekfac_self_influence", "EK-FAC self-influence"), ("ekfac_per_token", "EK-FAC per token"),
                       ("graddot_self_influence", "GradDot self-influence"), ("training_loss", "training loss")):
        y = np.mean([[0.0, *r[key]] for r in runs], axis=0)
        ax.plot(x, y, marker="o", label=label)
    ax.plot(x, x, "k--", label="random")
    ax.set_xlabel("share of training set inspected (ranked)")
    ax.set_ylabel("share of flipped labels found")
    ax.set_title(f"mislabeled examples found ({len(runs)} seeds, 10% flipped)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
