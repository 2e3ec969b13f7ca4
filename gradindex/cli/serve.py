"""``gradindex serve INDEX_DIR``: an HTTP JSON API and a web page over a resident query engine."""

from __future__ import annotations

import os
from pathlib import Path

import click

from gradindex.cli import main
from gradindex.cli.common import engine_options, refine_config, refine_options, user_errors, whole_index


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (loopback by default; 0.0.0.0 exposes it to the network).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--token", default=None, help="Require 'Authorization: Bearer TOKEN' on /query and /example "
              "(visible to other users in `ps`: prefer --token-file or $GRADINDEX_TOKEN).")
@click.option("--token-file", default=None, type=click.Path(dir_okay=False),
              help="Read the bearer token from this file (its first line); default: $GRADINDEX_TOKEN if set.")
@click.option("--request-timeout", default=30.0, show_default=True, type=float,
              help="Seconds a request may take, waiting included, before it is answered 504.")
@click.option("--queue-size", default=64, show_default=True, type=int,
              help="Requests that may wait for the engine; more are answered 503 with Retry-After.")
@click.option("--max-batch", default=16, show_default=True, type=int,
              help="Queries answered together in one gradient pass (1: one at a time).")
@click.option("--batch-window", default=0.002, show_default=True, type=float,
              help="Seconds the worker waits after a query for others to batch with it.")
@click.option("--layers", multiple=True, help="Glob of layers to load (repeatable). Default: all.")
@engine_options()
@refine_options
@user_errors
@whole_index()
def serve(index_dir, host, port, token, token_file, request_timeout, queue_size, max_batch, batch_window, layers,
          model_dir, data, device, cpu_index, refine):
    """Serve INDEX_DIR over HTTP: POST /query, GET /example/ID, GET /health, and a page at /.

    INDEX_DIR may be a sharded index (`gradindex split`): in one process every part is searched in turn; under
    `torchrun --nproc_per_node P -m gradindex serve DIR` rank 0 serves HTTP and each rank searches its parts. A rank
    that dies or stalls fails the request with 503 naming it (within --rank-timeout); restart the run."""
    from gradindex.apps.serve import serve as run
    from gradindex.query.sharded import open_engine

    token = bearer_token(token, token_file)
    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    if not (request_timeout > 0 and queue_size >= 1 and max_batch >= 1 and batch_window >= 0):
        raise ValueError("--request-timeout must be > 0, --queue-size and --max-batch >= 1, --batch-window >= 0; "
                         f"got {request_timeout:g}, {queue_size}, {max_batch}, {batch_window:g}")
    port_free(host, port)  # (before the model loads: a busy port said so only after "serving ... on")
    with open_engine(index_dir, model_dir, device=device, data=data, layers=list(layers) or None,
                     use_gpu=not cpu_index, refine=refine_config(refine)) as engine:
        click.echo(f"serving {index_dir} ({engine.n} examples) on http://{host}:{port}/"
                   f"{' (bearer token required)' if token else ''}; Ctrl-C stops", err=True)
        run(engine, host, port, token, request_timeout, queue_size, max_batch, batch_window)


def port_free(host: str, port: int) -> None:
    """Refuse a ``host``/``port`` this process cannot listen on (in use, or an address not of this machine); under
    torchrun only rank 0, which serves HTTP, checks."""
    import errno
    import socket

    from gradindex import distributed

    if distributed.rank() != 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address this machine knows ({e.strerror}); give an IP address "
                         "or a name it resolves, e.g. 127.0.0.1") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            why = "is in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise ValueError(f"port {port} on {host} {why}; pick another --port or --host") from None


TOKEN_ENV = "GRADINDEX_TOKEN"


def bearer_token(token: str | None, token_file: str | None) -> str | None:
    """The token from ``--token``, else ``--token-file`` (its first line), else ``$GRADINDEX_TOKEN``; ``None``:
    no token. A token on the command line is visible in ``ps``: a note says so."""
    if token and token_file:
        raise ValueError("give --token or --token-file, not both (--token-file keeps the token out of `ps`)")
    if token:
        click.echo(f"note: --token is visible to other users in `ps`; --token-file PATH or ${TOKEN_ENV} keep it "
                   "private", err=True)
        return token
    if token_file:
        try:
            lines = Path(token_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--token-file {token_file!r} cannot be read ({e.strerror}); give a readable file "
                             "holding the token on its first line") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--token-file {token_file!r} is empty; write the token on its first line")
        return lines[0].strip()
    return os.environ.get(TOKEN_ENV) or None
