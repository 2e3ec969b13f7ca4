"""``gradindex index INDEX_DIR``: (re)build the per-layer FAISS indices from the store."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import click

from gradindex.cli import main
from gradindex.cli.common import damping_option, human_bytes, user_errors

if TYPE_CHECKING:
    from gradindex.spec.manifest import Manifest


class IndexTypeOption(click.Option):
    """``--index-type``: its help lists the registered index tiers (:func:`gradindex.cli.tiers.index_type_help`),
    read when the help is shown, so a tier registered after import is listed too."""

    @property
    def help(self) -> str:
        from gradindex.cli.tiers import index_type_help

        return index_type_help()

    @help.setter
    def help(self, value: str | None) -> None:  # (click sets it in __init__; the registry's words win)
        pass


def index_options(fn):
    """Options shared by ``gradindex index`` and the index stage of ``gradindex build``."""
    fn = click.option("--index-type", cls=IndexTypeOption, default="auto", show_default=True)(fn)
    fn = click.option("--sketch-bytes", default=2048, show_default=True, type=click.IntRange(min=8),
                      help="Bytes per example of the sketch tier (int8 numbers plus a 4-byte scale).")(fn)
    fn = click.option("--whiten", default="none", show_default=True,
                      type=click.Choice(["none", "kfac", "ekfac"]),
                      help="Index H^-1/2-whitened vectors of this fitted preconditioner "
                           "(best ANN recall for that method).")(fn)
    fn = click.option("--normalize", is_flag=True,
                      help="Divide each example's vectors by its all-layer norm "
                           "(best ANN recall for cosine).")(fn)
    fn = click.option("--train-size", default=0, show_default=True, type=int,
                      help="Rows sampled to train IVF/PQ (0: 64 per list, at least 16384).")(fn)
    fn = click.option("--cpu-index", is_flag=True, help="Build on the CPU even when FAISS sees GPUs.")(fn)
    return fn


def check_index_type(factory: str, n: int, train_size: int = 0) -> None:
    """Refuse, before any work, an index type that cannot be built over ``n`` examples (a FAISS type needing more
    training rows, or a ``--train-size`` below its lists: :meth:`gradindex.index.tiers.Tier.check_examples`)."""
    from gradindex.index import IndexConfig
    from gradindex.index.tiers import tier_class

    if (factory or "auto").strip().lower() != "auto":
        tier_class(factory)(factory, IndexConfig(factory=factory, train_size=train_size)).check_examples(n)


def index_config(index_type: str, whiten: str, damping: float, normalize: bool, train_size: int,
                 cpu_index: bool, sketch_bytes: int = 2048):
    """The :class:`gradindex.index.IndexConfig` of these options."""
    from gradindex.index import IndexConfig, IndexSpace

    if train_size < 0:
        raise ValueError(f"--train-size must be >= 0, got {train_size}")
    space = IndexSpace(whiten=whiten, damping=damping, normalize=normalize)
    return IndexConfig(factory=index_type, space=space, train_size=train_size, gpu=not cpu_index,
                       sketch_bytes=sketch_bytes)


def space_words(space: dict, basis: str = "raw", damping: bool = False) -> str:
    """What an index's vectors are, in words: whitened when it was built (``damping``: name the damping), else
    the stored rows as they are, which are themselves whitened when ``basis`` (the rows' basis) is not raw."""
    if space.get("whiten", "none") != "none":
        return f"whitened {space['whiten']}" + (f" (damping {space.get('damping')})" if damping else "")
    return "raw rows" if basis == "raw" else f"the rows as stored ({basis}-whitened)"


def report(res) -> str:
    from gradindex.index.tiers import kind_of, tier_named

    m = res.meta
    basis = ((m.get("key") or {}).get("identity") or {}).get("basis") or {}
    tier = tier_named(kind_of(m))
    size = tier.written_bytes(m)
    state = "up to date" if res.up_to_date else f"built in {res.seconds:.1f} s"
    return (f"indices {state}: {len(m['layers'])} layers x {m['examples']} examples, {tier.describe(m)}, "
            f"{space_words(m['space'], basis.get('kind', 'raw'))}"
            f"{', normalized' if m['space']['normalize'] else ''}, {human_bytes(size)}")


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@index_options
@damping_option("Relative damping of --whiten.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the training sample.")
@click.option("--force", is_flag=True, help="Rebuild even when the indices are up to date.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@user_errors
def index(index_dir, index_type, sketch_bytes, whiten, normalize, train_size, cpu_index, damping, seed, force,
          quiet):
    """(Re)build one FAISS index per layer of INDEX_DIR's store (resumes an interrupted build)."""
    from gradindex.diskspace import disk_full_as_error
    from gradindex.index import build_indices
    from gradindex.spec.manifest import Manifest

    manifest = Manifest.read(index_dir)
    check_index_type(index_type, manifest.examples, train_size)
    cfg = index_config(index_type, whiten, damping, normalize, train_size, cpu_index, sketch_bytes)
    cfg = dataclasses.replace(cfg, seed=seed)
    with disk_full_as_error(index_dir, "FAISS stage", "the store and its fits are kept",
                            lambda: faiss_bytes(manifest)):
        click.echo(report(build_indices(index_dir, cfg, progress=not quiet, force=force)))


def faiss_bytes(manifest: Manifest) -> int:
    """At most what a FAISS type writes for the index of ``manifest``: every row as float32 (``Flat``), and the
    norms (compressed types write less)."""
    return manifest.examples * sum(4 * s.dim + 4 for s in manifest.layers.values())
