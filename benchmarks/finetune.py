"""Fine-tuning coverage: the share of parameters attributed per MoE architecture, and bf16 against float32.

    python -m benchmarks.finetune            # writes benchmarks/results/finetune.json (about 2 min on 1 CPU)

1. **MoE share**: tiny Mixtral-, Qwen2-MoE-, Qwen3-MoE-, OLMoE- and gpt-oss-shaped configs (hidden 64,
   2 blocks, 8 experts, top-2, expert width 128); the share of non-embedding parameters (input
   embeddings and LM head left out) the default layer selection attributes
   (:func:`gradindex.capture.hooks.attributed_share`), and what is left (the routers, whose weight
   is used through ``F.linear``, not an ``nn.Linear``, so no rule hooks it; gpt-oss's router bias and
   attention sinks are vectors, counted in the total and not attributed either).
2. **bf16**: a Qwen2-architecture model (hidden 64, 2 blocks, vocab 512) trained 150 steps on 256
   random-word texts, saved in float32; the default index (``gradindex build`` with no options:
   per-layer projection, EK-FAC, int4 eigenbasis rows) built from it loaded in float32 and in bfloat16
   (the per-example math in float32 in both); for 16 queries (training texts and new texts), Spearman
   over all training examples between the two builds' EK-FAC scores and the top-10 overlap.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from benchmarks.common import overlap_at_k, spearman_rows, top_indices
from fixtures.tiny import save_model_dir, tiny_qwen2, train_lm, train_tokenizer
from gradindex.capture import select_layers
from gradindex.capture.hooks import attributed_share, unhooked_weights

RESULTS = Path(__file__).resolve().parent / "results" / "finetune.json"
WORDS = ("the cat sat on a mat while some dog ran far away from home and ate fish bread at noon under blue sky "
         "with red sun over green hills near old town river").split()


def moe_models() -> dict:
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1)),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=128, moe_intermediate_size=128, num_experts=8,
            num_experts_per_tok=2, decoder_sparse_step=1)),
        "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, intermediate_size=128, num_experts=8, num_experts_per_tok=2)),
        "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **common, head_dim=16, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
    }


def moe_share() -> dict:
    out = {"routers_attributed": False}
    for arch, make in moe_models().items():
        torch.manual_seed(0)
        model = make()
        chosen = select_layers(model)
        out[arch] = {"share": round(attributed_share(model, chosen), 4), "layers": len(chosen),
                     "expert_layers": sum("experts." in n for n in chosen),
                     "not_attributed": unhooked_weights(model, chosen)}
        print(f"{arch:10s} {100 * out[arch]['share']:.1f}% of non-embedding parameters attributed "
              f"({out[arch]['layers']} layers; left: {', '.join(out[arch]['not_attributed'])})", flush=True)
    return out


def texts(n: int, seed: int) -> list[str]:
    g = np.random.default_rng(seed)
    return [" ".join(g.choice(WORDS, size=int(g.integers(6, 24)))) for _ in range(n)]


def bf16_agreement(work: Path, n_train: int = 256, n_queries: int = 16) -> dict:
    """Both builds with the defaults, and again with ``--storage fp16`` rows (the same eigenbasis rows
    coded in float16 instead of int4: what the int4 codes' own rounding adds to the disagreement); and
    the float32 build's int4 scores against its fp16 ones (the int4 codes alone, no bf16)."""
    from click.testing import CliRunner

    from gradindex.cli import main
    from gradindex.query import QueryEngine

    train = texts(n_train, 0)
    tok = train_tokenizer(train, vocab_size=512)
    model = tiny_qwen2(vocab_size=len(tok), hidden=64, n_layer=2, n_head=4, n_kv=2, intermediate=128)
    seqs = [tok(t)["input_ids"] for t in train]
    train_lm(model, seqs, steps=150, batch_size=16, lr=3e-3, pad_id=tok.pad_token_id)
    model_dir = save_model_dir(model, tok, work / "model")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in train))
    queries = train[:n_queries // 2] + texts(n_queries - n_queries // 2, 1)
    res, both = {}, {}
    for rows, extra in (("int4", []), ("fp16", ["--storage", "fp16"])):
        scores, seconds = {}, {}
        both[rows] = scores
        for dtype in ("float32", "bfloat16"):
            out = work / f"index-{dtype}-{rows}"
            t0 = time.perf_counter()
            r = CliRunner().invoke(main, ["build", str(model_dir), str(data), "--out", str(out), "--dtype", dtype,
                                          "--device", "cpu", "--quiet", "--no-index", *extra], catch_exceptions=False)
            assert r.exit_code == 0, r.output
            seconds[dtype] = round(time.perf_counter() - t0, 2)
            with QueryEngine(out, device="cpu") as engine:
                scores[dtype] = engine.scores(queries, method="ekfac")  # [Q, N]
        rho = spearman_rows(scores["float32"], scores["bfloat16"])
        top = overlap_at_k(top_indices(scores["bfloat16"], 10), top_indices(scores["float32"], 10))
        part = {"spearman_mean": round(float(rho.mean()), 4), "spearman_min": round(float(rho.min()), 4),
                "top10_overlap_mean": round(float(top.mean()), 4), "top10_overlap_min": round(float(top.min()), 4),
                "build_seconds": seconds}
        if rows == "int4":
            res.update(part, queries=n_queries, examples=n_train,
                       index="gradindex build defaults (--projection auto, EK-FAC, int4 eigenbasis rows)")
        else:
            res["fp16_rows"] = {**part, "index": "the defaults with --storage fp16 (eigenbasis rows as float16)"}
        print(f"bf16 vs float32 build ({rows} rows), EK-FAC scores: Spearman mean {part['spearman_mean']} "
              f"(min {part['spearman_min']}), top-10 overlap mean {part['top10_overlap_mean']} "
              f"(min {part['top10_overlap_min']})", flush=True)
    rho = spearman_rows(both["fp16"]["float32"], both["int4"]["float32"])
    res["int4_vs_fp16_rows_float32"] = {"spearman_mean": round(float(rho.mean()), 4),
                                        "spearman_min": round(float(rho.min()), 4)}
    print(f"int4 rows against fp16 rows, both float32 builds: Spearman mean {rho.mean():.4f} (min {rho.min():.4f})")
    return res


def main() -> None:
    torch.set_num_threads(1)
    out = {"conditions": "CPU, 1 thread, torch " + torch.__version__ + ", transformers " + transformers.__version__,
           "moe_share": moe_share()}
    with tempfile.TemporaryDirectory() as d:
        out["bf16"] = bf16_agreement(Path(d))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
