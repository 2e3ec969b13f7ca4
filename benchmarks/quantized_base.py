"""A quantized base under the LoRA adapter, against the float32 base (issue 31 item 3).

The subject is :mod:`benchmarks.real_llm`'s cached fine-tune (SmolLM2-135M-Instruct, PEFT LoRA r=8 on
q/v/up/down, 160 chat conversations). The adapter index is built with the base loaded ``int8`` and ``nf4``
(``gradindex build BASE DATA --adapter ADAPTER --base-quantization Q --max-length 192``, defaults otherwise)
and compared with the float32-base adapter index built the same way:

* per query (12 paraphrased planted facts, 9 held-out documentation conversations), the first stage's
  ``ekfac-selfnorm`` and ``ekfac`` scores over the 160 conversations: Spearman against the float32 base's, the
  overlap of the two top 10s, and each fact query's rank of its source (:func:`benchmarks.real_llm.fact_ranks`);
* the halves LDS (:mod:`benchmarks.real_llm`'s retrainings already in the work folder, float LoRA retrainings:
  none is started here) of each, the float32 base's beside it;
* each build's wall time and peak RSS (``/usr/bin/time -v``), the float32 build rebuilt in the same session
  (``--reference-build``) or read from its stamp.

    python -m benchmarks.quantized_base                       # -> benchmarks/results/quantized-base.json
    python -m benchmarks.quantized_base --reference-build     # the float32 base rebuilt too, timed alike
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from benchmarks.common import evaluate, spearman_rows
from benchmarks.real_llm import _cli, fact_ranks, first_stage, load_jsonl

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "quantized-base.json"
WORK = Path(os.environ.get("GRADINDEX_CACHE", "/work/cache")) / "smollm2" / "ft-n160-s0-fef273aca2"
METHODS = ("ekfac-selfnorm", "ekfac")
TOP = 10


def build(ft: dict, work: Path, name: str, extra: list[str], rebuild: bool = False) -> dict:
    """``work/idx-NAME``: the adapter index of ``ft`` with ``extra`` options, timed; cached by its stamp."""
    idx, stamp = work / f"idx-{name}", work / f"build-{name}.json"
    if rebuild or not stamp.exists() or not (idx / "manifest.json").exists():
        cost = _cli(["build", ft["base"], ft["data"], "--adapter", ft["adapter"], *extra, "--out", str(idx),
                     "--max-length", "192", "--quiet", "--overwrite"], work / f"build-{name}.log")
        stamp.write_text(json.dumps(cost))
    return {"dir": str(idx), **json.loads(stamp.read_text())}


def train_losses(ft: dict, quant: str | None, n: int = 48, batch: int = 8) -> np.ndarray:
    """``[n]`` the first ``n`` training conversations' mean assistant-token loss under the fine-tuned model with its
    base loaded ``quant``: how far the quantized model is from the one the adapter was trained with."""
    import torch

    from gradindex.data import load_records, per_example_loss, tokenize_records
    from gradindex.model import load_causal_lm

    model, tok = load_causal_lm(ft["base"], device="cpu", adapter=ft["adapter"], base_quantization=quant)
    data = tokenize_records(load_records(ft["data"]).select(range(n)), tok, 192)
    out = []
    with torch.no_grad():
        for s in range(0, len(data.input_ids), batch):
            ids, labels = data.input_ids[s:s + batch], data.labels[s:s + batch]
            T = max(map(len, ids))
            x = torch.tensor([i + [0] * (T - len(i)) for i in ids])
            y = torch.tensor([lab + [-100] * (T - len(lab)) for lab in labels])
            att = (torch.arange(T)[None] < torch.tensor([len(i) for i in ids])[:, None]).long()
            loss, n = per_example_loss(model(input_ids=x, attention_mask=att, use_cache=False).logits, y)
            out += (loss / n.clamp(min=1)).tolist()
    return np.asarray(out)


def top_overlap(a: np.ndarray, b: np.ndarray, k: int = TOP) -> np.ndarray:
    """``[Q]`` the share of ``b``'s top ``k`` in ``a``'s top ``k``, per query."""
    ta, tb = np.argsort(-a, 1, kind="stable")[:, :k], np.argsort(-b, 1, kind="stable")[:, :k]
    return np.array([len(set(x) & set(y)) / k for x, y in zip(ta, tb)])


def retrained_losses(work: Path, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(masks, losses [M, 1, Q])`` of the seed-0 retrainings present in a row (s000-r0, s001-r0, ...)."""
    losses = []
    for i in range(len(masks)):
        f = work / "retrain" / f"s{i:03d}-r0.json"
        if not f.exists():
            break
        rec = json.loads(f.read_text())
        if "rows" in rec and rec["rows"] != np.flatnonzero(masks[i]).tolist():
            raise SystemExit(f"{f} was trained on other rows than subset {i}'s mask")
        losses.append(rec["losses"])
    return masks[:len(losses)], np.asarray(losses, dtype=np.float64)[:, None]


