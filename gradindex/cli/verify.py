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
    from gradindex.precondition.files import PRECOND_DIR, check_precond
    from gradindex.spec.manifest import read_manifest
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
    unrecorded = [n for n in on_disk if n not in files]
    damage = [vars(x) for x in damage] + _unrecorded_damage(d, manifest, files, unrecorded)
    return {"index": str(d), "damaged": damage, "verified": sum(1 for n in files if n not in bad),
            "unrecorded": unrecorded}


def unfinished(index_dir: str) -> str | None:
    """Why the build of ``index_dir`` is not done, with the command that finishes it; ``None`` where it is."""
    from gradindex.spec.manifest import Manifest, build_command, transcode_unfinished

    try:
        m = Manifest.read(index_dir)
    except (OSError, ValueError):
        return None  # (no readable manifest: reported as damage)
    if not m.complete:
        return (f"the build is not complete (status {m.status!r}); `{m.build_command(index_dir, extra='')}` "
                "finishes it (it resumes)")
    if transcode_unfinished(m.data):
        return (f"the build stopped during its transcode; "
                f"`{build_command(index_dir, m.data, extra='', index=True)}` finishes it")
    return None


def verify_sharded(index_dir: str, here: bool = False) -> dict:
    """:func:`verify_index` of every part of a sharded index, its files named ``part-NNNNN/...``, and the parts'
    consistency with ``shards.json`` (:func:`gradindex.index.sharded.check_sharded`: row ranges, builds, fits);
    ``parts``: each part's rows and counts. A part whose folder is not here (listed in ``absent``) is damage, but
    with ``here`` (a host that holds only its own ranks' parts), or where ``shards.json`` is another split's."""
    from gradindex.index.sharded import SHARDS_FILE, SPLIT_FIX, absent_parts, check_sharded

    d = Path(index_dir)
    sh, problems = check_sharded(d)
    absent, other = absent_parts(sh), sh.other_split
    if here and len(absent) == len(sh.parts):
        raise ValueError(f"none of the {len(sh.parts)} parts of the sharded index {str(d)!r} is here (no "
                         f"{', '.join(p.dir.name for p in sh.parts[:3])}{', ...' if len(sh.parts) > 3 else ''}); "
                         "copy a part into it, or verify where the parts are")
    again = _split_again(sh)
    out = {"index": str(d), "parts": [], "damaged": [
               {"file": SHARDS_FILE, "problem": p.removesuffix(f"; {SPLIT_FIX}"), "repair": SPLIT_FIX} if p == other
               else {"file": SHARDS_FILE, "problem": p, "repair": again} for p in problems],
           "verified": 0, "unrecorded": [], "absent": [sh.parts[j].dir.name for j in absent]}
    for j, p in enumerate(sh.parts):
        rows = [p.first, p.stop]
        if j in absent:
            away = not here and not other  # (another split's file names parts that never were here)
            if away:
                out["damaged"].append({"file": f"{p.dir.name}/", "problem": "not in this folder", "repair": (
                    "copy it here from where the index was split or built; on a host that holds only some parts, "
                    f"`gradindex verify {index_dir} --here` checks those")})
            out["parts"].append({"part": p.dir.name, "rows": rows, "absent": True, "damaged": int(away),
                                 "verified": 0})
            continue
        try:
            r = verify_index(str(p.dir))
            count = len(r["damaged"])
        except (OSError, ValueError) as e:  # (no readable manifest: named once, above where check_sharded saw it)
            r = {"damaged": [] if str(e) in problems else [{"file": "manifest.json", "problem": str(e),
                                                            "repair": again}], "verified": 0, "unrecorded": []}
            count = 1
        out["damaged"] += [{**x, "file": f"{p.dir.name}/{x['file']}", "repair": again} for x in r["damaged"]]
        out["verified"] += r["verified"]
        out["unrecorded"] += [f"{p.dir.name}/{n}" for n in r["unrecorded"]]
        out["parts"].append({"part": p.dir.name, "rows": rows, "damaged": count, "verified": r["verified"]})
    return out


def _split_again(sh) -> str:
    """The repair of a damaged or mismatched part: split again, or rebuild the sharded index (a part's own repair
    would capture other rows)."""
    from gradindex.spec.manifest import build_command

    rebuild = build_command(sh.dir, sh.manifest, f"--parts {len(sh.parts)} --overwrite")
    return (f"split the index again from the index it came from (`gradindex split INDEX --shards {len(sh.parts)} "
            f"--out NEW`), or rebuild it (`{rebuild}`); a part's own `build --repair` would capture other rows")


