"""``gradindex verify INDEX_DIR``: check every data file against the hash recorded when it was written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from gradindex.checksum import CHECKSUMS, read_checksums
from gradindex.cli import main
from gradindex.cli.common import user_errors


def verify_index(index_dir: str) -> dict:
    """``{"damaged": [{file, problem, repair}], "verified": n, "unrecorded": [files]}``."""
    from gradindex.index.files import FAISS_DIR, check_faiss
    from gradindex.manifest import read_manifest
    from gradindex.precondition.files import PRECOND_DIR, check_precond
    from gradindex.store import STORE_DIR
    from gradindex.store.basis import BASIS_FILE, check_basis
    from gradindex.store.repair import check_store

    d = Path(index_dir)
    manifest = read_manifest(d)
    damage = check_store(d, True, manifest) + check_precond(d, manifest) + check_faiss(d) + check_basis(d, manifest)
    files = read_checksums(d)
    on_disk = [str(p.relative_to(d)) for sub, pat in ((STORE_DIR, "shard-*.h5"), (PRECOND_DIR, "*.h5"),
                                                      (FAISS_DIR, "*.index"), (FAISS_DIR, "norms.npy"))
               for p in sorted((d / sub).glob(pat))] + ([BASIS_FILE] if (d / BASIS_FILE).exists() else [])
    bad = {x.file for x in damage}
    return {"index": str(d), "damaged": [vars(x) for x in damage],
            "verified": sum(1 for n in files if n not in bad),
            "unrecorded": [n for n in on_disk if n not in files]}


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@user_errors
def verify(index_dir, as_json):
    """Hash every store shard, preconditioner, row basis and FAISS file of INDEX_DIR; exit 1 if any is damaged."""
    r = verify_index(index_dir)
    if as_json:
        click.echo(json.dumps(r, indent=2))
    else:
        for x in r["damaged"]:
            click.echo(f"DAMAGED {x['file']}: {x['problem']}; repair: {x['repair']}")
        for n in r["unrecorded"]:
            click.echo(f"unverified {n}: no hash recorded in {CHECKSUMS} (written by an older gradindex)")
        state = f"{len(r['damaged'])} damaged" if r["damaged"] else "intact"
        click.echo(f"{index_dir}: {state}; {r['verified']} files verified")
    if r["damaged"]:
        sys.exit(1)
