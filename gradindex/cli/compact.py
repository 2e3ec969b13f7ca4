"""``gradindex compact INDEX_DIR --basis ekfac --out NEW_DIR``: rows in the EK-FAC whitened eigenbasis."""

from __future__ import annotations

import click

from gradindex.cli import main
from gradindex.cli.build import STORAGES
from gradindex.cli.common import damping_option, user_errors
from gradindex.cli.index import check_index_type, index_config, index_options, report


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="New index directory to write.")
@click.option("--basis", default="ekfac", show_default=True, type=click.Choice(["ekfac"]),
              help="ekfac: rotate rows into the fitted EK-FAC eigenbasis and scale by (Λ*+δ)^-1/2.")
@damping_option("Relative damping δ baked into the rows (queries use it; --method ekfac).")
@click.option("--storage", default=None, type=click.Choice(list(STORAGES)),
              help="Row codes of the new store (default: the source's); int4 keeps ~99% of EK-FAC in this basis.")
@click.option("--overwrite", is_flag=True, help="Replace another index in --out.")
@index_options
@click.option("--no-index", is_flag=True, help="Skip the FAISS index stage (run `gradindex index` later).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
def compact(index_dir, out, basis, damping, storage, overwrite, index_type, whiten, normalize, train_size, cpu_index,
            no_index, quiet, sketch_bytes=2048):
    """Transcode INDEX_DIR's rows (after an EK-FAC fit) into a whitened basis, as a new index in OUT."""
    from gradindex.index import build_indices
    from gradindex.precondition.compact import compact_eigenbasis
    from gradindex.spec.manifest import Manifest

    if whiten != "none":
        raise ValueError("--whiten does not apply: the compacted rows are already whitened")
    icfg = index_config(index_type, "none", damping, normalize, train_size, cpu_index, sketch_bytes)
    if not no_index:  # (the tier's own refusals, before the transcode writes OUT)
        check_index_type(index_type, Manifest.read(index_dir).examples, train_size)
    m = compact_eigenbasis(index_dir, out, damping=damping, storage=storage, overwrite=overwrite,
                           progress=not quiet)
    click.echo(f"compacted {index_dir} into {out}: {m['counts']['examples']} examples in the {basis} eigenbasis "
               f"(damping {damping}); query it with --method ekfac")
    if not no_index:
        click.echo(report(build_indices(out, icfg, progress=not quiet)))
