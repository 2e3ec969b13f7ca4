"""``gradindex plan MODEL_DIR DATA [build options]``: what ``gradindex build`` would store and cost, before it runs."""

from __future__ import annotations

import json

import click

from gradindex.cli import main
from gradindex.cli.build import build, load_inputs, settings
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
    params.append(click.Option(["--json", "as_json"], is_flag=True, help="One JSON object instead of the table."))
    return params


@user_errors
def _plan(model_dir, data, out, batches, as_json, **o):
    """Print what ``gradindex build MODEL_DIR DATA`` with these options would store per layer, its disk
    (peak and final), memory, time (from a few measured capture batches) and lookup cost; nothing is written."""
    from gradindex.diskspace import free_bytes
    from gradindex.model import resolve_device, resolve_pad_id
    from gradindex.plan import measure_seconds, plan_build

    o = {**o, "model_dir": model_dir, "data": data}
    opts = settings(o)
    o["device"] = str(resolve_device(o["device"]))
    model, tok, data_tok, cfg = load_inputs(o, opts)
    plan = plan_build(model, cfg, len(data_tok), not o["no_index"], opts.icfg.factory, opts.icfg.sketch_bytes)
    if batches > 0 and len(data_tok):
        plan.seconds = measure_seconds(model, data_tok, cfg, plan, resolve_pad_id(model, tok), batches)
    free = free_bytes(out or ".")
    if as_json:
        click.echo(json.dumps({
            "examples": plan.examples, "storage": plan.storage, "transcode": plan.transcode,
            "layers": [{"name": lp.name, "n_out": lp.n_out, "n_in": lp.n_in, "k_g": lp.k_g, "k_a": lp.k_a,
                        "numbers": lp.numbers} for lp in plan.layers],
            "bytes": {"capture": plan.capture_bytes, "rotated": plan.rotated_bytes, "store": plan.store_bytes,
                      "precond": plan.precond_bytes,
                      "basis": plan.basis_bytes, "index": plan.index_bytes, "final": plan.final_disk,
                      "peak": plan.peak_disk, "free": free, "per_example": plan.row_bytes},
            "ram_bytes": plan.ram_bytes, "seconds": plan.seconds,
            "lookup": {**(plan.lookup.to_dict() if plan.lookup else {}), "exhaustive_scan_bytes": plan.store_bytes}}))
        return
    click.echo(f"{'layer':<40} {'N_o x N_i':>12} {'stored k_g x k_a':>17} {'numbers':>10} {'bytes/example':>14}")
    from gradindex.store.codes import row_bytes

    for lp in plan.layers:
        click.echo(f"{lp.name:<40} {f'{lp.n_out}x{lp.n_in}':>12} {f'{lp.k_g}x{lp.k_a}':>17} {lp.numbers:>10,} "
                   f"{row_bytes(plan.storage, lp.numbers):>14,}")
    click.echo(f"disk: capture {human_bytes(plan.capture_bytes)} ({plan.capture_storage} rows)"
               + (f", rotated copy {human_bytes(plan.rotated_bytes)} (while coded)" if plan.rotated_bytes else "")
               + (f", transcoded copy {human_bytes(plan.store_bytes)}" if plan.transcode else "")
               + f", fits {human_bytes(plan.precond_bytes + plan.basis_bytes)}, FAISS {human_bytes(plan.index_bytes)}; "
               f"peak {human_bytes(plan.peak_disk)}, final {human_bytes(plan.final_disk)}; "
               f"{human_bytes(free)} free{'' if free >= plan.peak_disk else ' (NOT ENOUGH: the build would refuse)'}")
    click.echo(plan.summary())


plan = click.Command("plan", params=_plan_params(), callback=_plan, help=_plan.__doc__,
                     short_help="What a build would store and cost, before it runs.")
main.add_command(plan)
