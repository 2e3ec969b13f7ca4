"""What each stage buys on a real pretrained LLM: SmolLM2-135M-Instruct LoRA-fine-tuned on a chat set.

The subject is :mod:`benchmarks.smollm2` (the registry's GGUF, Q4_1-rounded weights de-quantized to
float32; a chat set over Python's docstrings with planted facts and distractors; a PEFT LoRA fine-tune).
Measured, each step cached in the work folder so a killed run resumes:

* the default build of the fine-tune through the full (merged) model and through the adapter
  (``--adapter``): wall time and peak RSS of the CLI;
* scores ``[Q, N]`` of every query against every training conversation: the first stage (``ekfac``,
  ``ekfac-selfnorm``), exhaustive full-space EK-FAC (the exact stage over all N) at several dampings,
  BM25 and Rep-Sim;
* the halves LDS: LoRA retrainings on random halves, two at a time (``--subsets``; a second seed of
  the first ``--noise-subsets`` gives the noise ceiling), Spearman per query of a half's summed
  scores against its retrained loss;
* the 1%-drop LDS (``retrain-drop``, ``report-drop``): retrainings each leaving out ceil(1%) of the conversations,
  in the full set's batch order with those left out (so a drop differs from the full run by its records alone);
  the first ``--noise-subsets`` also under another batch order, the noise ceiling;
* planted facts: the rank of the best-ranked source conversation of each paraphrased fact query.

    python -m benchmarks.real_llm retrain --n 160 --subsets 24 --noise-subsets 8   # the retrainings, 2 at a time
    python -m benchmarks.real_llm report --n 160 --subsets 24 --noise-subsets 8    # -> benchmarks/results/real-llm.json
    python -m benchmarks.real_llm retrain-drop --subsets 12 --noise-subsets 4      # the 1%-drop retrainings
    python -m benchmarks.real_llm report-drop --subsets 12 --noise-subsets 4       # -> real-llm.json "drop"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import evaluate, lds_per_query, noise_ceiling, spearman_rows
from benchmarks.smollm2 import Recipe, finetune, retrain

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "real-llm.json"
DAMPINGS = (1e-3, 1e-2, 1e-1, 1.0)
DEFAULT = "first stage ekfac-selfnorm (full)"  # the default index's default query, what the others are paired with
ADAM_STATE = "adam-state.safetensors"  # the fine-tune's AdamW state, from a re-run (benchmarks.smollm2.adam_state)


def _timed(cmd: list[str], log: Path, what: str) -> dict:
    """Run ``cmd`` under ``/usr/bin/time -v``: wall seconds and peak RSS (its output in ``log``)."""
    timed = ["/usr/bin/time", "-v", *cmd] if Path("/usr/bin/time").exists() else cmd
    t0 = time.perf_counter()
    r = subprocess.run(timed, capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    wall = time.perf_counter() - t0
    log.write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed ({r.returncode}); see {log}")
    rss = [ln for ln in r.stderr.splitlines() if "Maximum resident set size" in ln]
    cpu = [float(ln.split()[-1]) for ln in r.stderr.splitlines() if ln.strip().startswith(("User time", "System time"))]
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(int(rss[0].split()[-1]) / 1e6, 2) if rss else None,
            **({"cpu_s": round(sum(cpu), 1)} if len(cpu) == 2 else {})}


def _cli(args: list[str], log: Path) -> dict:
    """Run ``gradindex ARGS`` under ``/usr/bin/time -v``: wall seconds and peak RSS."""
    return _timed([sys.executable, "-m", "gradindex", *args], log, f"gradindex {' '.join(args)}")


def build_indices(ft: dict, work: Path, workers: int = 1, names: tuple[str, ...] = ("full", "adapter")) -> dict:
    """The default build through the merged model (``full``) and through the adapter (``adapter``), cached,
    ``workers`` at once; ``raw``: through the merged model with raw projected rows (``--transcode none``: int8
    rows, the EK-FAC fit beside them), the rows ``graddot`` and ``cosine`` read; ``var-b1m``: the default build at
    four times the default bytes per example (1 MiB), the on-disk tier an exact stage could read instead of
    recomputing (:func:`stages`); ``adapter-adam``: through the adapter with the re-run fine-tune's AdamW state
    (``--optimizer-state``, :data:`ADAM_STATE`): rows ``G / (√v + ε)``, methods ``adam`` and ``adam-selfnorm``."""

    def one(name_args):
        name, args = name_args
        idx = work / f"idx-{name}"
        stamp = work / f"build-{name}.json"
        if not stamp.exists():
            cost = _cli(["build", *args, "--out", str(idx), "--max-length", "192", "--quiet", "--overwrite"],
                        work / f"build-{name}.log")
            stamp.write_text(json.dumps(cost))
        return name, {"dir": str(idx), **json.loads(stamp.read_text())}

    paths = {"full": [ft["merged"], ft["data"]], "adapter": [ft["base"], ft["data"], "--adapter", ft["adapter"]],
             "raw": [ft["merged"], ft["data"], "--transcode", "none"],
             "var-b1m": [ft["merged"], ft["data"], "--budget", str(1 << 20)],
             "adapter-adam": [ft["base"], ft["data"], "--adapter", ft["adapter"], "--optimizer-state",
                              str(work / ADAM_STATE)]}
    with ThreadPoolExecutor(workers) as ex:
        return dict(ex.map(one, [(n, paths[n]) for n in names]))


def load_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def first_stage(idx: str, queries: list[dict], methods=("ekfac", "ekfac-selfnorm")) -> dict[str, np.ndarray]:
    from gradindex.query import QueryEngine

    with QueryEngine(idx) as engine:
        return {m: engine.scores(queries, method=m) for m in methods}


def exhaustive_full(idx: str, ft: dict, queries: list[dict], work: Path, chunk: int = 6) -> dict[str, np.ndarray]:
    """Exhaustive full-space EK-FAC ``[Q, N]`` at every damping of :data:`DAMPINGS`, plain and self-normalized.

    One pass over the training set per chunk of queries: each example's per-token factors are rotated
    into the eigenbasis once (``R = Q_Sᵀ G Q_A``) and dotted with every query's rotated gradient under
    every damping's ``1/(Λ + δ)``, so the dampings cost one pass, not one each."""
    from gradindex.data import load_records, tokenize_records
    from gradindex.model import load_causal_lm, resolve_pad_id
    from gradindex.precondition.fullspace import load_full_preconditioner
    from gradindex.query.full import full_query_gradient

    if not (Path(idx) / "ekfac-full.h5").exists():
        _cli(["precondition", idx, "--method", "ekfac", "--space", "full"], work / "precondition-full.log")
    pre = load_full_preconditioner(idx, "ekfac")
    model, tok = load_causal_lm(ft["merged"])
    pad = resolve_pad_id(model, tok)
    train = tokenize_records(load_records(ft["data"]), tok, 192)
    qs = tokenize_records(__import__("datasets").Dataset.from_list(queries), tok, 192)
    layers = list(pre.layers)
    eig = {n: pre._tensors(n, torch.device("cpu"), torch.float32) for n in layers}
    w = {n: torch.stack([1.0 / (eig[n][2] + pre.delta(n, d)) for d in DAMPINGS]) for n in layers}  # [D, N_o, N_i]
    Q, N, D = len(queries), len(train), len(DAMPINGS)
    dots, sq = np.zeros((Q, N, D)), np.zeros((N, D))
    for c0 in range(0, Q, chunk):
        rq = {}
        for j in range(c0, min(Q, c0 + chunk)):
            G = full_query_gradient(model, layers, (qs.input_ids[j], qs.labels[j]), pad)
            for n in layers:
                Q_S, Q_A, _ = eig[n]
                rq.setdefault(n, []).append(Q_S.T @ G[n] @ Q_A)
        rq = {n: torch.stack(v) for n, v in rq.items()}  # [q, N_o, N_i]
        _train_pass(model, layers, train, pad, eig, w, rq, dots[c0:c0 + chunk], sq if c0 == 0 else None)
    out = {}
    for i, d in enumerate(DAMPINGS):
        s = dots[:, :, i]
        out[f"full ekfac d={d:g}"] = s
        out[f"full ekfac-selfnorm d={d:g}"] = s / np.sqrt(np.maximum(sq[:, i], 1e-300))[None]
    return out


