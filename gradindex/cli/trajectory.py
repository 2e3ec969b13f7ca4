"""``gradindex trajectory DATA --out IDX --checkpoint CK1 --checkpoint CK2 ...``: a TracIn index."""

from __future__ import annotations

from pathlib import Path

import click

from gradindex.cli import main
from gradindex.cli.common import data_options, user_errors
from gradindex.spec.build import DEFAULT_BATCH_SIZE


@main.command()
@click.argument("data", type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Trajectory index directory to write.")
@click.option("--checkpoint", "models", multiple=True, required=True, type=click.Path(file_okay=False, exists=True),
              help="A saved checkpoint's model directory, in training order (repeatable).")
@click.option("--lr", "lrs", multiple=True, type=float,
              help="Learning rate of each checkpoint, in the same order (one for all; default: the last "
                   "logged in its trainer_state.json).")
@click.option("--projection", default="16", show_default=True, help="K, KAxKG or none (every checkpoint alike).")
@click.option("--seed", default=0, show_default=True, type=int, help="Projection seed.")
@click.option("--layers", multiple=True, help="Glob of layer names to hook (repeatable). Default: all block linears.")
@data_options
@click.option("--storage", default="int8", show_default=True, type=click.Choice(["fp32", "fp16", "int8", "int4"]))
@click.option("--batch-size", default=DEFAULT_BATCH_SIZE, show_default=True, type=int)
@click.option("--shard-size", default=4096, show_default=True, type=int)
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--overwrite", is_flag=True,
              help="Rebuild every checkpoint's index in OUT (a trajectory index); without it a killed run resumes.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
def trajectory(data, out, models, lrs, projection, seed, layers, text_field, max_length, storage, batch_size,
               shard_size, device, overwrite, quiet):
    """Index DATA under each checkpoint (raw rows) for TracIn-CP: query OUT with --method tracin."""
    from gradindex.apps.tracin import build_trajectory, checkpoints
    from gradindex.capture import ProjectionSpec
    from gradindex.data import load_records, tokenize_records
    from gradindex.model import length_limit, load_causal_lm, vocab_size
    from gradindex.pipeline import BuildConfig

    ckpts = checkpoints(list(models), list(lrs))
    first, tok = load_causal_lm(ckpts[0].model, device=device)
    limit, why = length_limit(first, tok)
    if limit is not None and max_length > limit:
        if not quiet:
            click.echo(f"note: --max-length {max_length} is more than {why}; using --max-length {limit}", err=True)
        max_length = limit
    records = load_records(data)
    tokens = tokenize_records(records, tok, max_length, text_field, vocab_size=vocab_size(first))
    del first
    cfg = BuildConfig.raw(projection=ProjectionSpec.parse(projection, seed=seed), layers=tuple(layers),
                      max_length=max_length, batch_size=batch_size, shard_size=shard_size, storage=storage)
    meta = build_trajectory(ckpts, tokens, out, cfg, lambda m: load_causal_lm(m, device=device),
                            data_id=str(Path(data).resolve()), progress=not quiet, overwrite=overwrite)
    steps = ", ".join(f"{c['step'] if c['step'] is not None else '?'} (lr {c['lr']:g})" for c in meta["checkpoints"])
    click.echo(f"built {out}: {len(tokens)} examples under {len(ckpts)} checkpoints at steps {steps}; "
               "query it with --method tracin")
