"""``gradindex split`` / ``gradindex merge``: one index directory to a sharded index and back; and ``gradindex query``,
``serve`` and ``audit`` over a sharded index, in one process or under ``torchrun`` (one run of parts a rank; rank 0
prints, serves HTTP or writes the report).

The commands are :mod:`gradindex.cli.query`'s, ``serve``'s and ``audit``'s: this module routes their calls on a
sharded INDEX_DIR through :func:`on_ranks` (their callbacks wrapped once, at registration; ``serve`` and ``audit``
open their engine with :func:`~gradindex.query.sharded.open_engine`) and gives them ``--rank-timeout``.
"""

from __future__ import annotations

import functools
import os
import time

import click

from gradindex.cli import audit as audit_cli
from gradindex.cli import main
from gradindex.cli import query as query_cli
from gradindex.cli import serve as serve_cli
from gradindex.cli.common import UserError, gather_refine, status, user_errors


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--shards", "parts", required=True, type=click.IntRange(min=1),
              help="Parts to split into: each a complete index over a contiguous range of rows (whole store shard "
                   "files while the parts are at most the files; more parts cut the files at even row ranges).")
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
    """Merge the parts of the sharded index in SHARDED_DIR into one index directory.

    The store's files come back as they were before the split, byte for byte, but a file the split cut: that one is
    joined again, with the same rows, ids and columns."""
    from gradindex.index.sharded import merge_index, read_sharded

    t0 = time.perf_counter()
    sh = read_sharded(sharded_dir)  # (shards.json and every part's manifest, read once)
    merge_index(sh, out)
    click.echo(f"merged {len(sh.parts)} parts of {sharded_dir} into {out} in {time.perf_counter() - t0:.1f} s")


RANK_TIMEOUT = 60.0
"""Default seconds a rank of a sharded index's run may take to answer a request (``--rank-timeout``)."""


def on_ranks(o: dict, rank0, layers=None) -> None:
    """A command over a sharded index, in one process or under ``torchrun``: ``rank0()`` on rank 0 (which opens the
    engine, :func:`~gradindex.query.sharded.open_engine`, and ends the others' run when it closes it); every other
    rank opens its parts and answers rank 0's searches until then. A rank that dies or stalls is one line here,
    within ``--rank-timeout`` (:mod:`gradindex.query.ranks`)."""
    from gradindex import distributed
    from gradindex.query.ranks import RankLostError, lost, stop_followers
    from gradindex.query.sharded import RankZeroFailed, serve_parts

    timeout = o.pop("rank_timeout")
    try:
        ranks = distributed.init_from_env(o["device"], timeout=timeout)
    except RuntimeError as e:  # (torch's DistStoreError / DistNetworkError: a rank never joined, or rank 0 is gone)
        raise UserError(f"the run's {os.environ.get('WORLD_SIZE')} ranks did not all start within --rank-timeout "
                        f"{timeout:g} s ({str(e).splitlines()[0][:160]}); start every rank again") from None
    gone = False
    try:
        if distributed.rank() > 0:
            try:
                serve_parts(o["index_dir"], layers=layers, use_gpu=not o["cpu_index"])
            except RankZeroFailed as e:
                raise UserError(f"rank {distributed.rank()}: {e}") from None
            except RuntimeError as e:  # (torch's DistNetworkError / DistStoreError: rank 0 went away)
                gone = True
                raise UserError(f"rank {distributed.rank()}: rank 0 went away ({str(e).splitlines()[0][:160]}), so "
                                "this rank stops; restart the run (every rank)") from None
        else:
            failed = True
            try:
                rank0()
                failed = False
            except RankLostError as e:
                raise UserError(str(e)) from None
            finally:
                stop_followers(failed)
    finally:
        if ranks:
            distributed.shutdown(wait=not lost() and not gone)  # (a lost rank never reaches the barrier)
    if ranks:
        distributed.exit_rank(0)


@user_errors
def sharded_query(**o) -> None:
    """``gradindex query`` over a sharded index: rank 0 (or the one process) loads the model and prints; under
    ``torchrun`` every other rank opens its parts and answers rank 0's searches."""
    from gradindex import distributed
    from gradindex.query.sharded import ShardedQueryEngine

    def rank0():
        qs = query_cli._queries(o)
        t0 = time.perf_counter()
        status(f"loading model and sharded index {o['index_dir']} ...")
        with ShardedQueryEngine(o["index_dir"], o["model_dir"], device=distributed.local_device(o["device"]),
                                data=o["data"], use_gpu=not o["cpu_index"],
                                optimizer_state=o["optimizer_state"]) as engine:
            status(f"searching {engine.n:,} examples in {len(engine.sharded.parts)} parts on "
                   f"{distributed.world_size()} rank(s) (loaded in {time.perf_counter() - t0:.1f} s) ...")
            results = query_cli.answer(engine, qs, o)
        query_cli._show(qs, results, o["text_field"], o["as_json"])

    on_ranks(o, rank0)


def _route_sharded(command: click.Command, sharded=None, load_layers: bool = False) -> None:
    """Send ``command``'s calls on a sharded INDEX_DIR to ``sharded(**options)`` (default: the command itself, run by
    :func:`on_ranks`: it opens its engine with :func:`~gradindex.query.sharded.open_engine`), and give it
    ``--rank-timeout``; ``load_layers``: its ``--layers`` are the layers its engine loads (each rank loads those)."""
    plain = command.callback

    @functools.wraps(plain)
    def callback(**o):
        from gradindex.index.sharded import is_sharded

        if not is_sharded(o["index_dir"]):
            o.pop("rank_timeout")
            return plain(**o)
        if sharded is not None:
            return sharded(**o)
        timeout = o.pop("rank_timeout")
        layers = (list(o["layers"]) or None) if load_layers else None
        return on_ranks({**o, "rank_timeout": timeout}, lambda: plain(**o), layers)

    command.callback = callback
    command.params.append(click.Option(
        ["--rank-timeout"], default=RANK_TIMEOUT, show_default=True, type=click.FloatRange(min=0, min_open=True),
        help="A sharded index under torchrun: seconds a rank may take to answer a request before the request fails "
             "with an error naming it (a rank that dies fails it at once)."))


_route_sharded(query_cli.query, gather_refine(sharded_query))  # (the routed call has the raw --refine* options)
_route_sharded(serve_cli.serve, load_layers=True)
_route_sharded(audit_cli.audit)
