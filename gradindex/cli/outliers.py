"""``gradindex outliers INDEX_DIR``: training examples ranked by self-influence."""

from __future__ import annotations

import json

import click

from gradindex.cli import main
from gradindex.cli.common import MethodChoice, damping_option, index_method, number, user_errors, whole_index


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--method", default=None, type=MethodChoice("outliers", selfnorm=False),
              help="Self-influence under this method (default: ekfac where the index answers it, else graddot).")
@damping_option()
@click.option("--by", default="self_influence", show_default=True,
              type=click.Choice(["self_influence", "per_token"]),
              help="Rank by self-influence, or by self-influence per target token.")
@click.option("--top", default=20, show_default=True, type=int, help="How many to show.")
@click.option("--layers", multiple=True, help="Glob of layers (repeatable). Default: all.")
@click.option("--data", default=None, type=click.Path(), help="Training data file, if it moved since the build.")
@click.option("--model", "model_dir", default=None, type=click.Path(),
              help="Model directory or .gguf file, for the texts (default: the one the index was built with).")
@click.option("--no-text", is_flag=True, help="Do not load the texts.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@user_errors
@whole_index()
def outliers(index_dir, method, damping, by, top, layers, data, model_dir, no_text, as_json):
    """The training examples in INDEX_DIR with the largest self-influence (likely mislabeled or odd)."""
    import fnmatch

    from gradindex.apps.outliers import rank_outliers
    from gradindex.apps.texts import row_texts
    from gradindex.store.opened import OpenStore

    if top < 1:
        raise ValueError(f"--top must be >= 1, got {top}")
    with OpenStore(index_dir, then="look for outliers") as ix:
        chosen = None
        if layers:
            chosen = [n for n in ix.layers if any(fnmatch.fnmatchcase(n, p) for p in layers)]
            if not chosen:
                raise ValueError(f"--layers {list(layers)} match no layer of the index (they look like "
                                 f"{ix.layers[:2]})")
        ranking = rank_outliers(ix, method or index_method(index_dir), damping, chosen)
        rows = ranking.top(top, by)
        texts, problem = ([None] * len(rows), None) if no_text else row_texts(ix, [r["id"] for r in rows], data,
                                                                              model_dir)
    if problem:
        click.echo(f"note: {problem}", err=True)
    for rank, (r, t) in enumerate(zip(rows, texts, strict=True), start=1):
        if as_json:
            click.echo(json.dumps({"rank": rank, **r, "text": t}))
        else:
            text = "(text unavailable)" if t is None else " ".join(t.split())[:80]
            click.echo(f"{rank:>4}  id {r['id']:>7}  self-influence {number(r['self_influence']):>11}  "
                       f"per token {number(r['per_token']):>10}  {text}")
