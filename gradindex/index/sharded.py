"""A sharded index: parts that are each a complete index over a contiguous range of rows, and one file naming them.

::

    SHARDED/
      shards.json        the parts and their row ranges, and the whole index's manifest (what a merge writes back)
      part-00000/        a complete index (manifest, store, basis, fits, tiers) over rows [0, n_0), numbered 0.. in it
      part-00001/        rows [n_0, n_0 + n_1)
      ...

A part's store holds the whole index's shard files for its rows as byte copies with their ids shifted to start at 0
(:mod:`gradindex.store.relabel`); its manifest is the whole one with its own counts, its nonfinite ids and a ``shard``
entry (``part``, ``parts``, ``first``, ``stop``, ``examples``). The fits are global: ``basis.h5`` and every fit file
without per-example data are hard links (else copies) of the whole index's; a fit's self-influence columns are cut
to the part's rows. So every part scores a query exactly as the whole index does, and a part's id ``i`` is the whole
index's ``first + i``. Each part has its own tier, built as the whole index's was (the same kind and space).

:func:`split_index` and :func:`merge_index` convert between one directory and parts without capturing anything;
a split then a merge gives back the store byte for byte. :mod:`gradindex.query.sharded` answers queries over the
parts, in one process or one part (or more) per ``torchrun`` rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradindex.checksum import check_files, damage_error, read_checksums, write_checksums
from gradindex.index.builder import build_indices
from gradindex.index.config import IndexConfig
from gradindex.index.files import link_or_copy, write_json
from gradindex.index.opened import OpenIndex
from gradindex.index.space import IndexSpace
from gradindex.lock import LOCK, index_lock
from gradindex.precondition.files import (
    read_attrs,
    read_factors,
    read_self_influence,
    write_precond,
)
from gradindex.spec import layout
from gradindex.spec.layout import BASIS_FILE, PRECOND_DIR, SHARD_GLOB, IndexLayout
from gradindex.spec.manifest import (
    SHARD_KEY,
    IndexMismatchError,
    Manifest,
    part_of,
    read_manifest,
    refuse_unfinished_transcode,
    sharded_name,
    write_manifest,
)
from gradindex.store import Store
from gradindex.store.relabel import copy_shard, write_rows

log = logging.getLogger("gradindex")

SHARDS_FILE = layout.SHARDS_FILE
"""The file that makes a directory a sharded index."""
FORMAT = "gradindex sharded index"
VERSION = 1
_PRECOND_ATTRS = {"method", "format_version", "library_version", "damping", "fit", "layer_names"}
"""Attributes :func:`~gradindex.precondition.files.write_precond` writes itself (the rest are carried as they were)."""


@dataclass(frozen=True)
class Part:
    """One part: its directory and the whole index's rows ``[first, stop)`` it holds."""

    dir: Path
    first: int
    stop: int

    @property
    def n(self) -> int:
        return self.stop - self.first


@dataclass(frozen=True)
class Sharded:
    """A sharded index directory as read from its :data:`SHARDS_FILE` (parts checked present and consistent)."""

    dir: Path
    parts: list[Part]
    manifest: dict
    """The whole index's manifest (counts over every part)."""
    other_split: str | None = None
    """Why :data:`SHARDS_FILE` is another split's than the parts here, as :func:`_read` found (:func:`other_split`)."""

    @property
    def examples(self) -> int:
        return self.parts[-1].stop

    def owned(self, rank: int, ranks: int) -> list[int]:
        """The parts rank ``rank`` of ``ranks`` answers for: a contiguous run, as even as the parts allow."""
        P = len(self.parts)
        if not 1 <= ranks <= P:
            raise ValueError(f"{str(self.dir)!r} has {P} parts; run at most {P} ranks (one part or more each), "
                             f"not {ranks}")
        return owned_parts(P, rank, ranks)


