"""``gradindex info INDEX_DIR``: what an index holds (model, layers, counts, methods, indices, sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from gradindex.cli import main
from gradindex.cli.common import human_bytes, user_errors
from gradindex.cli.index import space_words
from gradindex.methods import methods_of
from gradindex.spec import layout
from gradindex.spec.manifest import Manifest, baked_damping, build_command, read_manifest, transcode_unfinished

INDEX_META = Path(layout.FAISS_DIR) / layout.FAISS_META
"""gradindex.index.files' ``faiss/index.json``, read here as plain JSON so that ``info`` does not load FAISS."""


def _index_meta(d: Path) -> dict | None:
    p = d / INDEX_META
    if not p.exists():
        return None
    try:
        meta = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(p)!r} is corrupt ({e}); rebuild it with `gradindex index {d}`") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("layers"), dict):
        raise ValueError(f"{str(p)!r} is not a gradindex index description; rebuild it with `gradindex index {d}`")
    return meta


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


def _rows(m: dict) -> dict | None:
    """The index's row spec and what it means in words (None for rows no spec names)."""
    from gradindex.spec.manifest import rows_of

    try:
        spec = rows_of(m)
    except (ValueError, TypeError, KeyError):
        return None
    return {"spec": str(spec), "describe": spec.describe()}


def summary(index_dir: str) -> dict:
    """A JSON-able summary of an index directory."""
    d = Path(index_dir)
    paths = layout.IndexLayout(d)
    described = Manifest.read(d)
    m, b = described.data, described.build
    meta = _index_meta(d)
    counts = m.get("counts", {})
    layers = {}
    for n, v in described.layers.items():
        e = (meta or {}).get("layers", {}).get(n, {})
        layers[n] = {"shape": [v.rows, v.cols], "dim": v.dim, "module": v.kind, "in_out": [v.n_in, v.n_out],
                     "index": e.get("factory"), "index_bytes": e.get("bytes")}
    return {
        "dir": str(d), "status": m.get("status"), "library_version": m.get("library_version"),
        "transcode_unfinished": transcode_unfinished(m),
        "model": {"id": m.get("model_id"), "fingerprint": b.get("model_fingerprint"),
                  "dtype": m.get("dtype"), "file": m.get("model_file")},
        "data": {"id": m.get("data_id"), "examples": counts.get("examples"),
                 "truncated": counts.get("truncated"), "field": counts.get("text_field"),
                 "nonfinite": len(m.get("nonfinite_ids", []))},
        "projection": b.get("projection"), "basis": b.get("basis", {"kind": "raw"}), "baked_damping": baked_damping(m),
        "max_length": b.get("max_length"), "storage": b.get("storage", "fp32"), "rows": _rows(m),
        "layers": layers, "dims_total": sum(v["dim"] for v in layers.values()),
        "methods": methods_of(m, d, selfnorm=True),
        "index": None if meta is None else {"status": meta.get("status"), "space": meta.get("space"),
                                            "types": sorted({e["factory"] for e in meta["layers"].values()})},
        "full_space": {k: {"examples": e.get("fit", {}).get("examples"),
                           "correction_examples": e.get("fit", {}).get("correction_examples",
                                                                       e.get("fit", {}).get("examples"))
                           if k == "ekfac" else None, "file": e.get("file")}
                       for k, e in m.get("full_space", {}).items()},
        "bytes": {"store": _size(paths.store), "basis": _size(paths.basis), "precond": _size(paths.precond),
                  "faiss": _size(paths.faiss)},
    }


SHARDS = "shards.json"
"""gradindex.index.sharded's file naming the parts of a sharded index (read here as plain JSON: no FAISS)."""


