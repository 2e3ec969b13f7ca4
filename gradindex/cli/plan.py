"""``gradindex plan MODEL_DIR DATA [build options]``: what ``gradindex build`` would store and cost, before it runs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from gradindex.cli import main
from gradindex.cli.build import build, check_parts, load_inputs, settings
from gradindex.cli.common import human_bytes, user_errors

_NOT_FOR_PLAN = ("out", "overwrite", "repair", "quiet")


def _plan_params() -> list[click.Parameter]:
    """``build``'s arguments and options, with ``--out`` optional (only its free disk is read)."""
    params = [p for p in build.params if p.name not in _NOT_FOR_PLAN]
    params.insert(2, click.Option(["--out"], default=None, type=click.Path(file_okay=False),
                                  help="Index directory the build would write: its disk's free space is compared "
                                       "with the peak (default: the current directory's disk)."))
    params.append(click.Option(["--batches"], default=2, show_default=True, type=int,
                               help="Capture batches timed for the estimate (after one warm-up); 0: no timing."))
    params.append(click.Option(["--tokens-per-example"], default=None, type=click.IntRange(min=1),
                               help="With a MODEL_DIR that holds a config.json but no weights: count every example "
                                    "of DATA as this many tokens (capped at --max-length) instead of tokenizing it "
                                    "(needed where the folder has no tokenizer files and DATA has no input_ids)."))
    params.append(click.Option(["--tflops"], default=None, type=float,
                               help="With a MODEL_DIR without weights: the sustained TFLOP/s per GPU the time "
                                    "estimate assumes (default: 400 in bfloat16/float16, 25 in float32)."))
    params.append(click.Option(["--json", "as_json"], is_flag=True, help="One JSON object instead of the table."))
    return params


@user_errors
def _plan(model_dir, data, out, batches, as_json, tokens_per_example, tflops, **o):
    """Print what ``gradindex build MODEL_DIR DATA`` with these options would store per layer, its disk
    (peak and final), memory, time (from a few measured capture batches) and lookup cost; nothing is written.

    A MODEL_DIR with a config.json and no weights (e.g. a 70B model's config alone) is planned without
    loading any: the model is built on the meta device, DATA is read for its token counts only, and the
    time is a FLOP estimate at an assumed throughput, with the capture's GPU memory and the full-space
    files' size (docs/scaling.md, "Plan from a config alone")."""
    from gradindex.diskspace import free_bytes
    from gradindex.index.build_parts import parts_of
    from gradindex.model import is_weightless, resolve_device, resolve_pad_id
    from gradindex.pipeline import routed_plan
    from gradindex.plan import longest_example, measure_seconds

    o = {**o, "model_dir": model_dir, "data": data}
    check_parts(o.get("parts"), o["no_index"])  # (refused as build refuses it)
    opts = settings(o)
    est = None
    if is_weightless(model_dir):
        plan, est = _config_only(o, opts, tokens_per_example, tflops, out)
    else:
        if tokens_per_example is not None or tflops is not None:
            raise ValueError("--tokens-per-example and --tflops are for a MODEL_DIR without weights (a config-only "
                             f"plan); {model_dir!r} has weights: its plan tokenizes DATA and times real batches")
        o["device"] = str(resolve_device(o["device"]))
        model, tok, data_tok, cfg = load_inputs(o, opts)
        if o.get("parts") is not None:
            parts_of(o["parts"], len(data_tok))
        args = (not o["no_index"], opts.icfg.factory, opts.icfg.sketch_bytes)
        cfg, plan = routed_plan(model, cfg, len(data_tok), Path(out or "."), True, args, longest_example(data_tok))
        if batches > 0 and len(data_tok):
            plan.seconds = measure_seconds(model, data_tok, cfg, plan, resolve_pad_id(model, tok), batches)
    free = free_bytes(out or ".")
    if as_json:
        click.echo(json.dumps(_plan_dict(plan, free, est)))
    else:
        _print_plan(plan, free, est)


def _plan_dict(plan, free: int, est) -> dict:
    """The plan as ``--json`` prints it (``estimate``: a config-only plan's FLOPs and GPU memory)."""
    d = {"examples": plan.examples, "storage": plan.storage, "transcode": plan.transcode,
         "layers": [{"name": lp.name, "n_out": lp.n_out, "n_in": lp.n_in, "k_g": lp.k_g, "k_a": lp.k_a,
                     "numbers": lp.numbers} for lp in plan.layers],
         "bytes": {"capture": plan.capture_bytes, "rotated": plan.rotated_bytes, "store": plan.store_bytes,
                   "precond": plan.precond_bytes,
                   "basis": plan.basis_bytes, "index": plan.index_bytes, "final": plan.final_disk,
                   "peak": plan.peak_disk, "free": free, "per_example": plan.row_bytes},
         "ram_bytes": plan.ram_bytes, "seconds": plan.seconds, "exact_stage_seconds": list(plan.exact_seconds),
         "lookup": {**(plan.lookup.to_dict() if plan.lookup else {}), "exhaustive_scan_bytes": plan.store_bytes}}
    if est is not None:
        d["estimate"] = est.to_dict()
    return d


