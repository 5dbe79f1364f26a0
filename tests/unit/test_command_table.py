"""The command list is kept once (commands.TABLE): each module's parser takes its one-line help
from it, `flash --help` (stubs) and the full parsers agree, and no command module imports the
CLI wiring above it (commands/service.py once did, to re-parse serve's words)."""

from __future__ import annotations

import ast
from pathlib import Path

from flash_cli import cli
from flash_cli.commands import COMMANDS, TABLE, summary

COMMANDS_DIR = Path(cli.__file__).parent / "commands"


def _choices(parser) -> dict:
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {c.dest: c.help for c in sub._choices_actions}


def test_full_parsers_and_stubs_show_the_same_help():
    full, stubs = _choices(cli.build_parser()), _choices(cli.build_parser(["--help"]))
    assert list(full) == list(stubs) == list(TABLE)
    for name in TABLE:
        assert full[name] == stubs[name] == summary(name), name


def test_every_module_is_in_the_table_and_registers_its_rows():
    on_disk = {p.stem for p in COMMANDS_DIR.glob("*.py") if p.stem != "__init__"}
    assert set(COMMANDS) == on_disk  # a module outside TABLE would never be registered


def test_no_command_module_imports_the_cli():
    for path in COMMANDS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                assert node.module != "cli" and "cli" not in [a.name for a in node.names if node.module is None], path


def test_service_runs_serve_with_serves_own_parser():
    from flash_cli.commands import serve, service

    args = service.serve_args(["speed", "RESTART=no"])
    assert args.func is serve.run and args.recipe == ["speed", "RESTART=no"]
    assert args.dry_run is False and args.start_check == 8.0  # serve's defaults, as `flash serve` has them