def _unrecorded_damage(d: Path, manifest: dict, files: dict, unrecorded: list[str]) -> list[dict]:
    """Data files without a recorded hash, as damage when the manifest names a gradindex that records one
    for every file it writes (every version that writes ``library_version``): ``checksums.json`` deleted,
    or files added or swapped in outside gradindex."""
    from gradindex.spec.manifest import build_command

    version = manifest.get("library_version")
    if not unrecorded or not version:
        return []
    repair = (f"{build_command(d, manifest, extra='--overwrite')} (rebuilds the index and its hashes; or, if you "
              f"trust the files as they are, `gradindex verify {d} --record` hashes them now)")
    why = f"the manifest names gradindex {version}, which records a hash of every data file it writes in {CHECKSUMS}"
    if not files:
        gone = "missing" if not (d / CHECKSUMS).exists() else "empty"
        return [{"file": CHECKSUMS, "problem": f"{gone}: {why}; none of the {len(unrecorded)} data files can be "
                 "verified", "repair": repair}]
    return [{"file": n, "problem": f"no hash recorded: {why}", "repair": repair} for n in unrecorded]


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--record", is_flag=True, help=f"First record the hash of every data file that has none in {CHECKSUMS} "
              "(after it was deleted): the files are trusted as they are now.")
@click.option("--here", is_flag=True, help="A sharded index: check only the parts in this folder (a host that holds "
              "only its own torchrun ranks' parts); the others are listed, not counted as damage.")
@user_errors
def verify(index_dir, as_json, record, here):
    """Hash every store shard, preconditioner, row basis and FAISS file of INDEX_DIR; exit 1 if any is damaged.

    A data file without a recorded hash (``checksums.json`` deleted) is damage too. On a sharded index (``gradindex
    split``): every part's files, and the parts' row ranges, builds and fits against its shards.json."""
    sharded = (Path(index_dir) / "shards.json").is_file()
    if here and not sharded:
        raise ValueError(f"{index_dir!r} is not a sharded index: --here checks the parts a host holds; leave it out")
    if record and sharded:
        raise ValueError(f"{index_dir!r} is a sharded index: --record records one index's hashes; give it a part "
                         "(DIR/part-NNNNN)")
    if record:
        from gradindex.checksum import record as record_hashes
        from gradindex.lock import index_lock

        with index_lock(index_dir, "gradindex verify --record"):
            names = verify_index(index_dir)["unrecorded"]
            record_hashes(index_dir, [Path(index_dir) / n for n in names], names)
        click.echo(f"recorded the hashes of {len(names)} files in {CHECKSUMS}", err=True)
    r = verify_sharded(index_dir, here) if sharded else verify_index(index_dir)
    if not sharded:
        r["unfinished"] = unfinished(index_dir)
    if as_json:
        click.echo(json.dumps(r, indent=2))
    else:
        for x in r["damaged"]:
            click.echo(f"DAMAGED {x['file']}: {x['problem']}; repair: {x['repair']}")
        named = {x["file"] for x in r["damaged"]}
        for n in r["unrecorded"]:
            if n not in named and CHECKSUMS not in named:
                click.echo(f"unverified {n}: no hash recorded in {CHECKSUMS} (written by an older gradindex)")
        state = f"{len(r['damaged'])} damaged" if r["damaged"] else "intact"
        for p in r.get("parts", []):
            part_state = ("not here" if p.get("absent") else f"{p['damaged']} damaged; {p['verified']} files verified"
                          if p["damaged"] else f"intact; {p['verified']} files verified")
            click.echo(f"{p['part']}  rows {p['rows'][0]}-{p['rows'][1] - 1}: {part_state}")
        parts = f" in {len(r['parts'])} parts" if "parts" in r else ""
        if here and r.get("absent"):
            parts = f" in the {len(r['parts']) - len(r['absent'])} of {len(r['parts'])} parts here"
        if r.get("unfinished"):  # (intact files of a build not done: what query and info refuse or say)
            click.echo(f"note: {r['unfinished']}")
        click.echo(f"{index_dir}: {state}; {r['verified']} files verified{parts}")
    if r["damaged"]:
        sys.exit(1)
