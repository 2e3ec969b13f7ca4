"""``gradindex explain INDEX_DIR``: which tokens of a training example (and of the query) make its score."""

from __future__ import annotations

import json

import click

from gradindex.cli import main
from gradindex.cli.common import (
    MethodChoice,
    damping_option,
    engine_options,
    messages_option,
    parse_messages,
    refine_config,
    refine_options,
    user_errors,
    whole_index,
)


def _show(title: str, ts, top: int) -> None:
    order = sorted(range(len(ts.scores)), key=lambda t: -abs(ts.scores[t]))[:top]
    click.echo(f"  {title} (sum {ts.total:.6g}; largest |term| first):")
    for t in order:
        mark = "" if ts.target[t] else "  (not a target)"
        click.echo(f"    {t:>4}  {ts.scores[t]:>+12.4e}  {ts.tokens[t]!r}{mark}")


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--query", "--text", "text", default=None, help="The query text (loss on every next token).")
@click.option("--prompt", default=None, help="Query prompt (no loss), with --completion.")
@click.option("--completion", default=None, help="Query completion (the loss is taken on it).")
@messages_option
@click.option("--target", default=None,
              help="Measure only this piece of the query's answer, as `query --target` does: its other tokens are "
                   "not targets.")
@click.option("--id", "ids", multiple=True, type=int, required=True,
              help="Training example (row) to explain; repeatable.")
@click.option("--method", default=None, type=MethodChoice("explain", selfnorm=False),
              help="Default: ekfac where the index answers it, else graddot; adam: an index built with "
                   "--optimizer-state (factored).")
@damping_option()
@click.option("--layers", multiple=True, help="Glob of layers (repeatable). Default: all.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1),
              help="Tokens shown per side (text output).")
@engine_options(cpu_index=False)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per example (a line each), every token.")
@click.option("--full-space", is_flag=True,
              help="Also each example's exact full-space score, what `query --rerank-full C` ranks by (a forward + "
                   "backward per example; kfac/ekfac need `gradindex precondition INDEX --space full`).")
@refine_options
@user_errors
@whole_index()
def explain(index_dir, text, prompt, completion, messages, target, ids, method, damping, layers, top, model_dir, data,
            device, as_json, full_space, refine):
    """Split the score of training example(s) --id for a query into one term per token, both sides."""
    from gradindex.apps.explain import Explainer
    from gradindex.query import QueryEngine
    from gradindex.query.inputs import as_record

    if (prompt is None) != (completion is None):
        raise ValueError("--prompt and --completion go together (the loss is taken on the completion)")
    if (text is not None) + (prompt is not None) + len(messages) != 1:
        raise ValueError("give one query: --query TEXT, --prompt P --completion C, or --messages JSON")
    query = text if text is not None else (prompt, completion) if prompt is not None else parse_messages(messages)[0]
    if target is not None:
        query = {**as_record(query), "target": target}
    with QueryEngine(index_dir, model_dir, device=device, data=data, refine=refine_config(refine)) as engine:
        out = Explainer(engine).explain(query, list(ids), method, damping, list(layers) or None,
                                        full_space=full_space)
        shown = dict(zip(ids, engine.texts.texts(list(ids)), strict=True))
    for e in out:
        if as_json:
            click.echo(json.dumps(e.to_dict()))
            continue
        where = f"{len(e.layers)} layers" if len(e.layers) > 1 else e.layers[0]
        click.echo(f"training example {e.id}: score {e.score:.6g} ({e.method}"
                   f"{f', damping {e.damping}' if e.damping is not None else ''}; {where})")
        if e.full_score is not None:
            click.echo(f"  full-space score {e.full_score:.6g} (exact, what --rerank-full ranks by; the score and "
                       "token terms below are the stored rows')")
        text = shown.get(e.id) or "".join(e.train.tokens)
        if "\n[" in text:  # a conversation: one turn a line, with its role
            click.echo("  turns:\n" + "\n".join(f"    {t[:200]}" for t in text.splitlines()))
        else:
            click.echo(f"  text: {' '.join(text.split())[:200]}")
        _show("training tokens", e.train, top)
        share = f" ({abs(e.residual) / abs(e.score):.1%} of the score)" if e.score else ""
        click.echo(f"  residual {e.residual:+.6g}{share}: the score minus the training tokens' sum; "
                   f"{e.residual_cause}")
        _show("query tokens", e.query, top)
