"""Install flash_vllm into an image's Python without pip, network or a build backend.

    python3 /opt/flash/lib/flash_vllm/_image_install.py /opt/flash

The Dockerfile copies the packages to `<prefix>/lib/flash_vllm` and `<prefix>/lib/flash_common` (the
shared package the plugin imports) and runs this, which:
- writes `flash_vllm.pth` into the interpreter's site-packages (so `import flash_vllm` and
  `import flash_common` work in
  every process vLLM spawns, without PYTHONPATH);
- writes `<prefix>/lib/flash_recipe-<version>.dist-info` (METADATA, entry_points.txt, RECORD,
  INSTALLER) so `importlib.metadata` finds the distribution and vLLM's plugin loader finds the
  `vllm.general_plugins` entry point `flash = flash_vllm:register`;
- checks both from a fresh interpreter.

It works the same on the vLLM images (Ubuntu, python3.12, pip present) and on a bare Debian
python3 (the engine tier's stand-in base, which has no pip), so there is one install path.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

DIST = "flash_recipe"
ENTRY_POINTS = "[vllm.general_plugins]\nflash = flash_vllm:register\n"


def version_of(pyproject: Path) -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
    if not m:
        raise SystemExit(f"no version in {pyproject}")
    return m.group(1)


def write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def site_packages() -> Path:
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key])
        if str(p) in sys.path or p.is_dir():
            p.mkdir(parents=True, exist_ok=True)
            return p
    raise SystemExit("no site-packages directory on this interpreter")


def main(prefix: str) -> int:
    root = Path(prefix)
    lib = root / "lib"
    for package in ("flash_vllm", "flash_common"):
        if not (lib / package / "__init__.py").is_file():
            raise SystemExit(f"{lib}/{package} is missing: COPY the package there first")
    version = version_of(root / "pyproject.toml")
    dist = lib / f"{DIST}-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    write(dist / "METADATA", f"Metadata-Version: 2.1\nName: flash-recipe\nVersion: {version}\n"
          "Summary: flash_vllm, the recipe's vLLM general plugin (image install)\n")
    write(dist / "entry_points.txt", ENTRY_POINTS)
    write(dist / "INSTALLER", "flash-dockerfile\n")
    write(dist / "top_level.txt", "flash_common\nflash_vllm\n")
    files = sorted(p.relative_to(lib).as_posix() for p in lib.rglob("*") if p.is_file())
    write(dist / "RECORD", "".join(f"{f},,\n" for f in files if not f.endswith("RECORD")) + f"{dist.name}/RECORD,,\n")
    pth = site_packages() / "flash_vllm.pth"
    write(pth, f"{lib}\n")
    probe = ("import importlib.metadata as m, flash_vllm, flash_common.releases, sys; "
             "eps = [e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'flash']; "
             "assert eps == ['flash_vllm:register'], eps; "
             f"assert m.version('flash-recipe') == {version!r}; print(flash_vllm.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit("flash_vllm install check failed")
    print(f"flash_vllm {version}: {pth} -> {lib}; entry point vllm.general_plugins:flash ok")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: _image_install.py PREFIX")
    sys.exit(main(sys.argv[1]))
