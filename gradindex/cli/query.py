"""``gradindex query INDEX_DIR``: the training examples that most influenced a text or completion."""

from __future__ import annotations

import json
import shutil
import time

import click

from gradindex.cli import main
from gradindex.cli.common import (
    MethodChoice,
    damping_option,
    engine_options,
    messages_option,
    number,
    parse_messages,
    refine_config,
    refine_options,
    status,
    user_errors,
    whole_index,
)
from gradindex.methods import REGISTRY, resolve


class RerankChoice(click.ParamType):
    """``auto`` (None: the engine's default) or a number of candidates >= 0."""

    name = "auto/N"

    def convert(self, value, param, ctx):
        if value is None or str(value).strip().lower() == "auto":
            return None
        try:
            n = int(value)
        except (TypeError, ValueError):
            n = -1
        if n < 0:
            self.fail(f"{value!r} is not auto or a number of candidates >= 0", param, ctx)
        return n


def _queries(o: dict) -> list[dict]:
    """Every query of the command line (the ``query`` options ``o``) as a record dict (texts, the
    prompt/completion pair, chats, the file's)."""
    from gradindex.query import read_queries

    prompt, completion, queries_file, text_field = o["prompt"], o["completion"], o["queries_file"], o["text_field"]
    out: list = list(o["texts"]) + parse_messages(o["messages"])
    if (prompt is None) != (completion is None):
        raise ValueError("--prompt and --completion go together (the loss is taken on the completion)")
    if prompt is not None:
        out.append({"prompt": prompt, "completion": completion})
    if queries_file:
        out.extend(read_queries(queries_file))
    if not out:
        raise ValueError("nothing to query: pass --text T, --prompt P --completion C, --messages JSON, "
                         "or --queries FILE")
    out = [{text_field: q} if isinstance(q, str) else q for q in out]
    if o.get("target") is not None:  # (a --queries record's own target stays)
        out = [{"target": o["target"], **q} for q in out]
    return out


def _line(text: str | None, width: int) -> str:
    if text is None:
        return "(text unavailable)"
    s = " ".join(str(text).split())
    return s if len(s) <= width else s[: max(0, width - 3)] + "..."


def _print_result(i: int, q: str, r) -> None:
    width = max(40, shutil.get_terminal_size((100, 20)).columns - 30)
    where = f"{len(r.layers)} layers" if len(r.layers) > 1 else r.layers[0]
    click.echo(f"query {i + 1}: {_line(q, width)}")
    tokens = f"{r.num_tokens} target tokens, loss {r.loss:.3f}, " if r.loss is not None else ""  # (tracin: none)
    click.echo(f"  {tokens}method {r.method}"
               f"{f' (damping {r.damping})' if r.damping is not None else ''}, {where}")
    if getattr(r, "stage", ""):
        click.echo(f"  scores: {r.stage}")
    for title, hits in (("most influential", r.hits), ("most negative", r.lowest)):
        if not hits:
            continue
        click.echo(f"  {title}:")
        click.echo(f"  {'rank':>4}  {'id':>8}  {'score':>11}  text")
        for j, h in enumerate(hits):
            score = h.full_score if getattr(h, "full_score", None) is not None else h.score
            click.echo(f"  {j + 1:>4}  {h.id:>8}  {number(score):>11}  {_line(h.text, width)}")


def _json(r) -> list[dict]:
    """The query's results, each row also saying what produced it: method, damping, the query's seconds; texts
    capped at :data:`~gradindex.apps.texts.RESULT_TEXT_CHARS` characters (``text_chars``: the whole length)."""
    from gradindex.apps.texts import capped

    made = {"method": r.method, "damping": getattr(r, "damping", None), "stage": getattr(r, "stage", ""),
            "seconds": {n: round(float(v), 6) for n, v in getattr(r, "seconds", {}).items()}}
    out = [{"rank": j + 1, "kind": "top", **capped(h.to_dict()), **made} for j, h in enumerate(r.hits)]
    out += [{"rank": j + 1, "kind": "lowest", **capped(h.to_dict()), **made} for j, h in enumerate(r.lowest)]
    return out


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--text", "texts", multiple=True, help="A query text (loss on every next token); repeatable.")
@click.option("--prompt", default=None, help="Query prompt (no loss), with --completion.")
@click.option("--completion", default=None, help="Query completion (the loss is taken on it).")
@messages_option
@click.option("--queries", "queries_file", type=click.Path(dir_okay=True, exists=True),
              help="File of queries, any format and fields `gradindex build` reads.")
