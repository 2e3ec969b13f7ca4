"""``gradindex precondition INDEX_DIR --method kfac|ekfac``: add a preconditioner to an index."""

from __future__ import annotations

import click

from gradindex.cli import main
from gradindex.cli.common import MethodChoice, damping_option, user_errors, whole_index


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--method", required=True, type=MethodChoice(None, which="fitted"),
              help="kfac, or ekfac (which writes kfac too).")
@damping_option("Relative damping of the self-influence written now (queries choose their own).")
@click.option("--fit-data", default="", type=click.Path(dir_okay=True),
              help="Fit the factors on this data instead of the indexed data (one model pass).")
@click.option("--fit-examples", default=0, show_default=True, type=int,
              help="Fit the factors on a random sample of this many examples (0 = all).")
@click.option("--fisher", default="empirical", show_default=True, type=click.Choice(["empirical", "true"]),
              help="Factors from the observed labels, or from labels sampled from the model (one or two model "
                   "passes; stored gradients keep the observed labels).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of that sample and of --fisher true.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--precision", default="auto", show_default=True, type=click.Choice(["auto", "float64", "float32"]),
              help="Arithmetic of the store passes' rotations; auto: float32 on layers whose rows exceed 4,096 "
                   "numbers (64x64; 1.5-3x faster), float64 on the narrower ones.")
@click.option("--space", default="stored", show_default=True, type=click.Choice(["stored", "full"]),
              help="stored: curvature of the index's rows; full: unprojected factors (+ EK-FAC correction) "
                   "from two model passes, for --rerank-full.")
@click.option("--correction-examples", default=0, show_default=True, type=click.IntRange(min=0),
              help="With --space full --method ekfac: the eigenvalue correction from a seeded sample (--seed) of "
                   "this many of the fit examples (a model pass over them); 0: all of them.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
@whole_index(then="its parts share one fit (a part refitted alone would score differently): fit the "
                   "whole index, then split it again")
def precondition(index_dir, method, damping, fit_data, fit_examples, fisher, seed, device, precision, space,
                 correction_examples, quiet):
    """Fit K-FAC or EK-FAC on INDEX_DIR and write its self-influence (stored space)."""
    from gradindex.precondition import FitConfig, available_methods, fit_preconditioner
    from gradindex.precondition.fullspace import full_space_methods

    cfg = FitConfig(method=method, damping=damping, fit_data=fit_data, fit_examples=fit_examples, seed=seed,
                    fisher=fisher, device=device, precision=precision, space=space,
                    correction_examples=correction_examples)
    entries = fit_preconditioner(index_dir, cfg, progress=not quiet)
    e = entries[method]
    if space == "full":
        click.echo(f"fitted full-space {method} on {index_dir} in {e['seconds']:.1f} s ({e['fit']['examples']} "
                   f"examples, two model passes); full-space re-rank methods now: "
                   f"{', '.join(full_space_methods(index_dir))}")
        return
    click.echo(f"fitted {method} on {index_dir} in {e['seconds']:.1f} s (factors from the "
               f"{e['fit']['source']}, {e['fit']['examples']} examples, {fisher} Fisher); "
               f"methods now: {', '.join(available_methods(index_dir))}")
