"""``gradindex`` command line: thin wrappers that parse, call the library, print."""

from __future__ import annotations

import logging

import click

from gradindex import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gradindex")
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
def main(verbose: bool) -> None:
    """Training-data attribution as vector search over compressed per-example gradients."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s: %(message)s")


def _register() -> None:
    """Import every module of this package; each registers its commands on ``main``."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "common" and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_register()
