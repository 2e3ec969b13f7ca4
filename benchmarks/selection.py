"""Online data selection: its per-step cost, and what it does to a target domain's loss.

1. **Overhead** (the shared workload of ``benchmarks/train_overhead.py``: GPT-2 4 layers, width 256,
   vocab 8192, 128 tokens, batch 8, one thread, every block Conv1D hooked, projection 16x16): median
   step time of a plain AdamW loop against the same loop over ``SelectingLoader`` with ``KeepAll``
   (scoring pass + the full step) and ``TopFraction(0.25)`` (scoring pass + a step on 2 of 8), steps
   interleaved; plus the time of one target refresh.
2. **Selection**: a tiny GPT-2 built from a config (2 layers, width 64, BPE vocab 512, 64 tokens) is
   first trained on the mixture (300 steps of 16, lr 3e-3: a general model past the unigram
   plateau), then trained on (fresh AdamW, lr 1e-3) for 150 steps, each over a candidate batch of 32
   drawn from a mixture where 25% of the examples are target-domain: prose paragraphs of the GNU info manuals
   (``fixtures/corpus.py``), the rest Python standard-library docstring paragraphs. The target set
   (64 held-out GNU paragraphs) gives the target gradient; the target loss is the mean token loss on
   256 other held-out GNU paragraphs. Arms, on the same model and candidate stream: ``selected``
   (``TopFraction(0.25)``, cosine, ``precondition="adam"``, target refreshed every 10 steps: 8 of
   32 trained on), ``selected_plain`` (the same without preconditioning), ``all`` (all 32: 4x the
   training compute), ``random`` (``RandomFraction(0.25)``: 8 of 32). Three seeds (model init,
   streams).

    python -m benchmarks.selection            # both parts (~10 min on 2 shared cores)
    python -m benchmarks.selection --quick    # tiny sizes, a smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.common import Workload, make_model, make_sequences  # noqa: E402
from fixtures.corpus import corpus_hash, gnu_info_paragraphs, stdlib_paragraphs  # noqa: E402
from fixtures.tiny import tiny_gpt2, train_tokenizer  # noqa: E402
from gradindex.data import collate, per_example_loss  # noqa: E402
from gradindex.integrations import (  # noqa: E402
    KeepAll,
    OnlineSelector,
    RandomFraction,
    SelectingLoader,
    TopFraction,
    target_from_texts,
)

RESULTS = Path(__file__).resolve().parent / "results"


def _step(model, opt, batch: dict) -> None:
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# -- 1. overhead ----------------------------------------------------------------------------------
def overhead(steps: int, warmup: int, quick: bool) -> dict:
    w = Workload(projection="16")
    if quick:
        w = replace(w, layers=2, width=32, heads=2, vocab=256, seq_len=16)
    n = steps + warmup
    seqs = make_sequences(w, n * w.batch_size + 32, w.seq_len)
    target, seqs = seqs[:32], seqs[32:]
    arms = {"plain": None, "keep_all": KeepAll(), "top_25%": TopFraction(0.25)}
    models = {k: make_model(w, max(128, w.seq_len)) for k in arms}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    sels = {k: OnlineSelector(models[k], target, p, projection=w.projection, optimizer=opts[k])
            for k, p in arms.items() if p is not None}
    for m in models.values():
        m.train()
    wall: dict[str, list[float]] = {k: [] for k in arms}
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for i in range(n):
        rows = seqs[i * w.batch_size:(i + 1) * w.batch_size]
        batch = collate(rows, rows, 0)
        for name in names[i % 3:] + names[:i % 3]:  # rotate the order: machine noise hits all alike
            t, c = time.perf_counter(), time.process_time()
            if name == "plain":
                _step(models[name], opts[name], batch)
            else:
                for b in SelectingLoader([batch], sels[name]):  # the first batch also fits the target
                    _step(models[name], opts[name], b)
            if i >= warmup:
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    sel = sels["keep_all"]
    t = time.perf_counter()
    sel.refresh()
    refresh_s = time.perf_counter() - t
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    res = {
        "workload": asdict(w),
        "steps_timed": steps,
        "median_step_s": med,
        "overhead": {k: med[k] / med["plain"] - 1 for k in arms if k != "plain"},
        "median_step_cpu_s": med_cpu,
        "overhead_cpu": {k: med_cpu[k] / med_cpu["plain"] - 1 for k in arms if k != "plain"},
        "refresh_s": refresh_s,
        "refresh_examples": len(target),
    }
    print(f"overhead (median of {steps} steps, batch {w.batch_size}): plain {med['plain']:.3f} s, "
          f"keep-all {med['keep_all']:.3f} s ({res['overhead']['keep_all']:+.0%}), "
          f"top 25% {med['top_25%']:.3f} s ({res['overhead']['top_25%']:+.0%}); CPU time: keep-all "
          f"{res['overhead_cpu']['keep_all']:+.0%}, top 25% {res['overhead_cpu']['top_25%']:+.0%}; one target "
          f"refresh ({len(target)} examples) {refresh_s:.2f} s", flush=True)
    return res


# -- 2. selection on a two-domain mixture ------------------------------------------------------------
def _mean_loss(model, seqs: list[list[int]], batch_size: int = 64) -> float:
    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(seqs), batch_size):
            b = collate(seqs[s:s + batch_size], seqs[s:s + batch_size], 0)
            loss, ntok = per_example_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                          b["labels"])
            tot += float(loss.sum())
            n += int(ntok.sum())
    model.train()
    return tot / n


def _data(args) -> dict:
    gnu, std = gnu_info_paragraphs(), stdlib_paragraphs()
    rng = random.Random(0)
    rng.shuffle(gnu)
    rng.shuffle(std)
    n_t, n_e = args.target_size, args.eval_size
    split = {"target": gnu[:n_t], "eval_target": gnu[n_t:n_t + n_e], "eval_other": std[:n_e],
             "pool_target": gnu[n_t + n_e:], "pool_other": std[n_e:]}
    tok = train_tokenizer(split["pool_target"] + split["pool_other"], vocab_size=args.vocab)
    ids = {k: [x for x in (tok(t, add_special_tokens=False)["input_ids"][:args.max_length] for t in v) if len(x) > 1]
           for k, v in split.items()}
    ids["target_tok"] = target_from_texts(split["target"], tok, args.max_length)
    ids["hashes"] = {"gnu_info": corpus_hash(gnu), "stdlib": corpus_hash(std)}
    return ids


def _stream(data: dict, steps: int, batch: int, share: float, seed: int) -> list[tuple[list[list[int]], list[bool]]]:
    """Candidate batches: each example is target-domain with probability ``share``, drawn from its pool."""
    rng = random.Random(1000 + seed)
    out = []
    for _ in range(steps):
        dom = [rng.random() < share for _ in range(batch)]
        rows = [rng.choice(data["pool_target"] if d else data["pool_other"]) for d in dom]
        out.append((rows, dom))
    return out


def _pretrain(data: dict, seed: int, args) -> dict:
    """The general model every arm of a seed starts from: ``--pretrain-steps`` of 16 on the mixture."""
    model = tiny_gpt2(vocab_size=args.vocab, n_layer=2, n_embd=64, n_head=4, n_positions=args.max_length, seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.0)
    for rows, _ in _stream(data, args.pretrain_steps, 16, args.share, 500 + seed):
        _step(model, opt, collate(rows, rows, 0))
    return {k: v.clone() for k, v in model.state_dict().items()}


ARMS = {
    "selected": lambda a, s: (TopFraction(a.keep), {"precondition": "adam"}),
    "selected_plain": lambda a, s: (TopFraction(a.keep), {}),
    "all": lambda a, s: (None, {}),
    "random": lambda a, s: (RandomFraction(a.keep, seed=s), {}),
}


def _run_arm(arm: str, start: dict, data: dict, stream, seed: int, args) -> dict:
    model = tiny_gpt2(vocab_size=args.vocab, n_layer=2, n_embd=64, n_head=4, n_positions=args.max_length, seed=seed)
    model.load_state_dict(start)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    policy, options = ARMS[arm](args, seed)
    sel = None
    loader = [collate(rows, rows, 0) | {"domain": torch.tensor(dom)} for rows, dom in stream]
    if policy is not None:
        sel = OnlineSelector(model, data["target_tok"], policy, projection=args.projection,
                             refresh_every=args.refresh_every, optimizer=opt, seed=seed, **options)
        loader = SelectingLoader(loader, sel)
    curve, kept_target, kept = [(0, _mean_loss(model, data["eval_target"]))], 0, 0
    t0 = time.perf_counter()
    for k, b in enumerate(loader):
        dom = b.pop("domain")
        kept_target += int(dom.sum())
        kept += len(dom)
        _step(model, opt, b)
        if (k + 1) % args.eval_every == 0 or k + 1 == len(stream):
            curve.append((k + 1, _mean_loss(model, data["eval_target"])))
    seconds = time.perf_counter() - t0
    return {"target_loss": curve[-1][1], "other_loss": _mean_loss(model, data["eval_other"]), "curve": curve,
            "examples_trained": kept, "target_share_trained": kept_target / kept, "seconds": seconds,
            "refreshes": sel.stats["refreshes"] if sel is not None else 0}


def selection(args) -> dict:
    data = _data(args)
    print(f"data: target set {len(data['target'])}, eval {len(data['eval_target'])} target-domain / "
          f"{len(data['eval_other'])} other, pools {len(data['pool_target'])} / {len(data['pool_other'])}", flush=True)
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    start_loss = []
    for seed in range(args.seeds):
        start = _pretrain(data, seed, args)
        stream = _stream(data, args.steps, args.candidates, args.share, seed)
        for arm in runs:
            r = _run_arm(arm, start, data, stream, seed, args)
            runs[arm].append(r)
            print(f"  seed {seed} {arm:14s}: target loss {r['curve'][0][1]:.3f} -> {r['target_loss']:.3f}, other "
                  f"{r['other_loss']:.3f}, trained on {r['examples_trained']} examples "
                  f"({r['target_share_trained']:.0%} target-domain), {r['seconds']:.1f} s", flush=True)
        start_loss.append(r["curve"][0][1])

    def ms(key: str, arm: str) -> dict:
        v = [r[key] for r in runs[arm]]
        return {"mean": statistics.fmean(v), "sd": statistics.stdev(v) if len(v) > 1 else 0.0, "values": v}

    table = {arm: {k: ms(k, arm) for k in ("target_loss", "other_loss", "target_share_trained", "seconds")}
             for arm in runs}
    for arm, t in table.items():
        print(f"{arm:14s}: target loss {t['target_loss']['mean']:.3f} ± {t['target_loss']['sd']:.3f}, "
              f"other {t['other_loss']['mean']:.3f} ± {t['other_loss']['sd']:.3f}, "
              f"target share trained {t['target_share_trained']['mean']:.0%}", flush=True)
    paired = {}
    if "random" in runs:  # the same start and candidate stream: the seed's own baseline
        for arm in runs:
            d = [x["target_loss"] - y["target_loss"] for x, y in zip(runs[arm], runs["random"])]
            paired[arm] = {"mean": statistics.fmean(d), "sd": statistics.stdev(d) if len(d) > 1 else 0.0, "values": d}
            print(f"{arm:14s} - random, target loss per seed: {', '.join(f'{x:+.3f}' for x in d)}")
    return {"config": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
            "corpus_hashes": data["hashes"],
            "sizes": {k: len(data[k]) for k in ("target", "eval_target", "eval_other", "pool_target", "pool_other")},
            "start_target_loss": start_loss, "table": table, "target_loss_minus_random": paired, "runs": runs}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"selected": "tab:green", "selected_plain": "tab:olive", "all": "tab:blue", "random": "tab:orange"}
    base = torch.tensor([[v for _, v in r["curve"]] for r in res["runs"]["random"]])
    for arm, runs in res["runs"].items():
        steps = [s for s, _ in runs[0]["curve"]]
        vals = torch.tensor([[v for _, v in r["curve"]] for r in runs]) - base  # paired: same seed's random arm
        m, sd = vals.mean(0), vals.std(0) if len(runs) > 1 else torch.zeros(len(steps))
        a.plot(steps, m, label=arm, color=colors[arm])
        a.fill_between(steps, m - sd, m + sd, color=colors[arm], alpha=0.15)
    a.set_xlabel("optimizer step")
    a.set_ylabel("target loss minus the random arm's (same seed)")
    a.set_title(f"held-out target-domain loss, paired (mean ± sd, {len(base)} seeds)")
    a.legend()
    t = res["table"]
    arms = list(t)
    x = range(len(arms))
    for i, key in enumerate(("target_loss", "other_loss")):
        b.bar([j + 0.4 * i for j in x], [t[k][key]["mean"] for k in arms], 0.4,
              yerr=[t[k][key]["sd"] for k in arms], label=key.replace("_", " "), capsize=3)
    b.set_xticks([j + 0.2 for j in x], [f"{k}\n({t[k]['target_share_trained']['mean']:.0%} target)" for k in arms],
                 fontsize=8)
    b.set_ylabel("held-out mean token loss")
    b.set_title("after training")
    b.legend()
    lo = min(t[k][key]["mean"] for k in arms for key in ("target_loss", "other_loss"))
    b.set_ylim(lo * 0.9, None)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--overhead-steps", type=int, default=8)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--pretrain-steps", type=int, default=300, help="Steps of 16 on the mixture before the arms.")
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=150, help="Optimizer steps per arm (one candidate batch each).")
    p.add_argument("--candidates", type=int, default=32, help="Candidate examples per step.")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--keep", type=float, default=0.25, help="Fraction kept by 'selected' and 'random'.")
    p.add_argument("--share", type=float, default=0.25, help="Target-domain share of the mixture.")
    p.add_argument("--refresh-every", type=int, default=10)
    p.add_argument("--projection", default="16")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--target-size", type=int, default=64)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--quick", action="store_true", help="Tiny sizes (a smoke test).")
    p.add_argument("--out", default=str(RESULTS / "selection.json"))
    p.add_argument("--plot", default=str(RESULTS / "selection.png"))
    args = p.parse_args(argv)
    if args.quick:
        args.overhead_steps, args.seeds, args.steps, args.eval_every, args.pretrain_steps = 2, 2, 6, 3, 4
        args.target_size, args.eval_size, args.refresh_every, args.candidates = 8, 16, 3, 16
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    res = {"overhead": None if args.skip_overhead else overhead(args.overhead_steps, 1, args.quick)}
    res["selection"] = selection(args)
    res["seconds"] = time.perf_counter() - t0
    res["machine"] = {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    plot(res["selection"], Path(args.plot))
    print(f"wrote {args.out} and {args.plot} ({res['seconds']:.0f} s)")
    return res


if __name__ == "__main__":
    main()
