"""``--index-type``'s help lists the registered index tiers; a sketch tier's ``--sketch-bytes`` is in the build
command the manifest prints (issue 32 item 4's registry, seen from the CLI)."""

from __future__ import annotations

import shutil

from click.testing import CliRunner

from gradindex.cli import main
from gradindex.cli.tiers import declared_tiers, registered_tiers
from gradindex.index.tiers import TIERS, Tier, register_tier, unregister_tier


def _help(command: str) -> str:
    res = CliRunner().invoke(main, [command, "--help"], terminal_width=2000)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_the_help_lists_every_registered_tier():
    for command in ("build", "index"):
        text = _help(command)
        assert all(f"{name}:" in text or f"{name} (catch-all):" in text for name in TIERS), (sorted(TIERS), text)
        assert "auto: the first of " in text


def test_the_source_read_agrees_with_the_registry():
    """The help reads the package's tiers from their source (no heavy import): the same names, order, catch-all."""
    static = declared_tiers()
    assert set(static) == set(TIERS)
    for name, cls in TIERS.items():
        assert (static[name].auto_order, static[name].catch_all) == (cls.auto_order, cls.catch_all), name
    assert [t.name for t in registered_tiers()][-1] == "faiss"  # the catch-all last


class NoteTier(Tier):
    """A tier for this test: it lists, nothing more."""

    name = "note-tier"
    auto_order = None
    help = "a tier defined in tests/test_cli_tiers.py"


def test_a_tier_registered_at_runtime_is_listed():
    register_tier(NoteTier)
    try:
        assert "note-tier: a tier defined in tests/test_cli_tiers.py" in _help("index")
    finally:
        unregister_tier("note-tier")
    assert "note-tier" not in _help("index")


def test_sketch_bytes_is_in_the_printed_build_and_index_commands(default_index, tmp_path):
    from gradindex.index.files import index_command
    from gradindex.spec.manifest import build_command, read_manifest

    idx = tmp_path / "idx"
    shutil.copytree(default_index, idx)
    res = CliRunner().invoke(main, ["index", str(idx), "--index-type", "sketch", "--sketch-bytes", "260", "--quiet"])
    assert res.exit_code == 0, res.output
    m = read_manifest(idx)
    assert m["index"]["sketch_bytes"] == 260
    assert "--index-type sketch --sketch-bytes 260" in build_command(idx, m), build_command(idx, m)
    assert "--sketch-bytes 260" in index_command(idx)
    res = CliRunner().invoke(main, ["index", str(idx), "--index-type", "store", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "--sketch-bytes" not in build_command(idx, read_manifest(idx))
