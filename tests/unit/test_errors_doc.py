"""docs/ARCHITECTURE.md's exit codes are generated from src/flash_cli/errors.py, the one map from
error to exit code (issue 37: the hand-kept list had lost code 11)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from flash_cli import errors

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gen_errors_doc.py"


def test_architecture_exit_codes_are_generated_from_the_error_map():
    res = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_check_fails_when_the_doc_drifts(tmp_path):
    # the tool run on a copy whose list lacks a code must say so, not pass
    tree = tmp_path / "repo"
    (tree / "tools").mkdir(parents=True)
    (tree / "docs").mkdir()
    (tree / "tools" / "gen_errors_doc.py").write_text(TOOL.read_text())
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    (tree / "docs" / "ARCHITECTURE.md").write_text(doc.replace("| 11 | `ContextMismatch`", "| 12 | `ContextMismatch`"))
    res = subprocess.run([sys.executable, str(tree / "tools" / "gen_errors_doc.py"), "--check"], capture_output=True, text=True)
    assert res.returncode == 1 and "out of date" in res.stderr


def test_every_error_class_elsewhere_uses_a_code_the_map_documents():
    """A FlashError subclass outside errors.py (DownloadError, CheckpointError) may only reuse a code
    errors.py defines, or the generated list would miss it."""
    documented = {c.exit_code for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.FlashError)}
    strays = []
    for path in (ROOT / "src" / "flash_cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if (isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "exit_code" for t in stmt.targets)
                        and isinstance(stmt.value, ast.Constant) and stmt.value.value not in documented):
                    strays.append(f"{path.relative_to(ROOT)}: {node.name}.exit_code = {stmt.value.value}")
    assert not strays, "exit codes not in src/flash_cli/errors.py: " + "; ".join(strays)