@click.option("--text-field", default="text", show_default=True, help="Text field of --queries records.")
@click.option("--target", default=None,
              help="Measure only this piece of each query's answer (its completion, assistant turn or text; a "
                   "--queries record may carry its own 'target'): the loss on the other tokens is left out. For "
                   "fact tracing, the fact itself (docs/query.md).")
@click.option("-k", "k", default=10, show_default=True, type=click.IntRange(min=1), help="Results per query.")
@click.option("--method", default=None, type=MethodChoice("query"),
              help="Scoring method (default: ekfac-selfnorm where the index answers ekfac, plain ekfac with a "
                   "note where it has no self-influence; else graddot; adam on an index built with "
                   "--optimizer-state; tracin on a `gradindex trajectory` index).")
@damping_option()
@click.option("--layers", multiple=True, help="Glob of layers to search (repeatable). Default: all.")
@click.option("--lowest", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also the N most negative examples.")
@click.option("--rerank-full", default="auto", show_default=True, type=RerankChoice(),
              help="The exact stage: re-rank the index's top N candidates in full (unprojected) space, any method "
                   "(kfac/ekfac need the full-space fit: `gradindex precondition INDEX --method ekfac --space full` "
                   "or build --rerank-fit; and the training data), a forward + backward per candidate, the union "
                   "of the queries' candidates once. auto (= 0): the first stage answers.")
@click.option("--candidates", default=None, type=click.IntRange(min=1),
              help="Sketch index: examples its first tier hands to the exact re-rank (default: 500, or N/1000 "
                   "above 500,000 examples; on a sharded index the whole index's count, each part re-ranking "
                   "its share); per-layer FAISS indices: ANN results per layer (default 2000).")
@click.option("--shortlist", default=None, type=click.IntRange(min=1),
              help="Of those, kept per layer after exact per-layer scoring (default 100).")
@click.option("--nprobe", default=None, type=click.IntRange(min=1),
              help="IVF lists to visit per layer (default: the index's).")
@engine_options()
@click.option("--optimizer-state", default=None, type=click.Path(dir_okay=False),
              help="The optimizer state of an Adam-preconditioned index, if it moved since the build.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON list of results per query (a line each); every result also names the "
                   "method, the damping and the query's seconds per stage.")
@refine_options
@user_errors
@whole_index()
def query(**o):
    """Find the training examples in INDEX_DIR that most influenced each query."""
    qs = _queries(o)
    t0 = time.perf_counter()
    status(f"loading model and index {o['index_dir']} ...")  # before the imports: torch, transformers, datasets
    from gradindex.query import QueryEngine

    own = (resolve(m.engine) for m in REGISTRY.values() if m.engine)  # (a method's own index kind: TracIn's)
    engine_class = next((e for e in own if e.opens(o["index_dir"])), QueryEngine)
    with engine_class(o["index_dir"], model_dir=o["model_dir"], device=o["device"], data=o["data"],
                      use_gpu=not o["cpu_index"], optimizer_state=o["optimizer_state"]) as engine:
        status(f"searching {engine.n:,} examples for {len(qs)} quer{'y' if len(qs) == 1 else 'ies'} "
               f"(loaded in {time.perf_counter() - t0:.1f} s) ...")
        results = answer(engine, qs, o)
    _show(qs, results, o["text_field"], o["as_json"])


def answer(engine, qs: list[dict], o: dict) -> list:
    """``engine``'s answers to ``qs`` under the ``query`` options ``o`` (one index's engine or a sharded one)."""
    engine.announce = lambda msg: click.echo(f"note: {msg}", err=True)  # (the exact stage's time estimate)
    return engine.query_batch(qs, k=o["k"], method=o["method"], damping=o["damping"], layers=o["layers"] or None,
                              lowest=o["lowest"], rerank_full=o["rerank_full"], candidates=o["candidates"],
                              shortlist=o["shortlist"], nprobe=o["nprobe"], text_field=o["text_field"],
                              refine=refine_config(o["refine"]) or False)


def _show(qs, results, text_field, as_json) -> None:
    from gradindex.query.inputs import describe

    notes = list(dict.fromkeys(n for r in results for n in r.notes))
    for n in notes:
        click.echo(f"note: {n}", err=True)
    for i, (q, r) in enumerate(zip(qs, results, strict=True)):
        if as_json:
            click.echo(json.dumps(_json(r)))
        else:
            _print_result(i, describe(q, text_field), r)
