"""``gradindex dedup INDEX_DIR --out groups.jsonl``: exact and gradient-space near-duplicate groups."""

from __future__ import annotations

import json
from pathlib import Path

import click

from gradindex.cli import main
from gradindex.cli.common import MethodChoice, damping_option, user_errors, whole_index


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False),
              help="JSONL file of groups (ids, keep, drop, kind, min_cosine, texts).")
@click.option("--threshold", default=None, type=float,
              help="Gradient cosine at or above which two examples are near-duplicates "
                   "(default: 0.6 for graddot, 0.5 for whitened gradients).")
@click.option("--method", default=None, type=MethodChoice("dedup", selfnorm=False),
              help="Compare raw gradients (on an index stored in the EK-FAC eigenbasis: its rows "
                   "un-whitened), or gradients whitened by this preconditioner "
                   "(default: graddot; ekfac on an index stored in the EK-FAC eigenbasis).")
@damping_option("Relative damping of the whitening.")
@click.option("--neighbors", default=16, show_default=True, type=int, help="Neighbours proposed per example.")
@click.option("--sketch", default=256, show_default=True, type=int,
              help="Numbers per example in the candidate search (0: full vectors).")
@click.option("--data", default=None, type=click.Path(), help="Training data file, if it moved since the build.")
@click.option("--model", "model_dir", default=None, type=click.Path(),
              help="Model directory or .gguf file, for the texts (default: the one the index was built with).")
@click.option("--no-text", is_flag=True, help="Do not write the texts.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
@whole_index()
def dedup(index_dir, out, threshold, method, damping, neighbors, sketch, data, model_dir, no_text, quiet):
    """Group the training examples of INDEX_DIR that are exact or near-duplicates in gradient space."""
    from gradindex.apps.dedup import DedupConfig, find_duplicates
    from gradindex.apps.texts import row_texts
    from gradindex.store.opened import OpenStore

    path = Path(out)
    tmp = path.with_name(path.name + ".tmp")
    try:  # before the search, not after it
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.open("w").close()
        tmp.unlink()
    except OSError as e:
        raise ValueError(f"--out {out} cannot be written ({e.strerror or e}); give a path in a folder you can write "
                         "to (nothing was searched)") from None
    cfg = DedupConfig(threshold=threshold, method=method, damping=damping, neighbors=neighbors, sketch=sketch)
    with OpenStore(index_dir, then="deduplicate") as ix:
        res = find_duplicates(ix, cfg, progress=not quiet)
        ids = sorted({i for g in res.groups for i in g.ids})
        texts, problem = ({}, None)
        if ids and not no_text:
            found, problem = row_texts(ix, ids, data, model_dir)
            texts = dict(zip(ids, found, strict=True))
    if problem:
        click.echo(f"note: {problem}", err=True)
    with tmp.open("w") as f:
        for j, g in enumerate(res.groups):
            rec = {"group": j, **g.to_dict()}
            if texts:
                rec["texts"] = [texts.get(i) for i in g.ids]
            f.write(json.dumps(rec) + "\n")
    tmp.replace(path)
    dropped = sum(len(g.ids) - 1 for g in res.groups)
    kinds = {k: sum(g.kind == k for g in res.groups) for k in ("exact", "near", "exact+near")}
    click.echo(f"{len(res.groups)} groups ({kinds['exact']} exact, {kinds['near']} near, "
               f"{kinds['exact+near']} both) over {res.n} examples; suggest dropping {dropped}; wrote {out} "
               f"in {res.seconds['total']:.1f} s")