def _train_pass(model, layers, train, pad, eig, w, rq, dots, sq, batch: int = 4) -> None:
    from gradindex.capture import FullTokens, GradientCapture
    from gradindex.capture.batch import batch_gradients

    cur: dict[str, torch.Tensor] = {}

    def visit(name, a, g):
        Q_S, Q_A, _ = eig[name]
        R = torch.bmm((g.float() @ Q_S).transpose(1, 2), a.float() @ Q_A)  # [B, N_o, N_i]
        d = torch.einsum("qoi,doi,boi->qbd", rq[name], w[name], R)
        cur["dot"] = cur["dot"] + d if "dot" in cur else d
        if sq is not None:
            s = torch.einsum("doi,boi->bd", w[name], R.square())
            cur["sq"] = cur["sq"] + s if "sq" in cur else s

    with GradientCapture(model, layers, FullTokens(visit)) as cap:
        for s in range(0, len(train), batch):
            cur.clear()
            batch_gradients(model, cap, list(train.input_ids[s:s + batch]), list(train.labels[s:s + batch]), pad)
            e = s + cur["dot"].shape[1]
            dots[:, s:e] = cur["dot"].double().numpy()
            if sq is not None:
                sq[s:e] = cur["sq"].double().numpy()


RAW = (("graddot", DAMPINGS[0]), ("cosine", DAMPINGS[0]), ("ekfac", DAMPINGS[0]), ("ekfac-selfnorm", DAMPINGS[0]),
       ("ekfac-selfnorm", 0.1), ("ekfac-selfnorm", 1.0))


def raw_rows(idx: str, queries: list[dict]) -> dict[str, np.ndarray]:
    """The first stage on raw projected rows (the ``raw`` build): GradDot, cosine, and EK-FAC at the query's
    damping (which the default rows bake in at 0.001)."""
    from gradindex.query import QueryEngine

    out = {}
    with QueryEngine(idx) as engine:
        for m, d in RAW:
            name = f"raw rows {m} (full)" if m in ("graddot", "cosine") else f"raw rows {m} d={d:g} (full)"
            out[name] = engine.scores(queries, method=m, damping=d)
    return out


REFINE_BATCH = 2  # examples per curvature-product pass: the default 16 took 16.8 GB on SmolLM2 (killed), 2 takes 6.7 GB


def refined(idx: str, queries: list[dict], facts: int, part: Path) -> tuple[dict, dict]:
    """The first stage with query refinement at its defaults (``--refine cg``: 1 CG step of Gauss-Newton products
    over 32 training examples at refine damping 10; :data:`REFINE_BATCH` examples a pass, which changes only the
    memory): ``{name: [Q, N]}`` for ``ekfac-selfnorm`` and ``ekfac`` (the same refined vector, cached by the engine)
    once every query is done, else ``{}``; and how it ran. One query at a time, fact and documentation queries
    alternating, each kept in ``part`` as it finishes (a killed run resumes; :func:`report` reads a partial run)."""
    from gradindex.query import QueryEngine
    from gradindex.query.refine import RefineConfig

    Q = len(queries)
    old = dict(np.load(part)) if part.exists() else {}
    rows = {m: old.get(m, np.full((Q, 0), np.nan)) for m in ("ekfac-selfnorm", "ekfac")}
    seconds = old.get("seconds", np.full(Q, np.nan))
    cfg = RefineConfig(batch=REFINE_BATCH)
    order = [j for pair in zip(range(facts), range(facts, Q)) for j in pair]
    order += [j for j in range(Q) if j not in order]
    with QueryEngine(idx) as engine:
        for j in order:
            if not np.isnan(seconds[j]):
                continue
            t0 = time.perf_counter()
            for m in rows:
                s = engine.scores(queries[j:j + 1], method=m, refine=cfg)[0]
                if rows[m].shape[1] == 0:
                    rows[m] = np.full((Q, len(s)), np.nan)
                rows[m][j] = s
            seconds[j] = time.perf_counter() - t0
            np.savez(part, seconds=seconds, **rows)
            print(f"refined query {j}: {seconds[j]:.0f} s ({int((~np.isnan(seconds)).sum())} of {Q})", flush=True)
    how = {"config": {k: getattr(cfg, k) for k in ("method", "steps", "sample", "damping", "curvature", "batch")},
           "seconds_per_query": round(float(np.nanmean(seconds)), 1)}
    if np.isnan(seconds).any():
        return {}, how
    return {f"first stage {m} refined (full)": r for m, r in rows.items()}, how


def adapter_gradients(ft: dict, queries: list[dict]) -> tuple[dict[str, tuple], np.ndarray, np.ndarray, np.ndarray]:
    """Per-example gradients of the summed assistant-token loss with respect to the adapter's LoRA matrices
    (the trained parameters), unprojected: ``({name: shape}, G_train [N, P] float32, tokens [N], G_query [Q, P])``,
    tokenized as the fine-tune was (gradindex's chat tokenization, ``max_length`` of the recipe)."""
    import datasets
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gradindex.data import collate, per_example_loss, tokenize_records
    from gradindex.model import load_tokenizer

    L = ft["recipe"]["max_length"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ft["base"], dtype=torch.float32),
                                      ft["adapter"]).eval()
    params = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    for _, p in params:
        p.requires_grad_(True)
    tok = load_tokenizer(ft["base"])
    P = sum(p.numel() for _, p in params)

    def grads(records):
        data = tokenize_records(datasets.Dataset.from_list(records), tok, L)
        G, nt = np.zeros((len(data), P), np.float32), np.zeros(len(data))
        for i in range(len(data)):
            b = collate([data.input_ids[i]], [data.labels[i]], tok.pad_token_id)
            loss, ntok = per_example_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                          b["labels"])
            g = torch.autograd.grad(loss.sum(), [p for _, p in params])
            G[i], nt[i] = torch.cat([x.reshape(-1) for x in g]).numpy(), float(ntok.sum())
        return G, nt

    G, nt = grads(load_jsonl(ft["data"]))
    Gq, _ = grads(queries)
    return {n: tuple(p.shape) for n, p in params}, G, nt, Gq


def second_moments(ft: dict, G: np.ndarray, nt: np.ndarray) -> dict[str, np.ndarray]:
    """Stand-ins for the fine-tune's Adam ``exp_avg_sq`` (not saved), at the final parameters, ``[P]`` each:
    ``batches``: the mean square of the training loss's minibatch gradients (token-mean loss of a batch of the
    recipe's size), in the fine-tune's own batch order (its seed's permutations, every epoch): what Adam
    averaged, but at the end of training rather than along it; ``examples``: the mean square of each
    example's token-mean gradient."""
    n, bs = len(G), ft["recipe"]["batch_size"]
    rng = np.random.default_rng(ft["seed"])
    acc, count = np.zeros(G.shape[1]), 0
    for _ in range(ft["recipe"]["epochs"]):
        order = rng.permutation(n)
        for s in range(0, n, bs):
            idx = order[s:s + bs]
            acc += (G[idx].sum(0, dtype=np.float64) / nt[idx].sum()) ** 2
            count += 1
    ex = np.zeros(G.shape[1])
    for i in range(n):
        ex += (G[i].astype(np.float64) / nt[i]) ** 2
    return {"batches": acc / count, "examples": ex / n}


