"""``gradindex build MODEL_DIR DATA --out INDEX_DIR``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from gradindex.cli import main
from gradindex.cli.common import (
    Interrupted,
    UserError,
    damping_option,
    data_options,
    human_bytes,
    one_line,
    positive_damping,
    user_errors,
)
from gradindex.cli.index import check_index_type, index_config, index_options, report
from gradindex.lock import index_lock

STORAGES = ("fp32", "fp16", "int8", "int4")
"""gradindex.store.codes.STORAGES, repeated so that start-up does not load the store (a test keeps them equal)."""


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux ``MemAvailable``; else physical memory), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_capture_memory(model, spec, layers, batch_size: int, projection: str) -> None:
    """Refuse, before allocating anything, a capture whose per-batch gradients cannot fit in memory."""
    from gradindex.capture import layer_info, select_layers

    infos = [layer_info(m) for m in select_layers(model, layers or None).values()]
    if spec.is_identity:
        per_example = sum(i.n_out * i.n_in_total for i in infos)
    else:
        per_example = len(infos) * spec.k_g * spec.k_a
    need = 2 * 4 * batch_size * per_example  # float32 batch on the device and its host copy
    free = available_memory()
    if free is not None and need > free:
        raise ValueError(
            f"--projection {projection} stores {per_example:,} numbers per example: a batch of {batch_size} "
            f"needs about {human_bytes(need)} of memory and {human_bytes(free)} is available; use a smaller "
            "--projection (e.g. 16 to 64) or --batch-size"
        )


def note_unhooked(model) -> None:
    """Say which weight matrices of the blocks the default selection leaves out (no capture rule)."""
    from gradindex.capture import select_layers, unhooked_weights

    left = unhooked_weights(model, select_layers(model))
    if left:
        shown = ", ".join(left[:4]) + (", ..." if len(left) > 4 else "")
        click.echo(f"note: {len(left)} weight matrices per block have no capture rule and are not attributed "
                   f"({shown}; e.g. mixture-of-experts experts); the scores cover the linear layers that "
                   "`gradindex layers MODEL_DIR` marks", err=True)


def _default(name: str):
    """The library's default of a build setting or row field (:func:`gradindex.spec.build.default`; never restated
    here)."""
    from gradindex.spec.build import default

    return default(name)


@main.command()
@click.argument("model_dir", type=click.Path())
@click.argument("data", type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Index directory to write.")
@click.option("--projection", default=_default("projection"), show_default=True,
              help="K, KAxKG, none, or auto (per-layer sizes from --budget).")
@click.option("--rows", default=None,
              help="What a row holds, as one spec: e.g. auto,EKFAC@0.001,int4 (the default), P16x16,fp32, none,int8 "
                   "or auto:1/64,EIGEN@0.001,int4 (docs/formats.md, 'Row specs'); instead of --projection, "
                   "--budget, --allocation, --projection-basis, --basis-damping, --transcode, --storage.")
@click.option("--budget", default=None,
              help="Bytes per example for --projection auto: an integer, or a fraction of the full float32 "
                   "gradient such as 1/8 (default auto: 1/8, at most 256 KiB; the whole gradient where that buys it).")
@click.option("--allocation", default=_default("allocation"), show_default=True,
              type=click.Choice(["ratio", "equal", "spectrum", "cost"]),
              help="How --budget is spread over layers (docs/math.md, 'What a row holds'); cost: ratio's numbers "
                   "per layer, split between its sides for the cheapest capture (a narrow side often kept exact).")
@click.option("--projection-basis", "basis", default=_default("basis"), show_default=True,
              type=click.Choice(["raw", "kfac", "eigen"]),
              help="eigen: store the full-space EK-FAC eigen-coordinates --budget buys, chosen over all layers "
                   "(two model passes first; rows answer ekfac; wins where the budget holds most of the "
                   "influence, benchmarks/width.py). kfac: whiten each side by its damped full-space K-FAC factor "
                   "before projecting; rows then answer kfac/ekfac, not graddot.")
@click.option("--basis-damping", default=_default("basis_damping"), show_default=True, type=float,
              callback=positive_damping, help="Relative damping of the kfac whitening.")
@click.option("--fit-examples", "basis_examples", default=_default("basis_examples"), show_default=True, type=int,
              help="Examples sampled for the kfac basis's factor pass (0 = all).")
@click.option("--fit-seed", "basis_seed", default=_default("basis_seed"), show_default=True, type=int,
              help="Seed of the --fit-examples sample.")
@click.option("--projection-kind", type=click.Choice(["gaussian", "rademacher"]), default="gaussian", show_default=True)
@click.option("--seed", default=0, show_default=True, type=int, help="Projection seed.")
@click.option("--layers", multiple=True, help="Glob of layer names to hook (repeatable). Default: all block linears "
                                            "(with --adapter: the adapter's lora_A/lora_B).")
@click.option("--adapter", default=None, type=click.Path(file_okay=False, exists=True),
              help="A PEFT (LoRA) adapter folder to load onto MODEL_DIR; its lora_A/lora_B gradients are "
                   "attributed (add the base layers with --layers). Needs `pip install 'gradindex[peft]'`.")
@click.option("--base-quantization", default="none", show_default=True, type=click.Choice(["none", "int8", "nf4"]),
              help="Load MODEL_DIR quantized under --adapter, as QLoRA trains it: int8 (8-bit weights and inputs) "
                   "or nf4 (4-bit NormalFloat); the adapter's LoRA layers are attributed (the quantized layers have "
                   "no weight gradient). Queries load the base as the index records. Needs `pip install "
                   "'gradindex[quantize]'`.")
@click.option("--chat-template", default=None, type=click.Path(dir_okay=False, exists=True),
              help="A Jinja chat template file for 'messages' records when the tokenizer has none.")
@data_options
@click.option("--batch-size", default=_default("batch_size"), show_default=True, type=int)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--route", default=_default("route"), show_default=True,
              type=click.Choice(["auto", "factorized", "materialized"]))
@click.option("--storage", default=_default("storage"), show_default=True, type=click.Choice(["auto", *STORAGES]),
              help="Row codes on disk: float32, float16, or int8/int4 with a per-row scale (2x/4x/8x smaller). "
                   "auto: int4 for rows transcoded into the EK-FAC eigenbasis, else int8.")
@click.option("--shard-size", default=_default("shard_size"), show_default=True, type=int,
              help="Examples per store file.")
@click.option("--overwrite", is_flag=True,
              help="Replace whatever index is in --out (everything is recomputed; a killed --overwrite "
                   "build resumes with a plain re-run).")
@click.option("--repair", is_flag=True,
              help="Check every committed shard's whole-file hash and recompute the damaged or missing ones "
                   "(a plain re-run does a cheap sampled check); rewrite a missing or damaged basis.h5 (a transcoded "
                   "index's from its EK-FAC fit, a kfac/eigen projection basis by its factor pass, checked against "
                   "its digest). Damaged files are kept in --out/damaged/.")
@click.option("--precondition", default=_default("precondition"), show_default=True,
              type=click.Choice(["auto", "none", "kfac", "ekfac"]),
              help="Fit this preconditioner too (factors collected in the same pass; ekfac writes kfac too). "
                   "auto: ekfac (none with --optimizer-state).")
@click.option("--transcode", default="auto", show_default=True,
              type=click.Choice(["auto", "ekfac", "none"]),
              help="ekfac: after the EK-FAC fit, rewrite the rows in place in its whitened eigenbasis at "
                   "--damping (plain inner products = EK-FAC; what low-bit codes need). auto: ekfac when "
                   "--precondition is ekfac on raw rows. The index then answers --method ekfac.")
@click.option("--fit-sample", default=_default("fit_sample"), show_default=True, type=click.IntRange(min=0),
              help="With more examples than --sample-above, the default build (EK-FAC, --transcode ekfac) fits "
                   "EK-FAC on a seeded sample of this many (--fisher-seed) and codes every row in its whitened "
                   "eigenbasis in the capture pass: no raw store, no transcode. 0: fit on every example.")
@click.option("--sample-above", default=_default("sample_above"), show_default=True, type=click.IntRange(min=0),
              help="Fit on the --fit-sample sample only with more examples than this. 0 (auto): 8 x --fit-sample, "
                   "or --fit-sample where the disk cannot hold the fit on every example at its peak (float16 rows "
                   "beside their rotated copy, ~8x the final store; `gradindex plan` shows it). Up to there the fit "
                   "on every example costs less time.")
@click.option("--rerank-fit", is_flag=True, default=_default("rerank_fit"),
              help="Also fit --precondition in full (unprojected) space in this build, what the exact stage "
                   "(`query --rerank-full C`) needs where the rows are a projection: factors summed in the capture "
                   "pass, then a correction pass. Off by default (the default query is the first stage); "
                   "`gradindex precondition INDEX --method ekfac --space full` adds it later.")
@click.option("--rerank-correction", default=_default("rerank_correction"), show_default=True,
              type=click.IntRange(min=0),
              help="With --rerank-fit: the full-space EK-FAC fit takes its eigenvalue correction from a seeded "
                   "sample of this many examples (a model pass over them; the factors come from the capture "
                   "pass). 0: every example.")
@damping_option("Relative damping of the self-influence written with --precondition (and of --whiten).")
@click.option("--collect-covariance", is_flag=True, default=_default("collect_covariance"),
              help="Sum the projected K-FAC factors per shard in the capture pass without fitting them "
                   "(`gradindex precondition` fits them later without a model pass).")
@click.option("--full-factors", is_flag=True, default=_default("full_factors"),
              help="Also sum full-space (unprojected) K-FAC factors in the capture pass, so that "
                   "`gradindex precondition --space full` needs one model pass instead of two.")
@click.option("--fisher", default=_default("fisher"), show_default=True, type=click.Choice(["empirical", "true"]),
              help="Factors of --precondition from the observed labels or from labels sampled from the model.")
@click.option("--fisher-seed", default=_default("fisher_seed"), show_default=True, type=int,
              help="Seed of --fisher true's labels (and of the --fit-sample sample).")
@click.option("--optimizer-state", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Adam state of the training run (.safetensors of '<param>.exp_avg_sq', or a torch "
                   "optimizer state_dict, read with weights_only=True): store G/(sqrt(v)+eps), method adam.")
@click.option("--adam-mode", default="exact", show_default=True,
              type=click.Choice(["exact", "factored"]),
              help="exact: entrywise (materialized route); factored: rank-1 v per layer (factorized route).")
@index_options
@click.option("--no-index", is_flag=True, help="Skip the FAISS index stage (run `gradindex index` later).")
@click.option("--parts", default=None, metavar="P|ranks",
              help="Write a sharded index of P parts (contiguous row ranges, each a complete index with its own "
                   "tier; `query`, `serve` and `audit` run one part or more a torchrun rank): the parts `gradindex "
                   "split --shards P` makes of the same build, the store's files moved into them. ranks: one part a "
                   "torchrun rank. Default: one index directory, also under torchrun.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
def build(**o):
    """Capture per-example projected gradients of DATA under the model in MODEL_DIR (a folder or a .gguf file).

    A .gguf file is de-quantized to --dtype; its tokenizer and chat template are read from the file."""
    from gradindex import distributed
    from gradindex.model import causal_config, is_gguf, refuse_weightless, resolve_device

    opts = settings(o)
    check_parts(o["parts"], o["no_index"])
    resolve_device(o["device"])
    if not is_gguf(o["model_dir"]) and Path(o["model_dir"], "config.json").is_file():
        causal_config(Path(o["model_dir"]))  # a model that is no causal LM is named as such first
    refuse_weightless(o["model_dir"])  # a config-only folder: only `gradindex plan` takes one (nothing written)
    if not distributed.init_from_env(o["device"]):
        return _build(o, opts)
    # under torchrun: each rank captures its share of the shards
    o["device"] = distributed.local_device(o["device"])
    o["quiet"] = o["quiet"] or distributed.rank() > 0
    me = distributed.rank()
    try:
        _build(o, opts)
    except BaseException as e:
        distributed.shutdown(wait=False)  # (the other ranks may never reach a barrier)
        if distributed.peer_lost(e):
            raise UserError(f"rank {me}: another rank of the build died or stalled ({one_line(e)[:160]}); run the "
                            "same command again to resume the build (every file written so far is kept); under "
                            "`torchrun --max-restarts N` that happens by itself") from e
        raise
    distributed.shutdown()
    distributed.exit_rank(0)  # (every rank done and synchronized: no teardown left to abort it)


def check_parts(parts: str | None, no_index: bool) -> None:
    """Refuse a ``--parts`` that is neither a positive count nor ``ranks``, or one with ``--no-index`` (before
    anything is loaded)."""
    if parts is None:
        return
    if parts.strip().lower() != "ranks" and not (parts.strip().isdigit() and int(parts) > 0):
        raise ValueError(f"--parts takes a positive count or 'ranks', not {parts!r}")
    if no_index:
        from gradindex.pipeline import NO_TIER_PARTS

        raise ValueError(NO_TIER_PARTS)


def _build(o: dict, opts) -> None:
    """The build itself, once the options are checked (and the process group, under ``torchrun``, started)."""
    from gradindex import distributed
    from gradindex.pipeline import build_index
    from gradindex.plan import longest_example, plan_build
    from gradindex.store.builder import refuse_foreign, refuse_part

    out = o["out"]
    if o["parts"] is None:
        refuse_foreign(Path(out))  # (a --parts build checks the rest of its own --out: gradindex.index.build_parts)
    else:
        refuse_part(Path(out))
    with index_lock(out, "gradindex build"):  # before loading anything: a second build is refused at once
        model, tok, data_tok, cfg = load_inputs(o, opts)
        if o["parts"] is not None:
            from gradindex.index.build_parts import parts_of

            parts_of(o["parts"], len(data_tok))  # (before the plan is printed)
        if distributed.rank() == 0:
            click.echo(plan_build(model, cfg, len(data_tok), not o["no_index"], opts.icfg.factory,
                                  opts.icfg.sketch_bytes, longest_example(data_tok)).summary(), err=True)
        try:
            res, idx = build_index(model, tok, data_tok, out, cfg, index=None if o["no_index"] else opts.icfg,
                                   model_id=str(Path(o["model_dir"]).resolve()), data_id=str(Path(o["data"]).resolve()),
                                   overwrite=o["overwrite"], progress=not o["quiet"], repair=o["repair"],
                                   parts=o["parts"])
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted; the shards written so far in {out} are kept: re-run the same command "
                              "(without --overwrite) to resume") from None
    if distributed.rank() == 0:
        _report(out, res, idx)


def _report(out, res, idx) -> None:
    """What the build wrote: examples, layers, numbers and bytes per example, time; warnings."""
    from gradindex.spec.manifest import Manifest
    from gradindex.store.codes import bytes_per_number

    m = Manifest.of(res.manifest)
    numbers = sum(s.dim for s in m.layers.values())
    row_bytes = int(numbers * bytes_per_number(m.storage))
    full_eigen = m.basis.get("space") == "full-eigen"
    share = m.basis.get("kept_share")
    rows = f"full-space ekfac eigen-coordinates keeping {share:.0%} of the influence, " if full_eigen else \
        "in the ekfac eigenbasis, " if m.transcoded else ""
    click.echo(f"built {out}: {m.examples} examples x {len(m.layers)} layers "
               f"({numbers:,} numbers, {rows}{m.storage}: {human_bytes(row_bytes)} per example) "
               f"in {res.seconds:.1f} s ({res.examples_computed} computed now)")
    if m.get("nonfinite_ids"):
        click.echo(f"warning: {len(m.get('nonfinite_ids'))} examples had non-finite gradients "
                   f"(stored as zeros, listed in manifest.json 'nonfinite_ids')", err=True)
    if getattr(idx, "parts", None) is not None:  # (a sharded index: build --parts)
        ranges = ", ".join(f"{p.dir.name} rows {p.first}-{p.stop - 1}" for p in idx.parts)
        click.echo(f"{len(idx.parts)} parts: {ranges}")
    elif idx is not None:
        click.echo(report(idx))


@dataclass
class Settings:
    """What the build's options resolve to before anything is loaded."""

    spec: object
    """The projection (``auto``: sized by the budget at capture)."""
    config: dict
    """:class:`~gradindex.pipeline.BuildConfig`'s arguments (``max_length`` may still be capped)."""
    icfg: object
    """The FAISS stage's :class:`~gradindex.index.IndexConfig`."""