def sharded_summary(index_dir: str) -> dict:
    """:func:`summary` of a sharded index: part 0's (the model, layers, fits every part shares) with the whole index's
    counts, the bytes of every part (the basis and fits once: the parts hard-link them), and ``parts``: each part's
    rows, status, tier and bytes."""
    d = Path(index_dir)
    try:
        doc = json.loads((d / SHARDS).read_text())
        entries, whole = doc["parts"], doc["manifest"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{str(d / SHARDS)!r} is corrupt ({e}); split the index again") from None
    parts = [(e, _part_summary(d / e["dir"])) for e in entries]
    read = [p for _, p in parts if "problem" not in p]
    if not read:
        raise ValueError(f"no part of the sharded index {str(d)!r} can be read ({parts[0][1]['problem']})")
    s = json.loads(json.dumps(read[0]))  # (a copy: the part's own stays as it is)
    counts = whole.get("counts", {})
    s["dir"] = str(d)
    s["data"].update(examples=counts.get("examples"), truncated=counts.get("truncated"),
                     nonfinite=len(whole.get("nonfinite_ids", [])))
    s["bytes"].update({k: sum(p["bytes"][k] for p in read) for k in ("store", "faiss")})
    s["parts"] = [{"dir": e["dir"], "rows": [e["first"], e["stop"]], **(
        {"status": "absent"} if not (d / e["dir"]).is_dir() else
        {"status": "unreadable", "problem": p["problem"]} if "problem" in p else
        {"examples": p["data"]["examples"], "status": p["status"], "index": p["index"], "bytes": p["bytes"]})}
        for e, p in parts]
    return s


def _part_summary(d: Path) -> dict:
    """:func:`summary` of one part, or ``{"problem": ...}`` where it cannot be read (missing, damaged manifest): the
    other parts are still summarized."""
    try:
        return summary(str(d))
    except (OSError, ValueError) as e:
        return {"problem": str(e)}


@main.command()
@click.argument("index_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def info(index_dir, as_json):
    """Summarize INDEX_DIR: model, layers and dimensions, counts, methods, index types, sizes (of a sharded index:
    the whole index's, then each part's)."""
    s = sharded_summary(index_dir) if (Path(index_dir) / SHARDS).is_file() else summary(index_dir)
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    p = s["projection"] or {}
    proj = ("none" if p.get("kind") == "none" else f"{p.get('kind')} per layer" if p.get("sizes")
            else f"{p.get('kind')} {p.get('k_g')}x{p.get('k_a')}")
    if s["basis"].get("kind", "raw") != "raw":
        proj += f", rows in the {s['basis']['kind']} whitened basis"
    state = s["status"] if not s["transcode_unfinished"] else f"{s['status']} capture, transcode unfinished"
    sharded = f", sharded: {len(s['parts'])} parts" if "parts" in s else ""
    click.echo(f"index      {s['dir']} ({state}, gradindex {s['library_version']}{sharded})")
    mo = s["model"]
    click.echo(f"model      {mo['id']} ({mo['dtype']}, fingerprint {str(mo['fingerprint'])[:12]})")
    if mo.get("file"):  # a GGUF file: de-quantized to the dtype above
        f = mo["file"]
        click.echo(f"           {f['format']} file, {f.get('architecture', '?')}, {human_bytes(f['bytes'])}, "
                   f"blake2b {f['blake2b'][:12]}")
    d = s["data"]
    click.echo(f"data       {d['id']}: {d['examples']} examples (field {d['field']!r}, "
               f"{d['truncated']} truncated, {d['nonfinite']} non-finite)")
    click.echo(f"projection {proj}, seed {p.get('seed')}; max length {s['max_length']}; rows stored as {s['storage']}")
    if s["rows"]:
        click.echo(f"rows       {s['rows']['spec']}: {s['rows']['describe']}")
    if s["baked_damping"] is not None:  # (not the query's: issue 31 item 2)
        click.echo(f"damping    rows whitened at damping {s['baked_damping']:g} (fixed at build; query --damping "
                   "does not change them)")
    click.echo(f"layers     {len(s['layers'])}, {s['dims_total']} numbers per example")
    for n, v in s["layers"].items():
        idx = f"{v['index']} {human_bytes(v['index_bytes'])}" if v["index"] else "no index"
        shape = f"[{v['shape'][0]}x{v['shape'][1]}]"
        click.echo(f"  {n}  {v['module']} {v['in_out'][0]}->{v['in_out'][1]}  {shape}  {idx}")
    click.echo(f"methods    {', '.join(s['methods'])}")
    for k, f in s["full_space"].items():  # (the exact re-rank's curvature: docs/query.md, "Two stages")
        corr = f", its correction over {f['correction_examples']}" if k == "ekfac" else ""
        click.echo(f"full space {k}: factors over {f['examples']} examples{corr} ({f['file']}; the exact re-rank's)")
    ix = s["index"]
    if s["transcode_unfinished"]:
        click.echo(f"indices    none: the build stopped during its transcode; finish it with "
                   f"`{build_command(index_dir, read_manifest(index_dir), extra='', index=True)}`")
    elif ix is None:
        click.echo(f"indices    none (build them with `gradindex index {index_dir}`)")
    else:
        sp = ix["space"]
        space = space_words(sp, s["basis"].get("kind", "raw"), damping=True)
        norm = ", normalized" if sp["normalize"] else ""
        click.echo(f"indices    {', '.join(ix['types'])}; {space}{norm}; {ix['status']}")
    b = s["bytes"]
    basis = f", basis {human_bytes(b['basis'])}" if b["basis"] else ""
    click.echo(f"on disk    store {human_bytes(b['store'])}{basis}, precond {human_bytes(b['precond'])}, "
               f"faiss {human_bytes(b['faiss'])}")
    _echo_parts(s.get("parts", []), index_dir)


def _echo_parts(parts: list[dict], index_dir: str) -> None:
    """A line a part of a sharded index: its rows, examples, status, store and tier (or why it cannot be read)."""
    for p in parts:
        rows = f"rows {p['rows'][0]}-{p['rows'][1] - 1}"
        if p["status"] == "absent":  # (a host that holds only its own torchrun ranks' parts)
            click.echo(f"  {p['dir']}  {rows}: not in this folder")
            continue
        if p["status"] == "unreadable":
            click.echo(f"  {p['dir']}  {rows}: UNREADABLE ({p['problem']})")
            continue
        ix = p["index"]
        tier = (f"tier {', '.join(ix['types'])} ({ix['status']}, {human_bytes(p['bytes']['faiss'])})" if ix
                else "no tier")
        click.echo(f"  {p['dir']}  {rows} ({p['examples']} examples, {p['status']}): "
                   f"store {human_bytes(p['bytes']['store'])}, {tier}")
