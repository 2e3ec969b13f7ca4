"""Options and error handling shared by CLI commands.

Command modules stay light: they import click and this module at start-up and the library
(torch, transformers, faiss, datasets) only inside the command that runs, so ``--help``,
``--version`` and ``info`` start in well under a second.
"""

from __future__ import annotations

import errno
import functools
import json
import sys

import click

from gradindex.apps.html import number  # noqa: F401  (scores in tables: one format with the pages')
from gradindex.checksum import DamagedIndexError
from gradindex.errors import CorruptFileError, DiskFullError, IndexMismatchError, UnsupportedLayerError
from gradindex.lock import IndexBusyError
from gradindex.methods import DEFAULT_DAMPING, FLOAT32_MAX, FLOAT32_TINY, in_float32_range

USER_ERRORS = (ValueError, IndexMismatchError, DiskFullError, CorruptFileError, UnsupportedLayerError,
               DamagedIndexError, IndexBusyError, FileNotFoundError, FileExistsError, PermissionError)
"""What a command reports as one ``Error:`` line: the library's own error types (``ValueError`` is its type for a
bad value), and the OS conditions bad input causes (a named file missing, an output that exists, no
permission); a full disk and a read-only file system are too (:func:`user_errors`). Anything else (``TypeError``,
another ``OSError``, ``MemoryError``...) is a bug and keeps its traceback (issue 32 item 6)."""


class UserError(click.ClickException):
    """Bad input: one line ``Error: ...`` on stderr, exit code 2, no traceback."""

    exit_code = 2


class Interrupted(click.ClickException):
    """Ctrl-C during long work: one line saying what is kept and how to resume, exit code 130."""

    exit_code = 130


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg or type(e).__name__


def user_errors(fn):
    """Turn library errors caused by bad input into a one-line ``Error: ...`` and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            raise UserError(one_line(e)) from e
        except OSError as e:
            from gradindex.diskspace import is_disk_full

            if e.errno == errno.EROFS:
                raise UserError(f"{one_line(e)}: that file system is mounted read-only; write to a writable one "
                                "(--out, where the command takes one; else copy the index there)") from e
            if not is_disk_full(e):
                raise
            raise UserError(f"the disk is full ({one_line(e)}); free some space and re-run the same command") from e

    return wrapper


def whole_index(then: str = ""):
    """Refuse a part of a sharded index as the command's INDEX_DIR (its ids are the part's own; ``then``: what to
    do instead, default the sharded index): :func:`~gradindex.index.sharded.refuse_part_as_index`. Under
    :func:`user_errors`, so the refusal is one ``Error:`` line."""

    def wrap(fn):
        @functools.wraps(fn)
        def checked(**o):
            from gradindex.index.sharded import refuse_part_as_index

            refuse_part_as_index(o["index_dir"], then=then)
            return fn(**o)

        return checked

    return wrap


def status(msg: str) -> None:
    """A progress line on stderr when it is a terminal (never in a pipe, a file or a test's capture)."""
    if sys.stderr.isatty():
        click.echo(msg, err=True)


def data_options(fn):
    fn = click.option("--text-field", default="text", show_default=True,
                      help="Field holding the text (else 'prompt'+'completion' or 'input_ids').")(fn)
    fn = click.option("--max-length", default=512, show_default=True, type=int,
                      help="Truncate examples to this many tokens (capped at the smaller of the model's positions "
                           "and the tokenizer's model_max_length; a note names which).")(fn)
    return fn


def messages_option(fn):
    """``--messages JSON``: a chat query, its turns as a JSON list (repeatable)."""
    return click.option("--messages", "messages", multiple=True,
                        help='A chat query: its turns as JSON, e.g. \'[{"role": "user", "content": "Hi"}, '
                             '{"role": "assistant", "content": "Hello"}]\' (loss on the assistant turns, '
                             "the index's chat template); repeatable.")(fn)


def parse_messages(values) -> list[dict]:
    """``--messages`` values → ``{"messages": [...]}`` records; a one-line error for one that is not a JSON list."""
    out = []
    for v in values:
        try:
            turns = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"--messages {v[:60]!r} is not valid JSON ({e.msg}); give the turns as a JSON list "
                             'of {"role": ..., "content": ...} objects') from None
        if not isinstance(turns, list):
            raise ValueError(f"--messages takes a JSON list of turns, got a JSON {type(turns).__name__}")
        out.append({"messages": turns})
    return out


