"""Options and error handling shared by CLI commands."""

from __future__ import annotations

import functools

import click

from gradindex.manifest import IndexMismatchError

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, IndexMismatchError, TypeError, OSError)


def user_errors(fn):
    """Turn library errors caused by bad input into a one-line ``Error: ...`` and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            raise click.ClickException(str(e)) from e

    return wrapper


def data_options(fn):
    fn = click.option("--text-field", default="text", show_default=True,
                      help="Field holding the text (else 'prompt'+'completion' or 'input_ids').")(fn)
    fn = click.option("--max-length", default=512, show_default=True, type=int,
                      help="Truncate examples to this many tokens.")(fn)
    return fn