def _print_plan(plan, free: int, est) -> None:
    from gradindex.store.codes import row_bytes

    click.echo(f"{'layer':<40} {'N_o x N_i':>12} {'stored k_g x k_a':>17} {'numbers':>10} {'bytes/example':>14}")
    for lp in plan.layers:
        click.echo(f"{lp.name:<40} {f'{lp.n_out}x{lp.n_in}':>12} {f'{lp.k_g}x{lp.k_a}':>17} {lp.numbers:>10,} "
                   f"{row_bytes(plan.storage, lp.numbers):>14,}")
    click.echo(f"disk: capture {human_bytes(plan.capture_bytes)} ({plan.capture_storage} rows)"
               + (f", rotated copy {human_bytes(plan.rotated_bytes)} (while coded)" if plan.rotated_bytes else "")
               + (f", transcoded copy {human_bytes(plan.store_bytes)}" if plan.transcode else "")
               + f", fits {human_bytes(plan.precond_bytes + plan.basis_bytes)}, FAISS {human_bytes(plan.index_bytes)}; "
               f"peak {human_bytes(plan.peak_disk)}, final {human_bytes(plan.final_disk)}; "
               f"{human_bytes(free)} free{'' if free >= plan.peak_disk else ' (NOT ENOUGH: the build would refuse)'}")
    for line in est.lines() if est is not None else []:
        click.echo(line)
    click.echo(plan.summary())


def _config_only(o: dict, opts, tokens_per_example: int | None, tflops: float | None, out: str | None = None):
    """``(plan, estimate)`` of a MODEL_DIR without weights: the model on the meta device, DATA's token counts,
    FLOPs at ``tflops`` (:func:`gradindex.estimate.estimate_build`)."""
    from gradindex.cli.build import note_unhooked
    from gradindex.cli.index import check_index_type
    from gradindex.estimate import estimate_build
    from gradindex.model import load_meta_model
    from gradindex.pipeline import routed_plan
    from gradindex.store.builder import BuildConfig

    if o["adapter"] or o["base_quantization"] != "none":
        flag = "--adapter" if o["adapter"] else "--base-quantization"
        raise ValueError(f"{flag} needs the base model's weights; a config-only plan (MODEL_DIR without "
                         f"weights) sizes the base model's layers: leave {flag} out")
    model, tok = load_meta_model(o["model_dir"], o["dtype"])
    if not o["layers"]:
        note_unhooked(model)
    lengths, max_length = _token_counts(o, model, tok, tokens_per_example)
    cfg = BuildConfig(**{**opts.config, "max_length": max_length})
    if not o["no_index"]:
        check_index_type(o["index_type"], len(lengths))
    args = (not o["no_index"], opts.icfg.factory, opts.icfg.sketch_bytes)
    cfg, plan = routed_plan(model, cfg, len(lengths), Path(out or "."), True, args, max(lengths, default=1))
    est = estimate_build(model, cfg, plan, lengths, o["dtype"], tflops)
    plan.seconds, plan.from_flops, plan.exact_seconds = est.seconds, True, (est.exact_seconds, est.exact_seconds)
    return plan, est


def _token_counts(o: dict, model, tok, tokens_per_example: int | None) -> tuple[list[int], int]:
    """``(tokens of each example of DATA, --max-length as capped)`` without the weights: ``--tokens-per-example``
    for every example, else DATA's input_ids, else its records tokenized by the folder's tokenizer."""
    from gradindex.data import load_records, tokenize_records
    from gradindex.model import length_limit, vocab_size

    records, max_length = load_records(o["data"]), o["max_length"]
    limit, why = length_limit(model, tok)
    if limit is not None and max_length > limit:
        click.echo(f"note: --max-length {max_length} is more than {why}; using --max-length {limit}", err=True)
        max_length = limit
    if tokens_per_example is not None:
        return [min(tokens_per_example, max_length)] * len(records), max_length
    if "input_ids" in records.column_names:
        return [max(1, min(len(ids), max_length)) for ids in records["input_ids"]], max_length
    if tok is None:
        raise ValueError(f"{o['model_dir']!r} has no weights and no tokenizer files, so DATA's texts cannot be "
                         "counted in tokens: give --tokens-per-example N (an example's tokens), or add the "
                         "tokenizer files to the folder")
    data = tokenize_records(records, tok, max_length, o["text_field"], vocab_size=vocab_size(model))
    return [len(ids) for ids in data.input_ids], max_length


plan = click.Command("plan", params=_plan_params(), callback=_plan, help=_plan.__doc__,
                     short_help="What a build would store and cost, before it runs.")
main.add_command(plan)