OPTION_FIELDS = ("layers", "max_length", "batch_size", "route", "shard_size", "collect_covariance", "full_factors",
                 "precondition", "damping", "basis_examples", "basis_seed", "fisher", "fisher_seed", "optimizer_state",
                 "fit_sample", "sample_above", "rerank_fit", "rerank_correction")
"""The ``build`` options that are :class:`~gradindex.spec.build.BuildOptions` fields of the same name (what a
row holds is ``--rows``, or the row options of :data:`ROW_OPTIONS`; tests/test_library_defaults.py keeps this
the whole list)."""


def settings(o: dict) -> Settings:
    """Resolve ``build``'s (or ``plan``'s) options ``o`` and refuse inconsistent ones, before any work."""
    from gradindex.capture import ProjectionSpec
    from gradindex.pipeline import BuildConfig
    from gradindex.spec.rows import check_projection_options

    projection, budget = o["projection"], o["budget"]
    auto = check_projection_options(projection, budget)
    # one option per field (OPTION_FIELDS); the library resolves each "auto" and refuses bad settings, before any work
    config = {name: o[name] for name in OPTION_FIELDS}
    config.update(layers=tuple(o["layers"]), optimizer_state=o["optimizer_state"] or "")
    if o.get("rows"):  # --rows SPEC: what a row holds in one string (docs/formats.md, "Row specs")
        _refuse_row_options_with_rows(o["rows"])
        sugar = {"rows": o["rows"], "projection_kind": o["projection_kind"], "seed": o["seed"]}
    else:  # the row options: sugar for the spec
        stream = {"kind": o["projection_kind"], "seed": o["seed"]}
        sugar = {**{n: o[n] for n in ROW_OPTIONS[2:]}, "budget": (budget or "auto") if auto else 0,
                 "projection": ProjectionSpec(**stream) if auto else ProjectionSpec.parse(projection, **stream)}
    if config.get("rerank_fit") and config.get("fisher") != "empirical":
        from gradindex.precondition.fit import FULL_SPACE_FISHER

        raise ValueError(FULL_SPACE_FISHER)
    cfg = BuildConfig(**config, **sugar)  # (load_inputs builds it again from the spec it resolved to)
    config.update(rows=cfg.rows, projection_kind=cfg.projection_kind, seed=cfg.seed, damping=cfg.damping)
    icfg = index_config(o["index_type"], o["whiten"], o["damping"], o["normalize"], o["train_size"], o["cpu_index"],
                        o.get("sketch_bytes", 2048))
    if not o["no_index"]:
        cfg.rows.check_whiten(o["whiten"], cfg.precondition)
    return Settings(cfg.projection, config, icfg)