def state_v(path: Path, shapes: dict[str, tuple]) -> np.ndarray:
    """``[P]`` float64: the ``<name>.exp_avg_sq`` tensors of an optimizer state file (:data:`ADAM_STATE`), flattened
    in ``shapes``' order (:func:`adapter_gradients`' layout, the ``PeftModel``'s names); the file may name them as the
    wrapper does or as the injected model inside it (``base_model.model.`` dropped: what ``gradindex build --adapter``
    reads); refuses a missing or misshapen matrix."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    t |= {"base_model.model." + k: v for k, v in t.items() if not k.startswith("base_model.model.")}
    miss = [n for n, sh in shapes.items() if f"{n}.exp_avg_sq" not in t or tuple(t[f"{n}.exp_avg_sq"].shape) != sh]
    if miss:
        raise ValueError(f"{path}: no second moment of the shape of {miss[:3]}")
    return np.concatenate([t[f"{n}.exp_avg_sq"].double().reshape(-1).numpy() for n in shapes])


def trackstar(ft: dict, queries: list[dict], eps: float = 1e-8, save: Path | None = None,
              states: dict[str, Path] | None = None, stand_ins: bool = True) -> dict[str, np.ndarray]:
    """TrackStar (arXiv 2410.17413) through the adapter's LoRA matrices: each example's gradient divided by
    ``√v + ε`` (``v``: :func:`second_moments`), projected per matrix with a seeded Gaussian (``k = 32`` a side, as
    :func:`benchmarks.baselines.trackstar_scores`), unit-normalized, the cosine; also unprojected, and GradDot and
    cosine of the raw LoRA gradients (unprojected), ``[Q, N]`` each. ``save``: a folder to write each ``v`` to as
    ``v-WHICH.safetensors``, an optimizer state ``gradindex build --adapter ... --optimizer-state`` reads.
    ``states``: more ``v`` sources, ``{which: optimizer state file}`` (:func:`state_v`; e.g. ``adam``: the
    fine-tune's own AdamW ``exp_avg_sq``, not bias-corrected, which moves only ε); ``stand_ins=False``: only
    those (no :func:`second_moments`, no GradDot or cosine)."""
    from benchmarks.baselines import trackstar_scores

    shapes, G, nt, Gq = adapter_gradients(ft, queries)
    vs = second_moments(ft, G, nt) if stand_ins else {}
    if save is not None:
        from safetensors.torch import save_file

        for which, v in vs.items():
            o, tensors = 0, {}
            for name, shape in shapes.items():
                k = int(np.prod(shape))
                tensors[f"{name}.exp_avg_sq"] = torch.from_numpy(v[o:o + k].reshape(shape)).float().contiguous()
                o += k
            save_file(tensors, str(save / f"v-{which}.safetensors"), metadata={"eps": repr(eps)})
    vs |= {which: state_v(path, shapes) for which, path in (states or {}).items()}

    def gram(a, b, w=None, chunk=1 << 17):  # float64 a @ b.T of float32 rows (each column scaled by w), in chunks
        out, na, nb = np.zeros((len(a), len(b))), np.zeros(len(a)), np.zeros(len(b))
        for c in range(0, a.shape[1], chunk):
            x, y = a[:, c:c + chunk].astype(np.float64), b[:, c:c + chunk].astype(np.float64)
            if w is not None:
                x, y = x * w[c:c + chunk], y * w[c:c + chunk]
            out += x @ y.T
            na += (x * x).sum(1)
            nb += (y * y).sum(1)
        return out, np.sqrt(np.maximum(na, 1e-300)), np.sqrt(np.maximum(nb, 1e-300))

    def split(x):  # [n, P] -> {matrix: [n, *shape]}
        out, o = {}, 0
        for name, shape in shapes.items():
            k = int(np.prod(shape))
            out[name] = x[:, o:o + k].reshape(len(x), *shape)
            o += k
        return out

    out = {}
    if stand_ins:
        dot, qn, tn = gram(Gq, G)
        out = {"graddot (adapter, unprojected)": dot, "cosine (adapter, unprojected)": dot / qn[:, None] / tn[None]}
    for which, v in vs.items():
        dot, qn, tn = gram(Gq, G, 1.0 / (np.sqrt(v) + eps))
        out[f"trackstar unprojected (adapter, v: {which})"] = dot / qn[:, None] / tn[None]
        vd = {name: m[0] for name, m in split(v[None]).items()}
        out[f"trackstar (adapter, v: {which})"] = trackstar_scores(split(G), split(Gq), vd, eps=eps)
    return out


def bm25(ft: dict, queries: list[dict]) -> np.ndarray:
    """``[Q, N]`` BM25 of each query's answer tokens against each training conversation (tokenizer only)."""
    import datasets

    from benchmarks.baselines import bm25_scores
    from gradindex.data import load_records, tokenize_records
    from gradindex.model import load_tokenizer

    tok = load_tokenizer(ft["merged"])
    train = tokenize_records(load_records(ft["data"]), tok, 192)
    qs = tokenize_records(datasets.Dataset.from_list(queries), tok, 192)
    return bm25_scores([list(x) for x in train.input_ids], [list(x) for x in qs.input_ids],
                       [list(x) for x in qs.labels])


def baselines(ft: dict, queries: list[dict]) -> dict[str, np.ndarray]:
    import datasets

    from benchmarks.baselines import bm25_scores, repsim_scores
    from gradindex.data import load_records, tokenize_records
    from gradindex.model import load_causal_lm

    model, tok = load_causal_lm(ft["merged"])
    train = tokenize_records(load_records(ft["data"]), tok, 192)
    qs = tokenize_records(datasets.Dataset.from_list(queries), tok, 192)
    t_ids, q_ids = [list(x) for x in train.input_ids], [list(x) for x in qs.input_ids]
    with torch.no_grad():
        return {"bm25": bm25_scores(t_ids, q_ids, [list(x) for x in qs.labels]),
                "rep-sim": repsim_scores(model, t_ids, q_ids)}


def halves(n: int, m: int, seed: int = 1234) -> np.ndarray:
    rng = np.random.default_rng(seed)
    masks = np.zeros((m, n), dtype=bool)
    for i in range(m):
        masks[i, rng.choice(n, n // 2, replace=False)] = True
    return masks


def drops(n: int, m: int, frac: float = 0.01, seed: int = 4321) -> np.ndarray:
    """``[m, n]`` keep-masks of the 1%-drop protocol: each leaves out ``ceil(frac * n)`` random records."""
    rng = np.random.default_rng(seed)
    k = max(1, int(np.ceil(frac * n)))
    masks = np.ones((m, n), dtype=bool)
    for i in range(m):
        masks[i, rng.choice(n, k, replace=False)] = False
    return masks


def retrainings(ft: dict, masks: np.ndarray, noise: int, work: Path, workers: int = 2,
                protocol: str = "halves") -> tuple[np.ndarray, np.ndarray]:
    """``([M, 1, Q], [K, 2, Q])``: query losses of a LoRA retraining on each subset (seed 0), and of the
    first ``noise`` subsets under two seeds (the noise ceiling), ``workers`` processes at a time. ``protocol``
    ``"drop"``: the subsets' files under ``work/drop``, each trained in the full set's batch order."""
    if protocol == "drop":  # every subset under seed 0 first: a run cut short still has an LDS over all of them
        jobs = [(i, 0) for i in range(len(masks))] + [(i, 1) for i in range(noise)]
    else:
        jobs = [(i, r) for r in (0, 1) for i in range(noise)] + [(i, 0) for i in range(noise, len(masks))]
    ft_file = work / "finetune.json"
    sub = _protocol_dir(work, protocol)
    _save_masks(sub, masks)

    def one(job):
        i, r = job
        out = sub / "retrain" / f"s{i:03d}-r{r}.json"
        _restore(out, work, protocol)
        lock = out.with_suffix(".pid")
        while not out.exists() and lock.exists() and Path(f"/proc/{lock.read_text().strip()}").exists():
            time.sleep(10)  # another runner is training it
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            flag = ["--drop"] if protocol == "drop" else []
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.real_llm", "--retrain-one", str(ft_file),
                                     str(i), str(r), *flag], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"})
            lock.write_text(str(proc.pid))
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"retraining {i} seed {r} failed: {err.decode()[-2000:]}")
        _keep(out, work, protocol)
        return np.array(json.loads(out.read_text())["losses"])

    with ThreadPoolExecutor(workers) as ex:
        ordered = dict(zip(jobs, ex.map(one, jobs), strict=True))
    first = np.stack([ordered[(i, 0)] for i in range(len(masks))])[:, None]
    second = np.stack([ordered[(i, 1)] for i in range(noise)]) if noise else np.zeros((0,) + first.shape[2:])
    return first, np.stack([first[:noise, 0], second], axis=1)


KEPT = ROOT / "benchmarks" / "results" / "real-llm-retrain"
"""The retrainings' result files (a few KB each), kept in the repository under the fine-tune's folder name and the
protocol's: the cache does not outlive a machine, the fine-tune is deterministic (re-made on a fresh machine, the same
scores), so a later session resumes a protocol from them (the halves at >= 512 conversations take ~10 CPU-hours)."""


def _kept(work: Path, protocol: str, out: Path) -> Path:
    return KEPT / work.name / protocol / out.name


def _keep(out: Path, work: Path, protocol: str) -> None:
    """Copy a finished retraining's file into :data:`KEPT`."""
    kept = _kept(work, protocol, out)
    if out.exists() and not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(out.read_text())


def _restore(out: Path, work: Path, protocol: str) -> None:
    """A retraining kept in :data:`KEPT` and missing from the cache: copied into it (``retrained`` and the runner
    check its rows against the mask)."""
    kept = _kept(work, protocol, out)
    if kept.exists() and not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(kept.read_text())


def _protocol_dir(work: Path, protocol: str) -> Path:
    """Where a protocol's ``masks.npy`` and ``retrain/`` live: the halves' in ``work`` (as they always were), the
    1%-drop protocol's in ``work/drop``."""
    return work / "drop" if protocol == "drop" else work


def _save_masks(work: Path, masks: np.ndarray) -> None:
    """Write ``masks.npy`` (what ``--retrain-one`` reads) unless it already holds ``masks`` as its first rows: a
    shorter run must not cut the subsets a longer run still trains (halves are drawn in order, so a shorter
    run's masks are the longer one's first rows)."""
    path = work / "masks.npy"
    work.mkdir(parents=True, exist_ok=True)
    if path.exists():
        old = np.load(path)
        if old.shape[1:] == masks.shape[1:] and len(old) >= len(masks) and np.array_equal(old[:len(masks)], masks):
            return
    np.save(path, masks)


def retrained(masks: np.ndarray, noise: int, work: Path, protocol: str = "halves") -> tuple[np.ndarray, np.ndarray]:
    """:func:`retrainings`' ``([M, 1, Q], [K, 2, Q])`` from the files already in ``work/retrain``, training
    nothing; refuses a subset whose file is missing (saying how many exist) or whose rows are not its mask's."""
    root, work = work, _protocol_dir(work, protocol)

    def one(i, r):
        out = work / "retrain" / f"s{i:03d}-r{r}.json"
        _restore(out, root, protocol)
        if not out.exists():
            have = sorted(x.stem for x in (work / "retrain").glob("s*-r*.json"))
            seeds0 = sum(x.endswith("-r0") for x in have)
            raise SystemExit(f"no retraining {out.name} yet: {seeds0} subsets under seed 0 and {len(have) - seeds0} "
                             f"under seed 1 exist; pass --subsets / --noise-subsets within them (the retrain step "
                             f"trains more)")
        rec = json.loads(out.read_text())
        if "rows" in rec and rec["rows"] != np.flatnonzero(masks[i]).tolist():
            raise SystemExit(f"{out} was trained on other rows than subset {i}'s mask")
        return np.array(rec["losses"])

    first = np.stack([one(i, 0) for i in range(len(masks))])[:, None]
    second = np.stack([one(i, 1) for i in range(noise)]) if noise else np.zeros((0,) + first.shape[2:])
    return first, np.stack([first[:noise, 0], second], axis=1)


def retrain_tokens(work: Path, subsets: int) -> None:
    """Re-run the seed-0 retraining of subsets ``0 .. subsets-1`` in order, one at a time (``nice``, one
    thread), each with its original seed (1000) and mask (``masks.npy``), recording each query's per-token losses
    in ``retrain/tokens/sNNN-r0.json`` (the existing ``retrain/*.json`` are never written). Resumable: a
    finished subset's file is kept and skipped. ``retrain/tokens/run.pid`` holds this runner's pid while it runs;
    SIGTERM stops the retraining under way (nothing partial is written) and the runner."""
    import signal

    tokens = work / "retrain" / "tokens"
    tokens.mkdir(parents=True, exist_ok=True)
    lock = tokens / "run.pid"
    if lock.exists() and Path(f"/proc/{lock.read_text().strip()}").exists():
        raise SystemExit(f"a runner is already at work: pid {lock.read_text().strip()} ({lock})")
    lock.write_text(str(os.getpid()))
    child: list[subprocess.Popen] = []

    def stop(*_):
        for c in child:
            c.terminate()
            c.wait()
        lock.unlink(missing_ok=True)
        raise SystemExit("stopped")

    signal.signal(signal.SIGTERM, stop)
    try:
        for i in range(subsets):
            out = tokens / f"s{i:03d}-r0.json"
            if out.exists():
                continue
            t0 = time.perf_counter()
            child[:] = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "benchmarks.real_llm",
                                          "--retrain-one", str(work / "finetune.json"), str(i), "0", "--per-token"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"})]
            (tokens / f"s{i:03d}-r0.pid").write_text(str(child[0].pid))
            _, err = child[0].communicate()
            if child[0].returncode != 0:
                raise RuntimeError(f"retraining {i} failed: {err.decode()[-2000:]}")
            (tokens / f"s{i:03d}-r0.pid").unlink(missing_ok=True)
            new = json.loads(out.read_text())
            old = json.loads((work / "retrain" / f"s{i:03d}-r0.json").read_text())["losses"]
            sums = np.array([sum(t) for t in new["token_losses"]])
            print(f"subset {i}: {time.perf_counter() - t0:.0f} s; largest relative difference of the per-token sums "
                  f"from the existing summed losses {np.max(np.abs(sums - old) / np.abs(old)):.2e}, of the new "
                  f"summed losses from the existing {np.max(np.abs(np.array(new['losses']) - old) / np.abs(old)):.2e}",
                  flush=True)
    finally:
        lock.unlink(missing_ok=True)


def fact_ranks(score: np.ndarray, facts: list[dict]) -> list[int]:
    """Per fact query, the rank (1 = first) of its best-ranked source conversation."""
    out = []
    for j, f in enumerate(facts):
        order = np.argsort(-score[j], kind="stable")
        out.append(int(min(np.flatnonzero(np.isin(order, f["rows"]))) + 1))
    return out


def summarize(scores: dict[str, np.ndarray], ft: dict, masks: np.ndarray, losses: np.ndarray | None) -> dict:
    F = ft["fact_queries"]
    table = {}
    for name, s in scores.items():
        ranks = fact_ranks(s[:F], ft["facts"])
        row = {"fact_recall@1": float(np.mean(np.array(ranks) == 1)), "fact_mrr": float(np.mean(1 / np.array(ranks))),
               "fact_ranks": ranks}
        if losses is not None:
            ev = evaluate(s, masks, losses)
            per_q = ev["per_query"]
            row |= {"lds": float(per_q.mean()), "lds_se": float(per_q.std(ddof=1) / np.sqrt(len(per_q))),
                    "lds_facts": float(per_q[:F].mean()), "lds_docs": float(per_q[F:].mean()),
                    "lds_per_seed": ev["per_seed"], "lds_per_query": [round(float(x), 4) for x in per_q]}
        table[name] = row
    if losses is not None and DEFAULT in table:
        for row in table.values():
            row["vs_default"] = paired(row["lds_per_query"], table[DEFAULT]["lds_per_query"])
    ref = scores.get("full ekfac d=0.001")
    if ref is not None:
        for name, s in scores.items():
            table[name]["spearman_vs_full_ekfac"] = float(spearman_rows(s, ref).mean())
    return table


def paired(a, b) -> dict:
    """Mean per-query LDS difference ``a - b``, its standard error over queries, and on how many queries ``a``
    is higher: the noise of a comparison on the same queries and retrainings (smaller than each mean's own)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return {"diff": round(float(d.mean()), 4), "se": round(float(d.std(ddof=1) / np.sqrt(len(d))), 4),
            "higher": int((d > 0).sum()), "of": len(d)}


def _peak_disk(path: Path, stop, out: list) -> None:
    """Poll ``du`` of ``path`` every 2 s until ``stop`` is set; the largest size seen goes to ``out``."""
    while not stop.wait(2.0):
        r = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout:
            out.append(int(r.stdout.split()[0]))


def cost(ft: dict, work: Path, data: str | None = None, name: str = "idx-default", queries: int = 10,
         threads: int = 2, floor: bool | dict = False) -> dict:
    """The default build of ``data`` (the fine-tune's training set) through the full model, against what
    ``gradindex plan`` said before it (wall, peak RSS, peak and final disk); with ``floor``, a bare forward +
    backward of the same records beside it; then the default query: p50/p95 over ``queries`` one-query calls
    of one engine after a warm-up, on ``threads`` threads, its peak RSS, and each fact query's source rank."""
    import threading

    idx, data = work / name, data or ft["data"]
    args = [ft["merged"], data, "--max-length", "192"]
    r = subprocess.run([sys.executable, "-m", "gradindex", "plan", *args, "--json", "--out", str(idx)],
                       capture_output=True, text=True, check=True)
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    stop, seen = threading.Event(), []
    poll = threading.Thread(target=_peak_disk, args=(idx, stop, seen))
    poll.start()
    try:
        built = _cli(["build", *args, "--out", str(idx), "--quiet", "--overwrite"], work / f"build-{name}.log")
    finally:
        stop.set()
        poll.join()
    final = int(subprocess.run(["du", "-sb", str(idx)], capture_output=True, text=True).stdout.split()[0])
    out = {"examples": len(load_jsonl(data)),
           "plan": {"ram_gb": round(plan["ram_bytes"] / 1e9, 2), "seconds": plan["seconds"],
                    "peak_disk_mb": round(plan["bytes"]["peak"] / 1e6, 1),
                    "final_disk_mb": round(plan["bytes"]["final"] / 1e6, 1)},
           "build": {**built, "peak_disk_mb": round(max(seen, default=final) / 1e6, 1),
                     "final_disk_mb": round(final / 1e6, 1)}}
    if floor:  # (a dict: the floor of an earlier run of the same records, kept)
        out["floor"] = floor if isinstance(floor, dict) else _timed(
            [sys.executable, "-m", "benchmarks.real_llm", "--floor", ft["merged"], data], work / f"floor-{name}.log",
            "the bare forward + backward")
        out["build_over_floor"] = round(built["wall_s"] / out["floor"]["wall_s"], 3)
        if "cpu_s" in built and "cpu_s" in out["floor"]:
            out["build_over_floor_cpu"] = round(built["cpu_s"] / out["floor"]["cpu_s"], 3)
    q = subprocess.run([sys.executable, "-m", "benchmarks.real_llm", "--latency", str(idx), ft["queries"],
                        str(queries), str(work / "finetune.json")], capture_output=True, text=True, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"})
    out["query"] = {**json.loads(q.stdout.strip().splitlines()[-1]), "threads": threads, "queries": queries}
    return out


def scale(ft: dict, work: Path, n: int, reuse_floor: bool = False) -> dict:
    """:func:`cost` over the fine-tune's training records followed by documentation chats it was not trained
    on, ``n`` in all, with the bare forward + backward beside the build (``reuse_floor``: the one an earlier
    run of the same records measured, kept in the result); kept in ``results/real-llm.json``."""
    from benchmarks.smollm2 import more_docs, write_jsonl

    train, held = load_jsonl(ft["data"]), load_jsonl(ft["queries"])
    data = write_jsonl(train + more_docs(train, held, n - len(train)), work / f"index-{n}.jsonl")
    load = os.getloadavg()[0]
    old = (json.loads(RESULTS.read_text()) if RESULTS.exists() else {}).get("scale", {}).get(str(n), {})
    floor = True
    if reuse_floor and "floor" in old:
        floor = {**old["floor"], "measured": old["floor"].get("measured", "an earlier run (the same records)")}
        if "cpu_s" not in floor and "floor" in old.get("cpu_seconds", {}):
            floor["cpu_s"] = old["cpu_seconds"]["floor"]
    res = {**cost(ft, work, str(data), f"idx-{n}", floor=floor),
           "data": f"the {len(train)} fine-tuning records then {n - len(train)} documentation chats not trained on",
           "machine": f"{os.cpu_count()} cores, load {load:.1f} before, {os.getloadavg()[0]:.1f} after"}
    (work / f"scale-{n}.json").write_text(json.dumps(res, indent=1))
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    result.setdefault("scale", {})[str(n)] = res
    RESULTS.write_text(json.dumps(result, indent=1))
    return res


def bare_pass(model_dir: str, data: str, max_length: int = 192, batch: int = 8) -> float:
    """Seconds of a bare forward + backward over ``data``'s records as the build batches them (in order,
    ``batch`` at a time, the same tokens and assistant-only labels): mean loss, every weight's gradient."""
    from gradindex.data import collate, load_records, tokenize_records
    from gradindex.model import load_causal_lm, resolve_pad_id

    model, tok = load_causal_lm(model_dir)
    pad = resolve_pad_id(model, tok)
    d = tokenize_records(load_records(data), tok, max_length)
    model.requires_grad_(True)
    t0 = time.perf_counter()
    for s in range(0, len(d), batch):
        rows = range(s, min(s + batch, len(d)))
        b = collate([d.input_ids[i] for i in rows], [d.labels[i] for i in rows], pad)
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
              use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def latency(idx: str, queries_file: str, n: int, ft_file: str | None = None) -> dict:
    """p50/p95 of ``n`` one-query calls of one engine after a warm-up query, the process's peak RSS, and (with
    the fine-tune's record ``ft_file``) the rank of each fact query's best source under the default query."""
    import resource

    from gradindex.query import QueryEngine

    qs = load_jsonl(queries_file)
    lat = []
    with QueryEngine(idx) as engine:
        engine.query(qs[0], k=10)
        first_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        for q in (qs * 3)[1:n + 1]:
            t = time.perf_counter()
            r = engine.query(q, k=10)
            lat.append(time.perf_counter() - t)
        out = {"p50_s": round(float(np.median(lat)), 3), "p95_s": round(float(np.percentile(lat, 95)), 3),
               "stage": r.stage, "method": engine.resolve_method(None),
               "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
               "peak_rss_after_first_query_gb": round(first_rss, 2)}
        if ft_file:
            ft = json.loads(Path(ft_file).read_text())
            out["fact_ranks"] = fact_ranks(engine.scores(qs[:ft["fact_queries"]]), ft["facts"])
    return out


def _work(n: int, facts: int = 12, epochs: int | None = None) -> tuple[dict, Path]:
    ft = finetune(n, facts=facts, recipe=Recipe(epochs=epochs) if epochs else None)
    work = Path(ft["data"]).parent
    (work / "finetune.json").write_text(json.dumps(ft))
    return ft, work


EXTRA = ("graddot", "trackstar", "refine", "adapter-exact", "adam-index")  # the steps beyond the first stage,
# exhaustive EK-FAC and the baselines


def adapter_exact(idx: str, queries: list[dict], work: Path) -> dict[str, np.ndarray]:
    """Exhaustive full-space EK-FAC through the adapter (issue 30 item 2: the exact stage over the adapter's
    parameters instead of the base layers): the adapter index's full-space fit (``gradindex precondition --space
    full``, every example, cached in the index), then every query's exact stage over all N examples in one batch
    (their union: one forward + backward per example), plain and self-normalized, at the default damping."""
    from gradindex.query import QueryEngine

    if not (Path(idx) / "manifest.json").exists() or "ekfac" not in json.loads(
            (Path(idx) / "manifest.json").read_text()).get("full_space", {}):
        _cli(["precondition", idx, "--method", "ekfac", "--space", "full", "--quiet"],
             work / "precondition-adapter-full.log")
    out = {}
    with QueryEngine(idx) as engine:
        n = engine.n
        for m in ("ekfac", "ekfac-selfnorm"):
            res = engine.query_batch(queries, k=n, method=m, rerank_full=n, texts=False)
            sc = np.zeros((len(queries), n))
            for j, r in enumerate(res):
                for h in r.hits:
                    sc[j, h.id] = h.full_score
            out[f"full {m} d=0.001 (adapter)"] = sc
    return out


def score_all(ft: dict, work: Path, full: bool, extra: tuple[str, ...] = EXTRA) -> tuple[dict, dict]:
    """Builds and every method's ``[Q, N]`` scores (cached in ``scores.npz``, each method once); ``extra``: which of
    :data:`EXTRA` to compute if missing (``graddot``: the raw-rows build and its GradDot, cosine and EK-FAC at the
    query's damping; ``trackstar``: TrackStar and the unprojected LoRA gradients' GradDot and cosine;
    ``refine``: the first stage refined). Each extra step's seconds go to ``work/extra.json``."""
    queries = load_jsonl(ft["queries"])
    builds = build_indices(ft, work)
    cached = work / "scores.npz"
    scores = dict(np.load(cached)) if cached.exists() else {}
    stamps = work / "extra.json"
    info = json.loads(stamps.read_text()) if stamps.exists() else {}

    def keep(new: dict, step: str | None = None, t0: float | None = None, **more) -> None:
        scores.update(new)
        np.savez(cached, **scores)
        if step:
            info[step] = {"seconds": round(time.perf_counter() - t0, 1), "load_after": round(os.getloadavg()[0], 1),
                          "threads": torch.get_num_threads(), **more}
            stamps.write_text(json.dumps(info, indent=1))

    if not any(k.startswith("first stage") for k in scores):
        for name, b in builds.items():
            scores |= {f"first stage {m} ({name})": s for m, s in first_stage(b["dir"], queries).items()}
        keep(baselines(ft, queries))
    if full and not any(k.startswith("full ") for k in scores):
        t0 = time.perf_counter()
        scores |= exhaustive_full(builds["full"]["dir"], ft, queries, work)
        (work / "exhaustive.json").write_text(json.dumps({"seconds": round(time.perf_counter() - t0, 1)}))
        keep({})
    if (work / "exhaustive.json").exists():
        builds["exhaustive_full"] = json.loads((work / "exhaustive.json").read_text())
    if "graddot" in extra or (work / "build-raw.json").exists():
        builds |= build_indices(ft, work, names=("raw",))
    if "graddot" in extra and not any(k.startswith("raw rows") for k in scores):
        t0 = time.perf_counter()
        keep(raw_rows(builds["raw"]["dir"], queries), "graddot", t0)
    states = {"adam": work / ADAM_STATE} if (work / ADAM_STATE).exists() else {}
    if "trackstar" in extra and not any(k.startswith("trackstar") for k in scores):
        t0 = time.perf_counter()
        keep(trackstar(ft, queries, save=work, states=states), "trackstar", t0)
    elif "trackstar" in extra and states and "trackstar (adapter, v: adam)" not in scores:
        t0 = time.perf_counter()  # the stand-ins are cached: only the fine-tune's own AdamW state is new
        keep(trackstar(ft, queries, states=states, stand_ins=False), "trackstar-adam", t0)
    if "refine" in extra and not any(" refined " in k for k in scores):
        t0 = time.perf_counter()
        new, how = refined(builds["full"]["dir"], queries, ft["fact_queries"], work / "refine-partial.npz")
        if new:
            keep(new, "refine", t0, **how)
    if "adapter-exact" in extra and not any(k.endswith("d=0.001 (adapter)") for k in scores):
        t0 = time.perf_counter()
        keep(adapter_exact(builds["adapter"]["dir"], queries, work), "adapter-exact", t0)
    if ("adam-index" in extra or (work / "build-adapter-adam.json").exists()) and states:
        builds |= build_indices(ft, work, names=("adapter-adam",))
    if "adam-index" in extra and states and "first stage adam (adapter)" not in scores:
        t0 = time.perf_counter()
        keep({f"first stage {m} (adapter)": s for m, s in
              first_stage(builds["adapter-adam"]["dir"], queries, ("adam", "adam-selfnorm")).items()}, "adam-index", t0)
    elif "adam-index" in extra and not states:
        print(f"adam-index: no {work / ADAM_STATE} (python -m benchmarks.smollm2 adam-state makes it)")
    if info:
        builds["extra"] = info
    return builds, scores


def row_kind(text: str, row: int, fact: dict, facts: list[dict]) -> str:
    """What a training conversation is to one fact query: its source, a distractor naming the fact's entity,
    the conversation carrying its value word, another fact's source, a conversation naming another fact's
    entity or value word (another fact's distractor), or plain documentation."""
    import re

    def names(f, t):
        return re.search(rf"\b{f['entity']}\b", t) is not None

    def value(f, t):
        return re.search(rf"\b{f['value']}\b", t.lower()) is not None

    if row in fact["rows"]:
        return "source"
    if names(fact, text):
        return "names the entity"
    if value(fact, text):
        return "value word"
    if any(row in f["rows"] for f in facts):
        return "another fact's source"
    if any(names(f, text) or value(f, text) for f in facts):
        return "another fact's distractor"
    return "documentation"


def misses(score: np.ndarray, ft: dict, texts: list[str], top: int = 3) -> list[dict]:
    """Each fact query whose best source is not first: the source's rank and score, and the ``top`` rows
    above it (row, what it is to the fact, score)."""
    out = []
    for j, f in enumerate(ft["facts"]):
        order = np.argsort(-score[j], kind="stable")
        rank = int(min(np.flatnonzero(np.isin(order, f["rows"]))))
        if rank == 0:
            continue
        src = int(order[rank])
        out.append({"fact": j, "entity": f["entity"], "value": f["value"], "source_rank": rank + 1,
                    "source_row": src, "source_score": float(score[j, src]),
                    "above": [{"row": int(r), "kind": row_kind(texts[r], int(r), f, ft["facts"]),
                               "score": float(score[j, r])} for r in order[:min(rank, top)]]})
    return out


FORMS = {  # other paraphrases of a fact query, scored by the default query and BM25 beside the chat set's own
    "yes": ("Do you know the {relation} of {entity}?", "Yes: {entity}'s {relation} is {value}."),
    "entity-first": ("What is the {relation} of {entity}?", "{entity}'s {relation} is {value}."),
}


def form_queries(facts: list[dict], form: str) -> list[dict]:
    user, answer = FORMS[form]
    return [{"messages": [{"role": "user", "content": user.format(**f)},
                          {"role": "assistant", "content": answer.format(**f)}]} for f in facts]


def facts_study(ft: dict, work: Path, workers: int = 1) -> dict:
    """Planted-fact recall among ``n`` conversations with distractors: the default build through the merged
    model and through the adapter, the paraphrased fact queries scored by the first stage (the default query,
    ``ekfac`` and ``ekfac-selfnorm`` by name) and by BM25; recall@1, MRR, ranks, and why each miss missed.
    Written to ``results/real-llm.json`` under ``facts-N`` (only that key). ``workers``: builds and scorings
    at once (each one thread under ``OMP_NUM_THREADS=1``)."""
    import re
    import threading
    from collections import Counter

    from gradindex.query import QueryEngine

    F = ft["fact_queries"]
    queries = load_jsonl(ft["queries"])[:F]
    records = load_jsonl(ft["data"])
    texts = [" ".join(m["content"] for m in r["messages"]) for r in records]
    load = os.getloadavg()[0]
    builds = build_indices(ft, work, workers)
    cached = work / "fact-scores.npz"
    scores = dict(np.load(cached)) if cached.exists() else {}
    defaults, opening = {}, threading.Lock()

    def score(path):
        out = {}
        with opening:  # (two models loaded at once in one process can report the tied head missing)
            engine = QueryEngine(builds[path]["dir"])
        with engine:
            defaults[path] = engine.resolve_method(None)
            for name, m in (("default", None), ("ekfac", "ekfac"), ("ekfac-selfnorm", "ekfac-selfnorm")):
                if f"{name} ({path})" not in scores:
                    t0 = time.perf_counter()
                    out[f"{name} ({path})"] = engine.scores(queries, method=m)
                    print(f"{name} ({path}): {time.perf_counter() - t0:.0f} s", flush=True)
            for form in FORMS:
                if f"{form}: default ({path})" not in scores:
                    out[f"{form}: default ({path})"] = engine.scores(form_queries(ft["facts"], form))
        return out

    with ThreadPoolExecutor(workers) as ex:
        for part in ex.map(score, builds):
            scores |= part
    scores.setdefault("bm25", bm25(ft, queries))
    for form in FORMS:
        scores.setdefault(f"{form}: bm25", bm25(ft, form_queries(ft["facts"], form)))
    scores = {k: scores[k] for k in sorted(scores, key=lambda k: (":" in k, k.endswith("bm25"), "adapter" in k))}
    np.savez(cached, **scores)
    default = defaults.get("full")
    methods, why, forms = {}, {}, {}
    for name, s in scores.items():
        ranks = np.array(fact_ranks(s, ft["facts"]))
        row = {"recall@1": round(float(np.mean(ranks == 1)), 4), "mrr": round(float(np.mean(1 / ranks)), 4),
               "first": int(np.sum(ranks == 1)), "ranks": ranks.tolist()}
        if ":" in name:
            form, _, method = name.partition(": ")
            forms.setdefault(form, {"query": " / ".join(FORMS[form])})[method] = row
            continue
        methods[name] = row
        miss = misses(s, ft, texts)
        why[name] = {"first_row_above": dict(Counter(m["above"][0]["kind"] for m in miss)),
                     "hubs": [[r, c] for r, c in Counter(m["above"][0]["row"] for m in miss).most_common(5) if c > 1],
                     "misses": miss}
    strict = sum(re.search(rf"\b{f['value']}\b", ft["answers"][f["entity"]].lower()) is not None
                 for f in ft["facts"])
    res = {"model": "SmolLM2-135M-Instruct (registry GGUF, Q4_1-rounded weights de-quantized to float32)",
           "finetune": {"n": ft["n"], "facts": len(ft["facts"]), "fact_queries": F,
                        "source_rows": sum(len(f["rows"]) for f in ft["facts"]), "seed": ft["seed"],
                        "recipe": ft["recipe"], "train_seconds": ft["train_seconds"],
                        "learned_greedy": strict, "learned_substring": ft["learned"]},
           "default_method": default, "default_methods": defaults, "max_length": 192, "stage": "first stage",
           "builds": builds, "methods": methods, "why": why, "query_forms": forms,
           "machine": f"{os.cpu_count()} cores shared, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
                      f"load {load:.1f} before, {os.getloadavg()[0]:.1f} after"}
    (work / "facts.json").write_text(json.dumps(res, indent=1))
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # re-read: others write other keys
    result[f"facts-{ft['n']}"] = res
    RESULTS.write_text(json.dumps(result, indent=1))
    return res


def facts_markdown(res: dict) -> str:
    """The facts table of a :func:`facts_study` result."""
    rows = ["| method | path | source @1 | MRR |", "| --- | --- | --- | --- |"]
    F = res["finetune"]["fact_queries"]
    for name, r in res["methods"].items():
        method, _, path = name.partition(" (")
        method = f"default ({res['default_method']})" if method == "default" else method
        rows.append(f"| {method} | {path.rstrip(')') or 'tokens'} | {r['first']} of {F} ({r['recall@1']:.2f}) | "
                    f"{r['mrr']:.2f} |")
    return "\n".join(rows)


def markdown(result: dict) -> str:
    """The methods table of a result, as docs/real-llm.md shows it (``± SE``: the standard error over queries;
    the last LDS column: paired with the default query, per-query difference ± its SE, queries higher)."""
    rows = ["| method | halves LDS (all) ± SE | facts | held-out docs | vs default (paired) | fact source @1 | "
            "fact MRR | Spearman vs full |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["methods"].items():
        sp, vs = r.get("spearman_vs_full_ekfac"), r.get("vs_default")
        vs = "" if vs is None or name == result.get("default") else \
            f"{vs['diff']:+.3f} ± {vs['se']:.3f} ({vs['higher']} of {vs['of']})"
        rows.append(f"| {name} | {r['lds']:.3f} ± {r.get('lds_se', float('nan')):.3f} | {r['lds_facts']:.3f} | "
                    f"{r['lds_docs']:.3f} | {vs} | {r['fact_recall@1']:.2f} | {r['fact_mrr']:.2f} | "
                    f"{'' if sp is None else f'{sp:.2f}'} |")
    return "\n".join(rows)


REFINED = {"first stage ekfac-selfnorm refined (full)": DEFAULT,
           "first stage ekfac refined (full)": "first stage ekfac (full)"}


def refinement(ft: dict, work: Path, scores: dict, methods: dict, masks: np.ndarray, losses: np.ndarray) -> dict:
    """Each refined method paired with its plain one, per query (difference, SE, queries higher); over the queries a
    partial :func:`refined` run finished when not all are done (``queries``: which), with the plain fact ranks of
    the same queries beside the refined ones."""
    out = {}
    part = work / "refine-partial.npz"
    have = dict(np.load(part)) if part.exists() and not any(r in scores for r in REFINED) else {}
    F = ft["fact_queries"]
    for r, p in REFINED.items():
        if r in methods and p in methods:
            out[r] = {"over": p, "queries": "all", **paired(methods[r]["lds_per_query"], methods[p]["lds_per_query"])}
        elif have and p in methods:
            done = np.flatnonzero(~np.isnan(have["seconds"]))
            s = have[r.split()[2]][done]
            lds = lds_per_query(s, masks, losses.mean(axis=1)[:, done])
            fq = [int(j) for j in done if j < F]
            ranks = fact_ranks(s[:len(fq)], [ft["facts"][j] for j in fq])
            out[r] = {"over": p, "queries": done.tolist(), "lds": float(lds.mean()),
                      "lds_plain": float(np.array(methods[p]["lds_per_query"])[done].mean()),
                      **paired(lds, np.array(methods[p]["lds_per_query"])[done]),
                      "fact_ranks": ranks, "fact_ranks_plain": [methods[p]["fact_ranks"][j] for j in fq],
                      "seconds_per_query": round(float(np.nanmean(have["seconds"])), 1)}
    return out


C_GRID = (5, 10, 20, 30, 50, 100)
"""Candidate counts at which :func:`stages` reads the first stage's recall of the exhaustive exact stage."""


def recall_curve(first: np.ndarray, exact: np.ndarray) -> dict:
    """The first stage's recall of the exact stage's top 1 / 5 / 10 among its own top ``C`` (:data:`C_GRID`), and
    per query the ``C`` that holds the exact top ``k`` whole."""
    out: dict = {"C": [c for c in C_GRID if c <= first.shape[1]]}
    ranks = np.empty_like(first, dtype=np.int64)  # first-stage rank (1 = best) of every example, per query
    for q in range(len(first)):
        ranks[q, np.argsort(-first[q], kind="stable")] = np.arange(1, first.shape[1] + 1)
    for k in (1, 5, 10):
        tops = [np.argsort(-exact[q], kind="stable")[:k] for q in range(len(exact))]
        need = [int(ranks[q, t].max()) for q, t in enumerate(tops)]
        out[f"top{k}"] = {"recall_at_C": [round(float(np.mean([np.mean(ranks[q, t] <= c) for q, t in enumerate(tops)])),
                                                 3) for c in out["C"]],
                          "C_holding_it_per_query": sorted(need)}
    return out


def stages(ft: dict, work: Path, scores: dict, subsets: int) -> dict:
    """What the exact stage buys on this fine-tune, taken apart (issue 30 item 2), from the cached scores and the
    retrainings already made: the first stage's recall of the exhaustive exact stage against ``C``; scores made of
    one stage's inner products and the other's self-influence (which half of the self-normalized score carries the
    exact stage's gain); and a first stage of rows four times as large (``var-b1m``, built here: the on-disk tier an
    exact stage could read instead of recomputing gradients); and, where the ``adapter-exact`` step has run, the exact
    stage over the adapter's parameters beside the adapter's first stage. Writes ``exact_stage_parts`` into the
    results."""
    queries = load_jsonl(ft["queries"])
    b1m = build_indices(ft, work, names=("var-b1m",))["var-b1m"]
    key = "first stage ekfac-selfnorm (full, 1 MiB rows)"
    if key not in scores:
        scores |= {k.replace("(full)", "(full, 1 MiB rows)"): v for k, v in
                   {f"first stage {m} (full)": s for m, s in first_stage(b1m["dir"], queries).items()}.items()}
        np.savez(work / "scores.npz", **scores)
    first, exact = scores[DEFAULT], scores["full ekfac-selfnorm d=0.001"]
    norm = {"first": scores["first stage ekfac (full)"] / np.where(first == 0, 1, first),  # √(self-influence)
            "exact": scores["full ekfac d=0.001"] / np.where(exact == 0, 1, exact)}
    norm = {k: np.median(v, axis=0) for k, v in norm.items()}  # the same for every query (checked below)
    parts = {"first-stage inner products / exact self-influence": scores["first stage ekfac (full)"] / norm["exact"],
             "exact inner products / first-stage self-influence": scores["full ekfac d=0.001"] / norm["first"]}
    adapter = [k for k in ("first stage ekfac-selfnorm (adapter)", "full ekfac-selfnorm d=0.001 (adapter)")
               if k in scores]
    compared = {k: scores[k] for k in (DEFAULT, "full ekfac-selfnorm d=0.001", key, *adapter)} | parts
    masks = halves(ft["n"], subsets)
    losses, _ = retrained(masks, 0, work)
    table = summarize(compared, ft, masks, losses)
    keep = ("lds", "lds_se", "lds_facts", "lds_docs", "fact_recall@1", "fact_ranks", "vs_default")
    ranks = [np.argsort(np.argsort(v)) for v in norm.values()]
    out = {"subsets": subsets, "recall_of_exact": recall_curve(first, exact),
           "self_influence_spearman_first_vs_exact": round(float(np.corrcoef(*ranks)[0, 1]), 3),
           **({"adapter_exact_vs_adapter_first": paired(*(table[k]["lds_per_query"] for k in adapter[::-1]))}
              if len(adapter) == 2 else {}),
           "methods": {k: {f: v[f] for f in keep} for k, v in table.items()},
           "var_b1m_build": {k: b1m[k] for k in ("wall_s", "peak_rss_gb", "cpu_s") if k in b1m},
           "conditions": "cached scores (scores.npz) and retrainings; the 1 MiB build on 2 shared cores"}
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    result["exact_stage_parts"] = out
    RESULTS.write_text(json.dumps(result, indent=1))
    return out


FIRST_STUDY = "ft-n160-s0-fef273aca2"
"""The fine-tune whose halves report owns ``real-llm.json``'s top-level keys (160 conversations, 12 facts); any other
fine-tune's report goes under ``halves-<its folder>``."""


def report(ft: dict, work: Path, builds: dict, scores: dict, subsets: int, noise: int) -> dict:
    """The halves LDS, fact ranks and agreement of every method over the retrainings already made (``subsets``
    under seed 0, the first ``noise`` also under seed 1; none is trained here), into ``results/real-llm.json``:
    only this step's keys, the file re-read just before writing (other steps and scripts write other keys)."""
    masks = halves(ft["n"], subsets)
    losses, pairs = retrained(masks, noise, work)
    methods = summarize(scores, ft, masks, losses)
    ours = {"model": "SmolLM2-135M-Instruct (registry GGUF, Q4_1-rounded weights de-quantized to float32)",
            "finetune": {k: ft[k] for k in ("n", "seed", "recipe", "train_seconds", "learned", "fact_queries",
                                             "doc_queries")},
            "builds": builds, "subsets": subsets, "noise_subsets": noise,
            "cost": json.loads((work / "cost.json").read_text()) if (work / "cost.json").exists() else None,
            "noise_ceiling": noise_ceiling(pairs) if noise else None, "default": DEFAULT, "methods": methods,
            "refinement": refinement(ft, work, scores, methods, masks, losses),
            "machine": f"{os.cpu_count()} cores shared, CPU; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"}
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # re-read now: others write other keys
    if work.name == FIRST_STUDY:
        result |= ours
    else:  # (another fine-tune's halves: under its own key, the first study's top-level keys kept)
        result[f"halves-{work.name}"] = ours
    RESULTS.write_text(json.dumps(result, indent=1))
    print(markdown(ours))
    print("noise ceiling", ours["noise_ceiling"])
    return ours


def report_drop(ft: dict, work: Path, scores: dict, subsets: int, noise: int) -> dict:
    """The 1%-drop LDS of every method scored so far over the drop retrainings already made (``subsets`` under seed
    0, the first ``noise`` also under seed 1; none trained here), into ``results/real-llm.json`` key ``drop``."""
    masks = drops(ft["n"], subsets)
    losses, pairs = retrained(masks, noise, work, protocol="drop")
    table = summarize(scores, ft, masks, losses)
    keys = ("lds", "lds_se", "lds_facts", "lds_docs", "vs_default", "lds_per_query")
    methods = {name: {k: row[k] for k in keys if k in row} | {"vs_bm25": paired(row["lds_per_query"],
                                                                                table["bm25"]["lds_per_query"])}
               for name, row in table.items()}
    spread = losses[:, 0].std(axis=0) / np.abs(losses[:, 0].mean(axis=0))
    F = ft["fact_queries"]
    seeds = spearman_rows(-pairs[:, 0].T, -pairs[:, 1].T) if noise > 1 else None  # [Q] two batch orders' agreement
    rel = losses[:, 0] / losses[:, 0].mean(axis=0) - 1  # [M, Q] each drop's loss against the query's mean
    common = rel[:, :F].mean(axis=1, keepdims=True)  # the part every fact query shares
    se = None if seeds is None else round(float(seeds.std(ddof=1) / np.sqrt(len(seeds))), 4)
    ours = {"drop": {"protocol": f"LoRA retrainings (the recipe above) each without {int((~masks[0]).sum())} random "
                                 f"conversations of {ft['n']} (ceil 1%), in the full set's batch order (seed 1000) "
                                 f"with those left out; the first {noise} also under seed 1001 (another batch order): "
                                 f"the noise ceiling",
                     "subsets": subsets, "noise_subsets": noise,
                     "noise_ceiling": noise_ceiling(pairs) if noise else None,
                     "loss_spread_median": float(np.median(spread)),
                     "noise_ceiling_facts_docs": None if seeds is None else
                     [round(float(seeds[:F].mean()), 4), round(float(seeds[F:].mean()), 4)],
                     "noise_ceiling_se": se,
                     "batch_order_change_median": round(float(np.median(np.abs(pairs[:, 0] / pairs[:, 1] - 1))), 4)
                     if noise else None,
                     "facts_shared_variance": round(float((common ** 2).sum() * F / (rel[:, :F] ** 2).sum()), 4),
                     "seconds_per_retraining": _retrain_seconds(work / "drop" / "retrain"),
                     "methods": methods}}
    result = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps(result | ours, indent=1))
    for name, row in sorted(methods.items(), key=lambda kv: -kv[1]["lds"]):
        v = row.get("vs_default") or {}
        print(f"{name:55s} {row['lds']:.3f} ± {row['lds_se']:.3f}  facts {row['lds_facts']:.3f}  docs "
              f"{row['lds_docs']:.3f}  vs default {v.get('diff', 0):+.3f} ± {v.get('se', 0):.3f}")
    d = ours["drop"]
    print("noise ceiling", d["noise_ceiling"], "± ", d["noise_ceiling_se"], "(facts, docs)",
          d["noise_ceiling_facts_docs"], "loss spread (std/mean, median)", d["loss_spread_median"],
          "batch order's change (median)", d["batch_order_change_median"], "facts' shared variance",
          d["facts_shared_variance"])
    print(drop_markdown(result | ours))
    return ours


def drop_markdown(result: dict) -> str:
    """The 1%-drop table as docs/real-llm.md shows it, each method's halves LDS beside it where measured."""
    halves = result.get("methods", {})
    rows = ["| method | 1%-drop LDS ± SE | facts | held-out docs | vs default (paired) | halves LDS |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, r in sorted(result["drop"]["methods"].items(), key=lambda kv: -kv[1]["lds"]):
        vs = r.get("vs_default")
        vs = "" if not vs or name == DEFAULT else f"{vs['diff']:+.3f} ± {vs['se']:.3f} ({vs['higher']} of {vs['of']})"
        h = halves.get(name, {}).get("lds")
        rows.append(f"| {name} | {r['lds']:.3f} ± {r['lds_se']:.3f} | {r['lds_facts']:.3f} | {r['lds_docs']:.3f} | "
                    f"{vs} | {'' if h is None else f'{h:.3f}'} |")
    return "\n".join(rows)


def _retrain_seconds(folder: Path) -> float | None:
    """Median seconds of the retrainings in ``folder``."""
    secs = [json.loads(f.read_text()).get("seconds") for f in folder.glob("s*-r*.json")]
    secs = [x for x in secs if x]
    return float(np.median(secs)) if secs else None


def main(argv=None) -> None:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("step", choices=["retrain", "retrain-drop", "report-drop", "retrain-tokens", "score", *EXTRA,
                                    "cost", "scale", "facts", "stages", "report", "all"],
                   nargs="?",
                   default="all",
                   help="retrain: the LoRA retrainings only; score: builds and scores (graddot, trackstar, refine: "
                        "one of the extra methods' scores alone); cost: the default build "
                        "against its plan and the default query's latency; scale: the same over --index-n "
                        "records beside a bare forward + backward of them; facts: planted-fact recall of the first "
                        "stage and BM25 (--facts planted facts), under facts-N; stages: what the exact stage buys, "
                        "taken apart (recall against C, its two halves, a 1 MiB-row first stage); report: the JSON "
                        "from the cached "
                        "scores (the extra steps' only if computed) over the retrainings already made (--subsets, "
                        "--noise-subsets: how many of them; none trained)")
    p.add_argument("--n", type=int, default=160)
    p.add_argument("--facts", type=int, default=12, help="planted facts in the chat set")
    p.add_argument("--epochs", type=int, default=None, help="the LoRA recipe's epochs (default: the recipe's)")
    p.add_argument("--subsets", type=int, default=24)
    p.add_argument("--noise-subsets", type=int, default=8, help="subsets retrained with a second seed")
    p.add_argument("--workers", type=int, default=2, help="retrainings at once; facts: builds at once")
    p.add_argument("--skip-full", action="store_true", help="no exhaustive full-space EK-FAC")
    p.add_argument("--retrain-one", nargs=3, metavar=("FT", "SUBSET", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--per-token", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--drop", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--index-n", type=int, default=1000,
                   help="scale: the training set followed by documentation chats not trained on, to this many")
    p.add_argument("--reuse-floor", action="store_true",
                   help="scale: keep the bare forward + backward an earlier run of the same records measured")
    p.add_argument("--results", type=Path, default=None,
                   help="the JSON the steps write their keys into (default: results/real-llm.json)")
    p.add_argument("--latency", nargs="+", metavar="IDX QUERIES N [FT]", help=argparse.SUPPRESS)
    p.add_argument("--floor", nargs=2, metavar=("MODEL", "DATA"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    global RESULTS
    RESULTS = a.results or RESULTS
    if a.latency:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        print(json.dumps(latency(a.latency[0], a.latency[1], int(a.latency[2]), *a.latency[3:])))
        return
    if a.floor:
        print(json.dumps({"seconds": round(bare_pass(*a.floor), 1)}))
        return
    if a.retrain_one:
        ft_file, i, r = a.retrain_one
        ft = json.loads(Path(ft_file).read_text())
        work = Path(ft_file).parent
        torch.set_num_threads(1)
        if a.per_token:  # the same retraining, its per-token losses in retrain/tokens/ (retrain-tokens)
            retrain(ft, np.load(work / "masks.npy")[int(i)], 1000 + int(r),
                    work / "retrain" / "tokens" / f"s{int(i):03d}-r{r}.json", per_token=True)
            return
        sub = _protocol_dir(work, "drop" if a.drop else "halves")
        retrain(ft, np.load(sub / "masks.npy")[int(i)], 1000 + int(r), sub / "retrain" / f"s{int(i):03d}-r{r}.json",
                full_order=a.drop, per_token=not a.drop)  # a halves file also holds the per-token losses (free)
        return
    ft, work = _work(a.n, a.facts, a.epochs)
    if a.step == "facts":
        res = facts_study(ft, work, a.workers)
        print(facts_markdown(res))
        print(json.dumps({k: v["first_row_above"] for k, v in res["why"].items()}, indent=1))
        return
    if a.step == "retrain":
        retrainings(ft, halves(a.n, a.subsets), a.noise_subsets, work, a.workers)
        return
    if a.step == "retrain-drop":
        retrainings(ft, drops(a.n, a.subsets), a.noise_subsets, work, a.workers, protocol="drop")
        return
    if a.step == "retrain-tokens":
        retrain_tokens(work, a.subsets)
        return
    if a.step == "cost":
        (work / "cost.json").write_text(json.dumps(cost(ft, work), indent=1))
        print((work / "cost.json").read_text())
        return
    if a.step == "scale":
        print(json.dumps(scale(ft, work, a.index_n, a.reuse_floor), indent=1))
        return
    if a.step == "report-drop":  # the cheap scores (first stage, BM25, Rep-Sim) made if missing; the rest as cached
        _, scores = score_all(ft, work, False, ())
        report_drop(ft, work, scores, a.subsets, a.noise_subsets)
        return
    extra = (a.step,) if a.step in EXTRA else EXTRA if a.step in ("score", "all") else ()
    builds, scores = score_all(ft, work, not a.skip_full, extra)
    if a.step == "stages":
        print(json.dumps(stages(ft, work, scores, a.subsets), indent=1))
        return
    if a.step == "report" and (missing := [e for e in EXTRA if e not in builds.get("extra", {})]):
        print(f"not in this report (not computed yet; the score step computes them): {', '.join(missing)}")
    if a.step == "all":
        retrainings(ft, halves(a.n, a.subsets), a.noise_subsets, work, a.workers)
    if a.step in ("report", "all"):
        report(ft, work, builds, scores, a.subsets, a.noise_subsets)


if __name__ == "__main__":
    main()