def compare(scores: dict[str, dict[str, np.ndarray]], ft: dict, work: Path) -> dict:
    """Each base's figures per method, the quantized ones against ``float32``."""
    F = ft["fact_queries"]
    masks, losses = retrained_losses(work, np.load(work / "masks.npy")) if (work / "masks.npy").exists() else (
        None, np.zeros((0,)))
    out: dict = {"lds_retrainings": int(len(losses))}
    for m in METHODS:
        ref = scores["float32"][m]
        rows = {}
        for base, s in scores.items():
            s = s[m]
            ranks = fact_ranks(s[:F], ft["facts"])
            row = {"fact_ranks": ranks, "fact_recall@1": round(float(np.mean(np.array(ranks) == 1)), 4),
                   "fact_mrr": round(float(np.mean(1 / np.array(ranks))), 4)}
            if base != "float32":
                rho, top = spearman_rows(s, ref), top_overlap(s, ref)
                row |= {"spearman_vs_float32": round(float(rho.mean()), 4),
                        "spearman_vs_float32_min": round(float(rho.min()), 4),
                        "spearman_vs_float32_facts": round(float(rho[:F].mean()), 4),
                        "spearman_vs_float32_docs": round(float(rho[F:].mean()), 4),
                        f"top{TOP}_overlap_vs_float32": round(float(top.mean()), 4),
                        f"top{TOP}_overlap_vs_float32_min": round(float(top.min()), 4),
                        "spearman_per_query": [round(float(x), 4) for x in rho]}
            if len(losses) >= 3:
                per_q = evaluate(s, masks, losses)["per_query"]
                row |= {"lds": round(float(per_q.mean()), 4),
                        "lds_se": round(float(per_q.std(ddof=1) / np.sqrt(len(per_q))), 4),
                        "lds_facts": round(float(per_q[:F].mean()), 4), "lds_docs": round(float(per_q[F:].mean()), 4),
                        "lds_per_query": [round(float(x), 4) for x in per_q]}
            rows[base] = row
        if len(losses) >= 3:
            ref_q = np.array(rows["float32"]["lds_per_query"])
            for base, row in rows.items():
                if base != "float32":
                    d = np.array(row["lds_per_query"]) - ref_q
                    row["lds_vs_float32"] = {"diff": round(float(d.mean()), 4),
                                             "se": round(float(d.std(ddof=1) / np.sqrt(len(d))), 4),
                                             "higher": int((d > 0).sum()), "of": len(d)}
        out[m] = rows
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=WORK, help="the cached fine-tune's folder (finetune.json)")
    ap.add_argument("--quantizations", nargs="+", default=["int8", "nf4"])
    ap.add_argument("--reference", default="adapter", help="the float32-base adapter index: WORK/idx-NAME")
    ap.add_argument("--reference-build", action="store_true",
                    help="rebuild the float32-base index as WORK/idx-adapter-f32 in this run (timed like the others)")
    ap.add_argument("--drift-examples", type=int, default=48,
                    help="training conversations whose loss is compared under each base (model_drift)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    ft = json.loads((a.work / "finetune.json").read_text())
    queries = load_jsonl(ft["queries"])
    builds = {"float32": (build(ft, a.work, "adapter-f32", []) if a.reference_build else
                          {"dir": str(a.work / f"idx-{a.reference}"),
                           **json.loads((a.work / f"build-{a.reference}.json").read_text())})}
    for q in a.quantizations:
        builds[q] = build(ft, a.work, f"adapter-{q}", ["--base-quantization", q])
    scores, seconds = {}, {}
    for base, b in builds.items():
        t0 = time.perf_counter()
        scores[base] = first_stage(b["dir"], queries, METHODS)
        seconds[base] = round((time.perf_counter() - t0) / len(queries), 2)
        b["query_s_per_query"] = seconds[base]
        m = json.loads((Path(b["dir"]) / "manifest.json").read_text())
        b["base_quantization"] = m["build"].get("base_quantization", "none")
    losses = {base: train_losses(ft, None if base == "float32" else base, a.drift_examples) for base in builds}
    drift = {base: {"mean_train_loss": round(float(v.mean()), 4),
                    "mean_abs_change_vs_float32": round(float(np.abs(v - losses["float32"]).mean()), 4)}
             for base, v in losses.items()}
    result = {
        "what": "adapter index of the cached SmolLM2-135M-Instruct LoRA fine-tune (160 conversations) with the base "
                "loaded int8 / nf4 (bitsandbytes) against the float32 base; first stage scores of 21 queries (12 "
                "paraphrased planted facts, 9 held-out documentation conversations)",
        "conditions": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "threads": os.environ.get("OMP_NUM_THREADS"), "load_note": "a shared 2-core machine with "
                       "other builds and retrainings running: wall times are comparable only roughly",
                       "build": "gradindex build BASE DATA --adapter ADAPTER [--base-quantization Q] --max-length 192",
                       "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "builds": builds,
        "model_drift": {"examples": a.drift_examples, "what": "mean assistant-token loss of the fine-tuned model "
                        "(adapter on the base loaded so) on the first training conversations", **drift},
        "compare": compare(scores, ft, a.work),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    c = result["compare"]
    for m in METHODS:
        for base, row in c[m].items():
            b = builds[base]
            print(f"{m:15s} {base:8s} build {b['wall_s']:7.1f} s {b['peak_rss_gb']:5.2f} GB | facts@1 "
                  f"{row['fact_recall@1']:.2f} | rho {row.get('spearman_vs_float32', 1.0):.3f} top{TOP} "
                  f"{row.get(f'top{TOP}_overlap_vs_float32', 1.0):.2f} | lds {row.get('lds', float('nan')):.3f}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