def positive_damping(ctx, param, value: float) -> float:
    """A damping option's callback: a number that rounds to a positive normal float32
    (:func:`~gradindex.methods.in_float32_range`: ``3.4028235e38``, float32's max as printed, is taken; anything
    that rounds beyond it is refused), else refused. A damping outside it overflows (or vanishes in) the float32
    rotations (issue 33 item 8: ``--damping 1e300`` ended in a ``RuntimeError ... overflow`` traceback)."""
    if value is not None and not in_float32_range(value):
        raise click.BadParameter(f"{value:g} is outside the valid range {FLOAT32_TINY:.2g} to {FLOAT32_MAX:.2g} "
                                 f"(a positive float32); the damping is a fraction of each layer's mean eigenvalue, "
                                 f"e.g. {DEFAULT_DAMPING:g}")
    return value


def damping_option(help: str = "Relative damping (kfac, ekfac)."):
    """``--damping``, a fraction of each layer's mean eigenvalue (default :data:`gradindex.methods.DEFAULT_DAMPING`);
    a non-finite or non-positive value is refused before any work."""
    return click.option("--damping", default=DEFAULT_DAMPING, show_default=True, type=float, help=help,
                        callback=positive_damping)


def gather_refine(fn):
    """``fn`` taking the ``--refine*`` options as one ``refine`` argument (for :func:`refine_config`)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, refine=None, refine_steps=1, refine_sample=32, refine_curvature="ggn", refine_damping=10.0,
                **kwargs):
        return fn(*args, refine=None if refine is None else (refine, refine_steps, refine_sample, refine_curvature,
                                                             refine_damping), **kwargs)

    return wrapper


def refine_options(fn):
    """``--refine cg|neumann``, ``--refine-steps``, ``--refine-sample``, ``--refine-curvature``: refined EK-FAC
    queries (docs/query.md); the command receives them as one ``refine`` argument (:func:`gather_refine`)."""
    wrapper = gather_refine(fn)
    wrapper = click.option("--refine-damping", default=10.0, show_default=True, type=float,
                           callback=positive_damping,
                           help="Relative damping of the refined system (the query's --damping to refine at it). "
                                "Refinement wants a larger one than plain EK-FAC (docs/math.md).")(wrapper)

    wrapper = click.option("--refine-curvature", default="ggn", show_default=True,
                           type=click.Choice(["ggn", "sampled", "fisher"]),
                           help="The matrix refined against: ggn (model products every step), sampled (the "
                                "sample's gradients with model-drawn labels, captured once; cheap) or fisher "
                                "(observed labels; rank-deficient, docs/math.md).")(wrapper)
    wrapper = click.option("--refine-sample", default=32, show_default=True, type=click.IntRange(min=1),
                           help="Training examples the refinement's curvature averages over.")(wrapper)
    wrapper = click.option("--refine-steps", default=1, show_default=True, type=click.IntRange(min=0),
                           help="Refinement steps (curvature products per query; 0 = plain EK-FAC).")(wrapper)
    return click.option("--refine", default=None, type=click.Choice(["cg", "neumann"]),
                        help="Refine kfac/ekfac queries against the model's Gauss-Newton matrix, EK-FAC "
                             "preconditioned (ASTRA-style; needs the training data).")(wrapper)


def refine_config(refine):
    """The :class:`~gradindex.query.refine.RefineConfig` of :func:`refine_options`' argument (``None``: none)."""
    if refine is None:
        return None
    from gradindex.query.refine import RefineConfig

    method, steps, sample, curvature, damping = refine
    return RefineConfig(method=method, steps=steps, sample=sample, curvature=curvature, damping=damping)


def engine_options(cpu_index: bool = True):
    """``--model``, ``--data``, ``--device`` (and ``--cpu-index``): how a command opens a query engine."""

    def deco(fn):
        if cpu_index:
            fn = click.option("--cpu-index", is_flag=True, help="Search on the CPU even when FAISS sees GPUs.")(fn)
        fn = click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N] (the model).")(fn)
        fn = click.option("--data", default=None, type=click.Path(),
                          help="Training data file, if it moved since the build.")(fn)
        return click.option("--model", "model_dir", default=None, type=click.Path(),
                            help="Model directory or .gguf file (default: the one the index was built with).")(fn)

    return deco


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def index_method(index_dir, prefer=None, app: str | None = None) -> str:
    """The method a command uses on ``index_dir`` when none is given (:func:`gradindex.methods.default_method`)."""
    from gradindex.methods import default_method
    from gradindex.spec.manifest import read_manifest

    return default_method(read_manifest(index_dir), index_dir, prefer, app=app)


class MethodChoice(click.Choice):
    """``--method`` choices of one app (:data:`gradindex.methods.APPS`), or one list of the vocabulary
    (``which``: e.g. ``fitted``), read from the method registry when the option is parsed (a method
    registered after import is a choice too)."""

    def __init__(self, app: str | None, selfnorm: bool = True, which: str = ""):
        self.app, self.selfnorm, self.which, self.case_sensitive = app, selfnorm, which, True

    @property
    def choices(self) -> tuple[str, ...]:
        from gradindex.methods import all_methods, names

        return names(self.which) if self.which else all_methods(self.app, self.selfnorm)


