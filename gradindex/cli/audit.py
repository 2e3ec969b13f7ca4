"""``gradindex audit INDEX_DIR --queries FILE --out DIR``: the audit report (JSONL + one static HTML page)."""

from __future__ import annotations

import click

from gradindex.cli import main
from gradindex.cli.common import MethodChoice, damping_option, engine_options, user_errors, whole_index


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--queries", "queries_file", required=True, type=click.Path(exists=True),
              help="File of queries, any format and fields `gradindex build` reads.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for report.html, queries.jsonl and summary.json.")
@click.option("-k", "--k", "k", default=10, show_default=True, type=int,
              help="Most helpful and most harmful examples per query.")
@click.option("--method", default=None, type=MethodChoice("audit", selfnorm=False),
              help="Scoring method (default: ekfac where the index answers it, else graddot).")
@damping_option()
@click.option("--layers", multiple=True, help="Glob of layers (repeatable). Default: all.")
@click.option("--outliers", default=20, show_default=True, type=int, help="Outliers shown (by self-influence).")
@click.option("--dedup-threshold", default=None, type=float,
              help="Gradient cosine of near-duplicate groups (default: gradindex dedup's).")
@click.option("--no-dedup", is_flag=True, help="Skip the duplicate search.")
@click.option("--text-field", default="text", show_default=True, help="Text field of --queries records.")
@engine_options()
@user_errors
@whole_index()
def audit(index_dir, queries_file, out_dir, k, method, damping, layers, outliers, dedup_threshold, no_dedup,
          text_field, model_dir, data, device, cpu_index):
    """Write an audit report of INDEX_DIR for the queries in FILE: per query the top-k most helpful and
    most harmful training examples with token heatmaps, the examples that matter across queries,
    outliers, duplicate groups and plots.

    INDEX_DIR may be a sharded index (`gradindex split`), in one process or under torchrun (rank 0 writes the
    report; each rank searches its parts and computes their self-influence)."""
    from pathlib import Path

    from gradindex.apps.report import ReportConfig, build_report
    from gradindex.query import read_queries
    from gradindex.query.sharded import open_engine

    cfg = ReportConfig(k=k, method=method, damping=damping, layers=tuple(layers) or None,
                       outliers=outliers, text_field=text_field, dedup=not no_dedup, dedup_threshold=dedup_threshold)
    queries = read_queries(queries_file)
    with open_engine(index_dir, model_dir, device=device, data=data, use_gpu=not cpu_index) as engine:
        summary = build_report(engine, queries, out_dir, cfg)
    out = Path(out_dir)
    click.echo(f"{summary['queries']} queries, {len(summary['outliers'])} outliers, "
               f"{len(summary['duplicate_groups'])} duplicate groups in {summary['seconds']['total']:.1f} s")
    click.echo(f"report: {out / 'report.html'}")
    click.echo(f"per query: {out / 'queries.jsonl'}; summary: {out / 'summary.json'}")