ROW_OPTIONS = ("projection", "budget", "allocation", "basis", "basis_damping", "transcode", "storage", "adam_mode")
"""The ``build`` options that a ``--rows`` spec sets."""


def _refuse_row_options_with_rows(rows: str) -> None:
    """Refuse ``--rows`` together with an option it sets (the spec alone says what a row holds)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return
    given = [f"--{n}" for n in ROW_OPTIONS if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT)]
    if given:
        flags = ", ".join(g.replace("_", "-").replace("--basis", "--projection-basis", 1) for g in given)
        raise ValueError(f"--rows {rows} says what a row holds, and so do {flags}: give one or the other")


def load_inputs(o: dict, opts: Settings):
    """The model, tokenizer, tokenized data and :class:`BuildConfig` of a build (notes and warnings on stderr)."""
    from gradindex.data import load_records, tokenize_records
    from gradindex.model import length_limit, load_causal_lm, vocab_size
    from gradindex.pipeline import BuildConfig

    layers, max_length, text_field = o["layers"], o["max_length"], o["text_field"]
    model, tok = load_causal_lm(o["model_dir"], dtype=o["dtype"], device=o["device"], adapter=o["adapter"],
                                chat_template=o["chat_template"], base_quantization=o["base_quantization"])
    if not layers and not o["adapter"]:
        note_unhooked(model)
    if o["projection"].strip().lower() != "auto":  # --projection auto stores what --budget buys
        check_capture_memory(model, opts.spec, layers, o["batch_size"], o["projection"])
    records = load_records(o["data"])
    data_tok = tokenize_records(records, tok, max_length, text_field, vocab_size=vocab_size(model))
    limit, why = length_limit(model, tok)
    if limit is not None and max_length > limit and max(map(len, data_tok.input_ids)) > limit:
        click.echo(f"note: --max-length {max_length} is more than {why}; using --max-length {limit}", err=True)
        max_length = limit
        data_tok = tokenize_records(records, tok, max_length, text_field, vocab_size=vocab_size(model))
    cfg = BuildConfig(**{**opts.config, "max_length": max_length})
    if not o["no_index"]:
        check_index_type(o["index_type"], len(data_tok), o["train_size"])
    if data_tok.n_truncated:
        click.echo(f"warning: {data_tok.n_truncated} of {len(data_tok)} examples were longer than "
                   f"--max-length {max_length} and were truncated", err=True)
    return model, tok, data_tok, cfg