def owned_parts(parts: int, rank: int, ranks: int) -> list[int]:
    """The parts (of ``parts``) rank ``rank`` of ``ranks`` answers for (:meth:`Sharded.owned`, unchecked)."""
    return list(range(rank * parts // ranks, (rank + 1) * parts // ranks))


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded index directory (it holds :data:`SHARDS_FILE`)."""
    return (Path(path) / SHARDS_FILE).is_file()


def refuse_part_as_index(path: str | os.PathLike, manifest: dict | None = None, then: str = "") -> None:
    """Refuse a part of a sharded index where a whole index is meant (its ids are the part's own: row ``first`` of
    the whole index is its 0, and its texts are not beside it); ``then``: what to do instead (default: use the
    sharded index)."""
    path = Path(path)
    part = manifest.get(SHARD_KEY) if manifest is not None else (part_of(path) or (None, None))[1]
    if part:
        whole = sharded_name(path)
        raise ValueError(f"{str(path)!r} is part {part['part']} of {whole} (its rows {part['first']}-"
                         f"{part['stop'] - 1}, numbered from 0 here: its ids are the part's own); "
                         f"{then or f'give {whole} instead (all its parts are read)'}")


def read_sharded(path: str | os.PathLike, rank: tuple[int, int] | None = None) -> Sharded:
    """The sharded index in ``path``; its parts' ranges must tile ``[0, N)`` and each part's manifest must be a
    complete build of the same index (its identity and row range as :data:`SHARDS_FILE` says): the first
    inconsistency is raised. ``rank``: ``(rank, ranks)`` of a ``torchrun`` run: only the parts that rank answers for
    are read (the other ranks read theirs), so a part need only be on its own rank's host."""
    return _read(Path(path), None, rank)


def check_sharded(path: str | os.PathLike) -> tuple[Sharded, list[str]]:
    """The sharded index in ``path`` and every inconsistency of the parts here (:func:`read_sharded` raises the
    first): row ranges that do not tile ``[0, N)``, a ``shards.json`` of another split than the parts, a part whose
    manifest is not the index's build (model fingerprint, projection, layers, row spec: ``build``), generation or
    row range, or whose fits differ from part 0's (a part refitted alone). A part whose folder is not here is left
    to the caller (:func:`absent_parts`); ``shards.json`` itself unreadable is raised."""
    problems: list[str] = []
    sh = _read(Path(path), problems, absent_ok=True)
    here = [p for p in sh.parts if p.dir.is_dir()]
    if not problems and here:
        try:
            _same_fits(sh, here)
        except (IndexMismatchError, OSError, ValueError) as e:
            problems.append(str(e))
    return sh, problems


def absent_parts(sh: Sharded) -> list[int]:
    """The parts of ``sh`` whose folder is not here (a host's copy of its own ranks' parts)."""
    return [j for j, p in enumerate(sh.parts) if not p.dir.is_dir()]


def _read(d: Path, problems: list[str] | None, rank: tuple[int, int] | None = None, absent_ok: bool = False) -> Sharded:
    """:data:`SHARDS_FILE` and its parts checked (``rank``: only that rank's; ``absent_ok``: not those whose folder
    is not here); each inconsistency raised (``problems`` None) or appended."""
    def fail(e: Exception) -> None:
        if problems is None:
            raise e
        problems.append(str(e))

    try:
        doc = json.loads((d / SHARDS_FILE).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(d)!r} is not a sharded index (no {SHARDS_FILE}; `gradindex split` makes "
                                "one)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(d / SHARDS_FILE)!r} is corrupt ({e})") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"{str(d / SHARDS_FILE)!r} is not a version-{VERSION} {FORMAT} file")
    parts = [Part(d / p["dir"], int(p["first"]), int(p["stop"])) for p in doc["parts"]]
    whole = doc["manifest"]
    checked = set(range(len(parts)) if rank is None else Sharded(d, parts, whole).owned(*rank))
    if absent_ok:
        checked = {j for j in checked if parts[j].dir.is_dir()}
    at = 0
    for j, p in enumerate(parts):
        if p.first != at or p.stop <= p.first:
            fail(ValueError(f"{str(d / SHARDS_FILE)!r}: part {j} holds rows [{p.first}, {p.stop}), expected them "
                            f"to start at {at}"))
        at = p.stop
    if at != int(whole["counts"]["examples"]):
        fail(ValueError(f"{str(d / SHARDS_FILE)!r}: its parts hold {at} rows, the index "
                        f"{whole['counts']['examples']}"))
    if other := other_split(Sharded(d, parts, whole), checked):
        fail(IndexMismatchError(other))
        checked = set()  # (each part's own mismatch, or absence, is this one)
    for j in sorted(checked):
        try:
            _check_part(parts[j], j, len(parts), whole)
        except (IndexMismatchError, ValueError, FileNotFoundError) as e:
            fail(e)
    return Sharded(d, parts, whole, other)


def other_split(sh: Sharded, parts: set[int] | None = None) -> str | None:
    """Why :data:`SHARDS_FILE` is another split's than the parts here (``parts``: those to look at, default every
    part whose folder is here): none of them is the part the file names at its place, and they all name the same
    other number of parts. ``None`` otherwise: a part that does not fit a file the others fit is that part's
    problem, named by its own check."""
    d, P = sh.dir, len(sh.parts)
    looked = [j for j in sorted(range(P) if parts is None else parts) if sh.parts[j].dir.is_dir()]
    said = {}
    for j in looked:
        try:
            said[j] = read_manifest(sh.parts[j].dir).get(SHARD_KEY) or {}
        except (OSError, ValueError):
            continue
    fits = [j for j, s in said.items() if (s.get("part"), s.get("parts"), s.get("first"), s.get("stop")) ==
            (j, P, sh.parts[j].first, sh.parts[j].stop)]
    counts = {s.get("parts") for s in said.values()}
    if fits or len(counts) != 1 or counts == {P} or None in counts:
        return None
    j, s = next(iter(said.items()))
    ranges = ", ".join(f"{p.first}-{p.stop - 1}" for p in sh.parts)
    return (f"{str(d / SHARDS_FILE)!r} is another split's than the parts here: it names {P} parts (rows {ranges}), "
            f"and {str(sh.parts[j].dir)!r} is part {s.get('part')} of {s.get('parts')} (rows {s.get('first')}-"
            f"{s.get('stop', 0) - 1}); {SPLIT_FIX}")


SPLIT_FIX = (f"put back the {SHARDS_FILE} written with these parts (by `gradindex split` or `build --parts`), or copy "
             "here the parts it names")
"""The repair of a :data:`SHARDS_FILE` of another split (:func:`other_split`)."""


def _check_part(p: Part, j: int, parts: int, whole: dict) -> None:
    """Refuse a part that is not a complete build of ``whole``'s index over its rows."""
    m, w = Manifest.read_complete(p.dir, "query it"), Manifest.of(whole)
    s = m.get(SHARD_KEY) or {}
    want = {"part": j, "parts": parts, "first": p.first, "stop": p.stop, "examples": w.examples}
    if {k: s.get(k) for k in want} != want:
        raise IndexMismatchError(f"{str(p.dir)!r} is not part {j} of this sharded index (its manifest says "
                                 f"{ {k: s.get(k) for k in want} }, {SHARDS_FILE} {want})")
    if m.build != w.build or m.generation != w.generation:
        what = [k for k in ("model_fingerprint", "projection", "layers", "storage", "basis")
                if m.build.get(k) != w.build.get(k)] or ["build" if m.build != w.build else "generation"]
        verb = "differ" if len(what) > 1 else "differs"
        raise IndexMismatchError(f"{str(p.dir)!r} holds another build than the sharded index's other parts (its "
                                 f"manifest's {', '.join(what)} {verb}); split the index again")
    if m.examples != p.n:
        raise IndexMismatchError(f"{str(p.dir)!r} holds {m.examples} examples, {SHARDS_FILE} says "
                                 f"rows [{p.first}, {p.stop}); split the index again")


# -- split ---------------------------------------------------------------------------------------------------------
def split_index(src: str | os.PathLike, out: str | os.PathLike, parts: int, progress: bool = False) -> Sharded:
    """Split the complete index ``src`` into ``parts`` parts in the new directory ``out`` (nothing is captured:
    the store's shard files are copied, whole, into contiguous groups; the fits are linked or cut; each part's
    tier is built as ``src``'s was). ``shards.json`` is written last: a killed split leaves no sharded index."""
    src, out = Path(src), Path(out)
    if is_sharded(src):
        raise ValueError(f"{str(src)!r} is already a sharded index; merge it first (`gradindex merge`)")
    with OpenIndex(src, then="split it") as ix:
        refuse_unfinished_transcode(src, ix.manifest, "split it")
        refuse_part_as_index(src, ix.manifest, f"split the whole index: `gradindex merge {src.parent} --out ONE`, "
                                               "then `gradindex split ONE --shards P --out NEW`")
        if not 1 <= parts <= ix.n:
            raise ValueError(f"{str(src)!r} has {ix.n} examples; it splits into 1 to {ix.n} parts, not {parts}")
        whole = ix.manifest
        fits = _fit_files(src)
        with _writing(out, "split", src):
            made = []
            for j, pieces in enumerate(_pieces(ix.store, parts)):
                first = ix.store.first_ids[pieces[0][0]] + pieces[0][1]
                stop = ix.store.first_ids[pieces[-1][0]] + pieces[-1][2]
                part = Part(out / f"part-{j:05d}", first, stop)
                _write_part(ix, part, j, parts, pieces, fits)
                made.append(part)
                if progress:
                    log.warning("part %d of %d: rows [%d, %d)", j + 1, parts, first, stop)
            doc = {"format": FORMAT, "version": VERSION, "examples": int(whole["counts"]["examples"]),
                   "parts": [{"dir": p.dir.name, "first": p.first, "stop": p.stop} for p in made], "manifest": whole}
            write_json(out / SHARDS_FILE, doc, indent=1)
    return read_sharded(out)


UNFINISHED = ".unfinished.json"
"""In a split's or merge's ``--out`` while it is written: which command and source; removed when it is complete. A
run killed outright (no cleanup ran; its lock went with it) leaves it, and the same command clears that ``--out``
and starts again."""


@contextlib.contextmanager
def _writing(out: Path, op: str, src: Path):
    """``out`` claimed for a split or merge (``op``) of ``src``: refused inside ``src`` (the index's files and its
    own would mix, and go with it), locked (a second writer, a run of the same command included, is refused while
    this one lives), refused unless new or empty (or left so by a killed ``op`` of the same ``src``: cleared),
    marked unfinished while the work inside runs, and emptied again when it fails (removed, if made here): a failed
    split or merge leaves no half-written output; a killed one, its mark."""
    if src.resolve() in (out.resolve(), *out.resolve().parents):
        raise ValueError(f"--out {str(out)!r} is inside {str(src)!r}; give a directory outside it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{str(out)!r} exists and is not a directory; give a new --out")
    with index_lock(out, f"gradindex {op}"):  # (removes the folder again if it made it and nothing was written)
        mark = {"op": op, "src": str(src.resolve())}
        if _unfinished(out) == mark:
            log.warning("%s holds an unfinished %s of %s (killed?): cleared, %s again", out, op, src, op)
            _empty(out)
        if _held(out):
            other = _unfinished(out)
            again = f" (an unfinished {other['op']} of another source)" if other else ""
            raise FileExistsError(f"{str(out)!r} exists and is not an empty directory{again}; give a new --out")
        write_json(out / UNFINISHED, mark)
        try:
            yield
        except BaseException:
            _empty(out)
            raise
        (out / UNFINISHED).unlink()


def _unfinished(out: Path) -> dict | None:
    try:
        return json.loads((out / UNFINISHED).read_text())
    except (OSError, ValueError):
        return None


def _held(out: Path) -> list[Path]:
    """What ``out`` holds besides its lock file."""
    return [p for p in out.iterdir() if p.name != LOCK]


def _empty(out: Path) -> None:
    """Delete what ``out`` holds (its lock file aside), its :data:`UNFINISHED` mark last (a kill midway leaves the
    mark: the same command clears the rest)."""
    for p in sorted(_held(out), key=lambda p: p.name == UNFINISHED):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def _fit_files(src: Path) -> list[tuple[str, bool]]:
    """``(relative name, has per-example rows)`` of the basis and every fit file of ``src``, each checked against
    its recorded hash first (a part links them: a damaged one would go unnoticed under the link)."""
    names = [BASIS_FILE] if (src / BASIS_FILE).exists() else []
    names += sorted(f"{PRECOND_DIR}/{p.name}" for p in (src / PRECOND_DIR).glob("*.h5"))
    damage = check_files(src, names, full=True)
    if damage:
        raise damage_error(src, damage, then="split it")
    return [(n, n.startswith(PRECOND_DIR) and _has_rows(src / n)) for n in names]


def _has_rows(path: Path) -> bool:
    try:
        read_self_influence(path)
    except KeyError:
        return False
    return True


def _pieces(store, parts: int) -> list[list[tuple[int, int, int]]]:
    """Each part's ``(shard file, first row, stop row)`` pieces of ``store`` (:func:`piece_rows`)."""
    return piece_rows(store.sizes, parts)


def piece_rows(sizes: list[int], parts: int) -> list[list[tuple[int, int, int]]]:
    """Each part's ``(shard file, first row, stop row)`` pieces (rows within the file) of a store whose files hold
    ``sizes`` rows: whole files, in contiguous groups as even as the files allow, when the parts are at most the
    files; else rows ``[j N / P, (j+1) N / P)``, the files cut where a part starts or ends inside one."""
    K, N = len(sizes), sum(sizes)
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int).tolist() if K else []
    if parts <= K:
        return [[(k, 0, sizes[k]) for k in range(j * K // parts, (j + 1) * K // parts)] for j in range(parts)]
    out = []
    for j in range(parts):
        lo, hi = j * N // parts, (j + 1) * N // parts
        out.append([(k, max(lo, f) - f, min(hi, f + n) - f) for k, (f, n) in enumerate(zip(firsts, sizes,
                                                                                          strict=True))
                    if f < hi and lo < f + n])
    return out


def _write_part(ix: OpenIndex, part: Part, j: int, parts: int, pieces: list[tuple[int, int, int]], fits) -> None:
    """One part: its store (shard files copied with their ids shifted, or the rows of a cut file written as one of its
    own), then :func:`write_part_rest` (fits, manifest) and its tier."""
    recorded = read_checksums(ix.dir)
    for k_local, (k, a, b) in enumerate(pieces):
        dst = IndexLayout.of(part.dir).shard(k_local)
        if (a, b) == (0, ix.store.sizes[k]):
            copy_shard(ix.store.paths[k], dst, -part.first, recorded)
        else:
            write_rows([(ix.store.paths[k], a, b)], dst, ix.store.first_ids[k] + a - part.first, {ix.dir: recorded})
    write_part_rest(ix.dir, ix.manifest, part, j, parts, pieces, ix.store.sizes, fits, recorded)
    _build_tier(part.dir, ix.manifest)


def write_part_rest(src: Path, whole: dict, part: Part, j: int, parts: int, pieces: list[tuple[int, int, int]],
                    sizes: list[int], fits, recorded: dict) -> dict:
    """A part's fits (linked from ``src``, or cut to its rows) and manifest (``whole``'s with its own counts and a
    ``shard`` entry whose ``files`` are each file's ``[file of the whole index, first row, stop row, that file's
    rows]``, what a merge joins again), once its store is in place; written again over a killed try's. Returns
    the manifest."""
    m = copy.deepcopy(whole)
    m["counts"] = {**m["counts"], "examples": part.n, "shards": len(pieces)}
    m["nonfinite_ids"] = [int(i) - part.first for i in m.get("nonfinite_ids", []) if part.first <= int(i) < part.stop]
    m[SHARD_KEY] = {"part": j, "parts": parts, "first": part.first, "stop": part.stop,
                    "examples": int(whole["counts"]["examples"]),
                    "files": [[k, a, b, sizes[k]] for k, a, b in pieces]}
    for name, rows in fits:
        if rows:
            _write_fit(src / name, part.dir / name, m, lambda si: si[part.first:part.stop])  # (its rows only)
        else:
            (part.dir / name).unlink(missing_ok=True)  # (a killed try's link: linked again)
            _link(src, part.dir, name, recorded)
    write_manifest(part.dir, m)
    return m


def _link(src: Path, dst: Path, name: str, recorded: dict) -> None:
    """Hard-link (else copy) ``src/name`` into ``dst`` and carry its recorded hash (fits are replaced, never
    written in place, so a link is never changed under another index)."""
    (dst / name).parent.mkdir(parents=True, exist_ok=True)
    link_or_copy(src / name, dst / name)
    if name in recorded:
        write_checksums(dst, {**read_checksums(dst), name: recorded[name]})


def _write_fit(src: Path, dst: Path, manifest: dict, rows) -> None:
    """``src``'s fit written to ``dst`` with the self-influence ``rows(self-influence)`` (the factors as they are)."""
    attrs = read_attrs(src)
    damping, names, si = read_self_influence(src)
    try:
        factors = read_factors(src)
    except KeyError:  # (graddot.h5: self-influence columns only)
        factors = None
    extra = {k: v for k, v in attrs.items() if k not in _PRECOND_ATTRS and not k.startswith("fp_")}
    write_precond(dst, str(attrs["method"]), manifest, names, factors, rows(si), damping, json.loads(attrs["fit"]),
                  attrs=extra)


def _build_tier(d: Path, manifest: dict, base: IndexConfig | None = None) -> None:
    """The tier of the whole index (``manifest['index']``), built over ``d``'s rows; none where it had none.
    ``base``: the settings the tier's kind, space and sketch size do not set (training sample, GPU)."""
    ix = manifest.get("index") or {}
    if ix.get("status") == "complete":
        build_indices(d, part_tier_config(ix, base), progress=False)


def part_tier_config(entry: dict, base: IndexConfig | None = None) -> IndexConfig:
    """The :class:`IndexConfig` a part's tier is built with, from the whole index's manifest ``index`` entry: its
    kind (a FAISS tier's one factory, else ``auto``), space and sketch size; the rest ``base``'s."""
    kind, factories = entry.get("kind", "faiss"), entry.get("factories") or []
    factory = kind if kind != "faiss" else (factories[0] if len(factories) == 1 else "auto")
    return dataclasses.replace(base or IndexConfig(), factory=factory,
                               space=IndexSpace.from_dict(entry.get("space") or {}),
                               **({"sketch_bytes": int(entry["sketch_bytes"])} if entry.get("sketch_bytes") else {}))


# -- merge ---------------------------------------------------------------------------------------------------------
def merge_index(sharded: str | os.PathLike | Sharded, out: str | os.PathLike) -> Path:
    """Merge the parts of ``sharded`` (a directory, or one :func:`read_sharded` already read) into one complete index
    in the new directory ``out``: the store's shard files copied back with their ids shifted to the whole index's
    (the original bytes, for a split index), the fits with their self-influence rows joined, the whole manifest,
    and the tier rebuilt as it was."""
    sh = sharded if isinstance(sharded, Sharded) else read_sharded(sharded)
    out = Path(out)
    fits = _same_fits(sh)
    with _writing(out, "merge", sh.dir):
        _merge_into(sh, out, fits)
    return out


def _merge_into(sh: Sharded, out: Path, fits: list[tuple[str, bool]]) -> None:
    """:func:`merge_index`'s writing, into the empty directory ``out``."""
    k = 0
    for pieces, first in _originals(sh):
        dst = IndexLayout.of(out).shard(k)
        if len(pieces) == 1 and pieces[0][4]:
            copy_shard(pieces[0][0], dst, pieces[0][1].first)
        else:  # (the pieces of a file a split cut, joined: the same rows, not the same bytes)
            write_rows([(path, 0, n) for path, _, _, n, _, _ in pieces], dst, first)
        k += 1
    whole = copy.deepcopy(sh.manifest)
    if k != int(whole["counts"]["shards"]):
        raise ValueError(f"the parts of {str(sh.dir)!r} hold {k} store shard files, the index "
                         f"{whole['counts']['shards']}")
    for name, rows in fits:
        if rows:
            cuts = [p.dir / name for p in sh.parts]
            _write_fit(cuts[0], out / name, whole, functools.partial(_joined, cuts))
        else:
            _link(sh.parts[0].dir, out, name, read_checksums(sh.parts[0].dir))
    write_manifest(out, whole)
    _build_tier(out, whole)


def _originals(sh: Sharded) -> list[tuple[list[tuple], int]]:
    """The whole index's store files from the parts' files, each ``(pieces, first row)``: one piece
    ``(part file, its part, file of the whole index, rows, whole?, first row in that file)`` for a file copied whole,
    several for the pieces of a file a split cut (the parts' ``files`` entries say which; a part without them holds
    whole files)."""
    files = []
    for p in sh.parts:
        paths = sorted(IndexLayout(p.dir).store.glob(SHARD_GLOB))
        entries = (Manifest.read_complete(p.dir, "merge it").get(SHARD_KEY) or {}).get("files")
        if entries is None:
            with Store(p.dir) as st:
                entries = [[None, 0, n, n] for n in st.sizes]
        for path, (k, a, b, size) in zip(paths, entries, strict=True):
            files.append((path, p, k, b - a, (a, b) == (0, size), a))
    groups: list[tuple[list[tuple], int]] = []
    at = 0
    for f in files:
        if groups and f[2] is not None and groups[-1][0][-1][2] == f[2] and f[5] > 0:
            groups[-1][0].append(f)  # (the rest of the file the previous piece began)
        else:
            groups.append(([f], at))
        at += f[3]
    return groups


def _joined(cuts: list[Path], _) -> np.ndarray:
    """The parts' self-influence rows, in order (the whole index's)."""
    return np.concatenate([read_self_influence(c)[2] for c in cuts])


def _same_fits(sh: Sharded, parts: list[Part] | None = None) -> list[tuple[str, bool]]:
    """The fit files of the parts (``parts``, default all: the first one's, checked), refused unless every part
    holds the same ones (the factors are global: a part refitted on its own rows would score differently)."""
    parts = sh.parts if parts is None else parts
    first = parts[0].dir
    fits = _fit_files(first)
    want = read_checksums(first)
    for p in parts[1:]:
        have = read_checksums(p.dir)
        mine = _fit_files(p.dir)
        if [n for n, _ in mine] != [n for n, _ in fits]:
            raise IndexMismatchError(f"{str(p.dir)!r} holds other fit files than {str(first)!r}; split the index "
                                     "again")
        for name, rows in fits:
            if not rows and have.get(name, {}).get("blake2b") != want.get(name, {}).get("blake2b"):
                raise IndexMismatchError(f"{str(p.dir / name)!r} differs from {str(first / name)!r}: the parts' fits "
                                         "must be the same (global) fit; split the index again")
    return fits


__all__ = ["Part", "Sharded", "is_sharded", "merge_index", "read_sharded", "split_index"]
