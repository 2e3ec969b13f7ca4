"""``gradindex split`` / ``gradindex merge``: one index directory to a sharded index and back; and ``gradindex query``
over a sharded index, in one process or under ``torchrun`` (one run of parts a rank, rank 0 prints).

The query command is :mod:`gradindex.cli.query`'s, unchanged: this module routes its call to
:func:`sharded_query` when INDEX_DIR is a sharded index (its callback wrapped once, at registration).
"""

from __future__ import annotations

import functools
import time

import click

from gradindex.cli import main
from gradindex.cli import query as query_cli
from gradindex.cli.common import status, user_errors


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--shards", "parts", required=True, type=click.IntRange(min=1),
              help="Parts to split into: each a complete index over a contiguous range of rows (whole store shard "
                   "files: at most one part a file).")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="The new sharded index directory (must not exist, or be empty).")
@user_errors
def split(index_dir, parts, out):
    """Split the index in INDEX_DIR into a sharded index: parts over contiguous rows, sharing its fits.

    Nothing is captured (the store's files are copied into the parts). Query OUT with `gradindex query OUT`, or
    under torchrun with one run of parts a rank; `gradindex merge` joins the parts again."""
    from gradindex.index.sharded import split_index

    t0 = time.perf_counter()
    sh = split_index(index_dir, out, parts)
    ranges = ", ".join(f"{p.dir.name} rows {p.first}-{p.stop - 1}" for p in sh.parts)
    click.echo(f"split {index_dir} ({sh.examples:,} examples) into {len(sh.parts)} parts in {out} in "
               f"{time.perf_counter() - t0:.1f} s: {ranges}")


@main.command()
@click.argument("sharded_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="The new index directory (must not exist, or be empty).")
@user_errors
def merge(sharded_dir, out):
    """Merge the parts of the sharded index in SHARDED_DIR into one index directory (the store's files as they were
    before the split, byte for byte)."""
    from gradindex.index.sharded import merge_index, read_sharded

    t0 = time.perf_counter()
    sh = read_sharded(sharded_dir)  # (shards.json and every part's manifest, read once)
    merge_index(sh, out)
    click.echo(f"merged {len(sh.parts)} parts of {sharded_dir} into {out} in {time.perf_counter() - t0:.1f} s")


@user_errors
def sharded_query(**o) -> None:
    """``gradindex query`` over a sharded index: rank 0 (or the one process) loads the model and prints; under
    ``torchrun`` every other rank opens its parts and answers rank 0's searches."""
    from gradindex import distributed
    from gradindex.query.sharded import ShardedQueryEngine, serve_parts, stop_followers

    ranks = distributed.init_from_env(o["device"])
    device = distributed.local_device(o["device"])
    try:
        if distributed.rank() > 0:
            serve_parts(o["index_dir"], use_gpu=not o["cpu_index"])
        else:
            try:
                qs = query_cli._queries(o)
            except BaseException:
                stop_followers()
                raise
            t0 = time.perf_counter()
            status(f"loading model and sharded index {o['index_dir']} ...")
            with ShardedQueryEngine(o["index_dir"], o["model_dir"], device=device, data=o["data"],
                                    use_gpu=not o["cpu_index"], optimizer_state=o["optimizer_state"]) as engine:
                status(f"searching {engine.n:,} examples in {len(engine.sharded.parts)} parts on "
                       f"{distributed.world_size()} rank(s) (loaded in {time.perf_counter() - t0:.1f} s) ...")
                results = query_cli.answer(engine, qs, o)
            query_cli._show(qs, results, o["text_field"], o["as_json"])
    finally:
        if ranks:
            distributed.shutdown()  # (every rank: rank 0 has ended the others' run, success or not)
    if ranks:
        distributed.exit_rank(0)


def _route_sharded(command: click.Command) -> None:
    """Send ``command``'s calls on a sharded INDEX_DIR to :func:`sharded_query`."""
    plain = command.callback

    @functools.wraps(plain)
    def callback(**o):
        from gradindex.index.sharded import is_sharded

        if is_sharded(o["index_dir"]):
            return sharded_query(**o)
        return plain(**o)

    command.callback = callback


_route_sharded(query_cli.query)
