"""A stand-in for `python -m vllm.entrypoints.cli.main`: the lab's benches start servers by that
module, so a test puts a package of that name, whose main.py is the test's own server script, first
on the children's PYTHONPATH (with the project's src/ after it, for flash_vllm.launch)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def install(tmp_path: Path, monkeypatch, main_src: str) -> Path:
    """Write the package under tmp_path/site with `main_src` as its main.py; returns the site."""
    site = tmp_path / "site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for pkg in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (pkg / "__init__.py").write_text("")
    (cli / "main.py").write_text(main_src)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{SRC}")
    return site
