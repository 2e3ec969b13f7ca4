"""``gradindex`` command line: thin wrappers that parse, call the library, print."""

from __future__ import annotations

import logging

import click

from gradindex import __version__

WITHOUT_FAISS = ("info", "plan")
"""Commands that run without FAISS (every other one builds, reads or searches an index's FAISS files)."""


class _Commands(click.Group):
    def resolve_command(self, ctx: click.Context, args: list[str]):
        """The subcommand; refused before any work when it needs FAISS and FAISS is not installed (a build
        would capture first, then fail at its index stage). ``--help`` is always shown."""
        name, cmd, rest = super().resolve_command(ctx, args)
        if name not in WITHOUT_FAISS and not any(a in ("-h", "--help") for a in rest):
            from gradindex.deps import FAISS_MISSING, has_faiss

            if not has_faiss():
                from gradindex.cli.common import UserError

                raise UserError(f"`gradindex {name}` needs FAISS: {FAISS_MISSING}")
        return name, cmd, rest


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gradindex")
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
def main(verbose: bool) -> None:
    """Training-data attribution as vector search over compressed per-example gradients."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s: %(message)s")
    if not verbose:
        quiet_transformers()


def quiet_transformers() -> None:
    """Keep transformers' log warnings and Python warnings (deprecations, config notes) out of a command's
    output (issue 33 item 13); ``-v`` shows them. Before transformers loads: its environment variables."""
    import os
    import sys
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
    if "transformers" in sys.modules:  # (already loaded: by a caller of main, or a test)
        sys.modules["transformers"].utils.logging.set_verbosity_error()


def _register() -> None:
    """Import every module of this package; each registers its commands on ``main``."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "common" and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_register()
