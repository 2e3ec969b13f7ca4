"""Write docs/cli.md, the CLI reference, from the click commands of ``gradindex.cli.main``.

    python scripts/cli_reference.py            # rewrite docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 if docs/cli.md is stale

The page is rendered from the commands' parameters (names, types, defaults, help), not from the
terminal-wrapped ``--help`` text, so it does not depend on the terminal width.
``tests/test_docs.py`` fails when the checked-in page differs from a fresh rendering.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
PROG = "gradindex"

HEADER = """# CLI reference

Generated from the click commands by `python scripts/cli_reference.py` (do not edit by hand;
`tests/test_docs.py` fails when this page and `gradindex COMMAND --help` differ). Every command
also takes `-h` / `--help`. Where the installed `gradindex` script is not on your path,
`python -m gradindex.cli` is the same program.
"""


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _type(p: click.Parameter) -> str:
    if isinstance(p, click.Option) and p.is_flag:
        return "flag"
    t = p.type
    if isinstance(t, click.Choice):
        return " \\| ".join(f"`{c}`" for c in t.choices)
    if isinstance(t, click.Path):
        if t.file_okay and not t.dir_okay:
            return "file"
        if t.dir_okay and not t.file_okay:
            return "directory"
        return "path"
    return {"integer": "integer", "float": "number", "text": "text", "boolean": "boolean"}.get(t.name, t.name)


def _default(p: click.Option) -> str:
    v = p.to_info_dict().get("default")  # click >= 8.2 keeps an UNSET sentinel in p.default; this gives None
    if p.is_flag or p.required or v is None or v in ((), [], "") or callable(v):
        return ""
    if isinstance(v, (list, tuple)):
        v = ", ".join(map(str, v))
    return f"`{v}`"


def _names(p: click.Option) -> str:
    return ", ".join(f"`{n}`" for n in [*sorted(p.opts, key=len), *p.secondary_opts])


def _option_rows(cmd: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for p in cmd.get_params(ctx):
        if not isinstance(p, click.Option) or p.hidden or "--help" in p.opts:
            continue
        help_ = p.help or ""
        if p.multiple:
            help_ = help_ if "repeatable" in help_.lower() else (help_ + " Repeatable.").strip()
        if p.required:
            help_ = "**Required.** " + help_
        rows.append(f"| {_names(p)} | {_type(p)} | {_default(p)} | {_cell(help_)} |")
    return rows


def render_command(cmd: click.Command, path: list[str], parent: click.Context) -> list[str]:
    ctx = click.Context(cmd, info_name=path[-1], parent=parent)
    usage = " ".join([*path, *cmd.collect_usage_pieces(ctx)])
    out = [f"## `{' '.join(path[1:])}`", "", "```", usage, "```", ""]
    if cmd.help:
        out += [inspect.cleandoc(cmd.help), ""]
    args = [p for p in cmd.get_params(ctx) if isinstance(p, click.Argument)]
    if args:
        out += ["Arguments: " + ", ".join(f"`{a.human_readable_name}` ({_type(a)})" for a in args) + ".", ""]
    rows = _option_rows(cmd, ctx)
    if rows:
        out += ["| option | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                out += render_command(sub, [*path, name], ctx)
    return out


def render(group: click.Group | None = None) -> str:
    """The whole reference page for ``group`` (default: ``gradindex.cli.main``)."""
    if group is None:
        from gradindex.cli import main as group
    ctx = click.Context(group, info_name=PROG)
    names = [n for n in group.list_commands(ctx) if not (group.get_command(ctx, n) or click.Command(n)).hidden]
    out = [HEADER, "```", " ".join([PROG, *group.collect_usage_pieces(ctx)]), "```", ""]
    if group.help:
        out += [group.help.strip(), ""]
    rows = _option_rows(group, ctx)
    if rows:
        out += ["Global options (before the command):", "", "| option | type | default | meaning |",
                "| --- | --- | --- | --- |", *rows, ""]
    out += ["| command | what it does |", "| --- | --- |"]
    for n in names:
        cmd = group.get_command(ctx, n)
        out.append(f"| [`{n}`](#{n}) | {_cell(cmd.get_short_help_str(limit=200))} |")
    out.append("")
    for n in names:
        out += render_command(group.get_command(ctx, n), [PROG, n], ctx)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="Exit 1 if docs/cli.md differs from a fresh rendering.")
    ap.add_argument("--out", type=Path, default=PAGE)
    args = ap.parse_args()
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
