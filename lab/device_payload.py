#!/usr/bin/env python3
"""Carry a vLLM release's wheels to a machine without network, in parts, and install them there.

The device machine (one H200, Python 3.12 + pip, no network, 64 MiB per call) lacks what a vLLM
release needs (torch, triton, NCCL, FlashInfer, ~100 small wheels: ~1.5 GiB for 0.33.0). This
tool packs them here into one uncompressed tar split into parts that fit a call beside the tree, with a
manifest of sha256 sums, receives one part per device call there, and installs only a complete,
verified payload into its own prefix. docs/GPU-E2E.md gives the call sequence.

  pack     (here, reaches PyPI)  download the listed wheels (or pip's resolution of the release
                                 minus the image's freeze), tar, split, write manifest.json
  image-freeze (here)            approximate the image's freeze: a release's resolution minus the
                                 wheels the device was measured to lack
  receive  (remote)              verify a part against the manifest, move it into the store,
                                 print what is still missing
  install  (remote)              assemble + verify the tar, pip install --no-index --no-deps
                                 --target PREFIX, write PREFIX/env.sh, print the imported versions
  status   (either side)         what the store and the prefixes hold

Standard library only: the remote side has no project venv.
Exit codes: 0 ok, 2 bad input, 3 payload incomplete or corrupt, 4 a download or pip failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

FORMAT = 1
MIB = 1024 * 1024
# A device call carries the working tree beside the part, 64 MiB in all: 62 MiB parts failed with a
# 2.6 MiB tree, 56 MiB ones with the 8.3 MB tree of b50eb5d and the 7.7 MiB one of e3ac91a. So `pack`
# sizes parts from the tree it sees (carry_part_size), keeping headroom for what a session adds.
CALL_LIMIT = 64 * MIB
CARRY_HEADROOM = 3 * MIB  # the manifest, a session's new evidence files, rounding
MIN_PART_SIZE = 16 * MIB  # below this the carry takes 100+ calls: slim the tree instead
# without a tree to measure (no git checkout; pack() called as a library): room for a 13 MiB tree
DEFAULT_PART_SIZE = 48 * MIB
DEFAULT_STORE = "/var/tmp/flash-payload"
DEFAULT_CACHE = Path.home() / ".cache" / "flash-payload" / "wheels"
# Where the vllm tier keeps the release wheels it already downloaded (tests/support/tier-vllm.sh).
VLLM_WHEEL_DIRS = (Path.home() / ".cache" / "flash-tests" / "vllm" / "wheels",)
ROOT = Path(__file__).resolve().parents[1]
# The device image: CPython 3.12 on x86-64, glibc new enough for every manylinux tag below.
PY_VERSION = "3.12"
BASE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                  "manylinux2014_x86_64")
FALLBACK_GLIBC = (24, 31, 34, 35, 39)
PART_RE = re.compile(r"^part-(\d{3,})$")
STATUS_PREFIX = "payload-status: "
# What `install` imports to show the versions the prefix really serves (module, dist label).
VERSION_MODULES = ("vllm", "torch", "triton", "flashinfer")


class PayloadError(Exception):
    """A failure with an exit code and one line that says what to do."""

    def __init__(self, message: str, code: int = 3):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------
# small helpers


def sha256_file(path: Path, bufsize: int = 4 * MIB) -> str:
    # not flash_common.digest's: receive/install run from the bare carried tree, before src/ is on
    # any path (the device's python3 has no flash installed)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def wheel_requirement(filename: str) -> tuple[str, str]:
    """`name==version` parts from a wheel filename (PEP 427), or PayloadError naming it."""
    if not filename.endswith(".whl"):
        raise PayloadError(f"not a wheel filename: {filename!r} (expected NAME-VERSION-...-PLAT.whl)", 2)
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        raise PayloadError(f"not a wheel filename: {filename!r} (expected 5 or 6 '-'-separated fields)", 2)
    return parts[0], parts[1]


def wheel_platforms(filename: str) -> list[str]:
    """The platform tags a wheel filename carries (compressed tag sets split on '.')."""
    plat = filename[:-4].split("-")[-1]
    return [p for p in plat.split(".") if p != "any"]


def read_list(path: Path) -> list[str]:
    if not path.is_file():
        raise PayloadError(f"wheel list {path} not found (give --list PATH: one wheel filename a line)", 2)
    names = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        wheel_requirement(line)  # validates
        names.append(line)
    if not names:
        raise PayloadError(f"wheel list {path} names no wheels", 2)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise PayloadError(f"wheel list {path} names {dup} twice", 2)
    return names


PAYLOAD_DIR = Path(__file__).resolve().parent / "payload"
APPROX_FREEZE = "device-image-freeze.approx.txt"
REAL_FREEZE = "device-image-freeze.txt"


def default_freeze() -> Path | None:
    """The device image's freeze for pack without a list: the real one (`pip list --format=freeze`
    taken on the device in the session of 25174b3) before the approximation, both in lab/payload/."""
    for name in (REAL_FREEZE, APPROX_FREEZE):
        p = PAYLOAD_DIR / name
        if p.is_file():
            return p
    return None


def default_list(release: str) -> Path | None:
    """The wheel list kept for a release (lab/payload/vllm-RELEASE-wheels.txt: the exact set a
    passing device run installed, so a re-pack on a fresh checkout carries the same wheels instead
    of whatever PyPI resolves today); None: pack resolves the release."""
    kept = PAYLOAD_DIR / f"vllm-{release}-wheels.txt"
    return kept if kept.is_file() else None


# ---------------------------------------------------------------------------------------------
# pack (here)

Downloader = Callable[[str, Path], Path]
"""(exact wheel filename, destination dir) -> path of that file in the destination dir."""


def pip_download_args(req: str, dest: Path, platforms: Iterable[str]) -> list[str]:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", PY_VERSION, "--implementation", "cp", "--disable-pip-version-check",
            "--quiet", "-d", str(dest)]
    for p in platforms:
        argv += ["--platform", p]
    return argv + [req]


def pip_downloader(filename: str, dest: Path) -> Path:
    """Download exactly `filename` with pip; retries with newer manylinux tags when pip finds no
    match; refuses a result whose filename differs from the listed one."""
    name, version = wheel_requirement(filename)
    req = f"{name}=={version}"
    own = wheel_platforms(filename)
    # The filename's own tags first (pip expands a manylinux tag to the older ones only, so a
    # newer-glibc build of the same version cannot win), then the usual set, then newer glibcs.
    attempts = ([own] if own else []) + [list(BASE_PLATFORMS)] + [
        list(BASE_PLATFORMS) + [f"manylinux_2_{n}_x86_64"] for n in FALLBACK_GLIBC]
    last = ""
    for platforms in attempts:
        with tempfile.TemporaryDirectory(dir=dest, prefix=".dl-") as tmp:
            r = subprocess.run(pip_download_args(req, Path(tmp), platforms), capture_output=True, text=True)
            got = sorted(os.listdir(tmp))
            if r.returncode == 0 and got == [filename]:
                out = dest / filename
                os.replace(Path(tmp) / filename, out)
                return out
            if r.returncode == 0:
                last = f"pip chose {got} for platforms {platforms}"
            else:
                last = ((r.stderr or r.stdout).strip().splitlines() or ["(no output)"])[-1]
    raise PayloadError(f"pip download {req} gave no {filename} for any platform set tried; last: {last}", 4)


def fetch_wheels(names: list[str], cache: Path, download: Downloader,
                 local_dirs: Iterable[Path] = VLLM_WHEEL_DIRS, log=print) -> list[Path]:
    """Each listed wheel from the cache, a local wheel dir, or the downloader (into the cache)."""
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for i, fn in enumerate(names, 1):
        hit = cache / fn
        src = "cache"
        if not hit.is_file():
            local = next((d / fn for d in local_dirs if (d / fn).is_file()), None)
            if local is not None:
                hit, src = local, f"reused {local.parent}"
            else:
                t0 = time.monotonic()
                hit = download(fn, cache)
                src = f"downloaded in {time.monotonic() - t0:.1f}s"
                if hit.name != fn or not hit.is_file():
                    raise PayloadError(f"downloader returned {hit}, expected {cache / fn}", 4)
        log(f"[{i:3d}/{len(names)}] {fn} ({hit.stat().st_size / MIB:.1f} MiB, {src})", file=sys.stderr)
        out.append(hit)
    return out


class SplitWriter:
    """A write-only stream that cuts what it is given into part-NNN files of at most part_size
    bytes, hashing each part and the whole."""

    def __init__(self, out: Path, part_size: int):
        if part_size <= 0:
            raise PayloadError(f"part size must be positive, got {part_size}", 2)
        self.out, self.part_size = out, part_size
        self.whole = hashlib.sha256()
        self.size = 0
        self.parts: list[dict] = []
        self._f: BinaryIO | None = None
        self._h = None
        self._n = 0

    def _open(self):
        name = f"part-{len(self.parts):03d}"
        self._f = open(self.out / name, "wb")
        self._h = hashlib.sha256()
        self._n = 0
        self.parts.append({"name": name})

    def _close(self):
        if self._f is not None:
            self._f.close()
            self.parts[-1].update(size=self._n, sha256=self._h.hexdigest())
            self._f = None

    def write(self, data) -> int:
        data = memoryview(data)
        total = len(data)
        self.whole.update(data)
        self.size += total
        while len(data):
            if self._f is None or self._n == self.part_size:
                self._close()
                self._open()
            take = min(len(data), self.part_size - self._n)
            self._f.write(data[:take])
            self._h.update(data[:take])
            self._n += take
            data = data[take:]
        return total

    def close(self):
        self._close()


def tree_bytes(root: Path = ROOT) -> int | None:
    """Bytes of what a device call copies: git's tracked and untracked-not-ignored files (the
    device tool's rule). None outside a git checkout or without git."""
    try:
        names = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"],
                               capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((root / n).stat().st_size for n in names.split("\0") if n and (root / n).is_file())


def carry_part_size(tree: int | None) -> int:
    """The largest whole-MiB part that fits one device call beside a tree of `tree` bytes."""
    if tree is None:
        return DEFAULT_PART_SIZE
    size = (CALL_LIMIT - tree - CARRY_HEADROOM) // MIB * MIB
    if size < MIN_PART_SIZE:
        raise PayloadError(f"the working tree is {tree / MIB:.1f} MiB: with {CARRY_HEADROOM / MIB:g} MiB headroom "
                           f"a part would be {max(size, 0) / MIB:g} MiB of the {CALL_LIMIT / MIB:g} MiB a device call "
                           f"carries (at least {MIN_PART_SIZE / MIB:g} needed); move large untracked files "
                           "out of the tree or pass --part-size-mib", 2)
    return size


def pack(release: str, wheels: list[Path], out: Path, part_size: int = DEFAULT_PART_SIZE,
         source: str = "") -> dict:
    """Tar `wheels` (deterministic: sorted, mtime 0, root-owned) into parts under `out` and write
    out/manifest.json; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if PART_RE.match(old.name) or old.name == "manifest.json":
            old.unlink()
    wheels = sorted(wheels, key=lambda p: p.name)
    listed = []
    w = SplitWriter(out, part_size)
    with tarfile.open(fileobj=w, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for p in wheels:
            info = tarfile.TarInfo(f"wheels/{p.name}")
            info.size = p.stat().st_size
            info.mtime, info.mode, info.uid, info.gid = 0, 0o644, 0, 0
            h = hashlib.sha256()
            with open(p, "rb") as f:
                tar.addfile(info, _HashingReader(f, h))
            listed.append({"name": p.name, "size": info.size, "sha256": h.hexdigest()})
    w.close()
    manifest = {
        "format": FORMAT, "release": release, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": PY_VERSION, "source": source, "part_size": part_size,
        "tar": {"size": w.size, "sha256": w.whole.hexdigest()},
        "parts": w.parts, "wheels": listed,
    }
    write_manifest(out / "manifest.json", manifest)
    return manifest


class _HashingReader:
    def __init__(self, f: BinaryIO, h):
        self.f, self.h = f, h

    def read(self, n: int = -1) -> bytes:
        b = self.f.read(n)
        self.h.update(b)
        return b


# pip matches --platform tags literally (only manylinux2014/2010 expand to their legacy aliases),
# so resolving needs every glibc a wheel may be tagged with, up to the device's: nvidia-nccl-cu13
# 2.30.7 exists only as manylinux_2_18. The device's glibc is not measured; 2.35 is the newest tag
# the 0.33.0 list's wheels carry plus margin (they reach manylinux_2_31).
RESOLVE_GLIBC_MAX = 35
RESOLVE_PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(RESOLVE_GLIBC_MAX, 4, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
Runner = Callable[..., "subprocess.CompletedProcess"]


def python_version_of(python: str, run: Runner | None = None) -> str | None:
    """'MAJOR.MINOR' of an interpreter, or None when it does not run."""
    run = run or subprocess.run
    try:
        r = run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def device_python(explicit: str | None = None, run: Runner | None = None) -> str:
    """An interpreter of the device's Python (3.12) to run pip's resolver under: pip evaluates
    environment markers against the interpreter it runs in, not --python-version, so a 3.11 pip
    drops vLLM 0.33.0's `six; python_version > "3.11"` and `setuptools<81; python_version > "3.11"`
    and picks setuptools 84 instead."""
    if explicit:
        got = python_version_of(explicit, run)
        if got != PY_VERSION:
            raise PayloadError(f"--python {explicit} is Python {got or '(does not run)'}; the resolver needs "
                               f"CPython {PY_VERSION} (the device's), e.g. --python python{PY_VERSION}", 2)
        return explicit
    cands = [sys.executable, shutil.which(f"python{PY_VERSION}")] + sorted(
        str(p) for p in (Path.home() / ".pyenv" / "versions").glob(f"{PY_VERSION}*/bin/python"))
    tried = []
    for c in cands:
        if c and c not in tried:
            tried.append(c)
            if python_version_of(c, run) == PY_VERSION:
                return c
    raise PayloadError(f"no CPython {PY_VERSION} found to resolve with (tried {tried}); give --python PATH", 2)


def pip_report_args(python: str, req: str, target: Path, report: Path,
                    platforms: Iterable[str] = RESOLVE_PLATFORMS) -> list[str]:
    """pip's resolver for the device, without installing: `--dry-run --report` (pip 23 takes the
    platform options only with --target); wheels are not downloaded where the index serves their
    metadata (PEP 658, PyPI does)."""
    argv = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
            "--python-version", PY_VERSION, "--implementation", "cp", "--disable-pip-version-check",
            "--quiet", "--target", str(target), "--report", str(report)]
    for p in platforms:
        argv += ["--platform", p]
    return argv + [req]


@dataclass(frozen=True)
class Resolved:
    name: str      # canonical project name
    version: str   # as the wheel's metadata says (what `pip list --format=freeze` would print)
    filename: str  # the wheel pip chose


def resolve(req: str, python: str, run: Runner | None = None) -> list[Resolved]:
    """What pip would install for `req` on the device (CPython 3.12, manylinux x86_64), sorted by name."""
    run = run or subprocess.run
    with tempfile.TemporaryDirectory(prefix="flash-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        r = run(pip_report_args(python, req, Path(tmp) / "target", report), capture_output=True, text=True)
        if r.returncode != 0 or not report.is_file():
            last = ((r.stderr or r.stdout).strip().splitlines() or ["(no output)"])[-3:]
            raise PayloadError(f"pip could not resolve {req} for CPython {PY_VERSION} manylinux x86_64 "
                               f"(rc {r.returncode}): {' | '.join(last)}", 4)
        data = json.loads(report.read_text())
    out = []
    for item in data.get("install", []):
        url = item.get("download_info", {}).get("url", "")
        fn = urllib.parse.unquote(url.split("#", 1)[0].rsplit("/", 1)[-1])
        meta = item.get("metadata", {})
        if not fn.endswith(".whl"):
            raise PayloadError(f"pip resolved {meta.get('name')} {meta.get('version')} to {fn!r}, not a wheel", 4)
        n, _ = wheel_requirement(fn)
        if canon(meta.get("name", "")) != canon(n):
            raise PayloadError(f"pip's report names {meta.get('name')!r} for the wheel {fn}", 4)
        out.append(Resolved(canon(n), meta["version"], fn))
    if not out:
        raise PayloadError(f"pip resolved nothing for {req}", 4)
    return sorted(out, key=lambda x: x.name)


def resolve_release(release: str, exclude: dict[str, str], python: str, run: Runner | None = None) -> list[str]:
    """For a release without a list file: the wheel filenames pip resolves for vllm==RELEASE on
    the device's platform, minus what the device image already has at the same version
    (`exclude`: canonical name -> version, from an image freeze). Nothing is downloaded here."""
    return [r.filename for r in resolve(f"vllm=={release}", python, run) if exclude.get(r.name) != r.version]


def approx_freeze(resolved: list[Resolved], lacking: Iterable[str]) -> list[str]:
    """`name==version` for each resolved package the device did not lack: what the image has, at
    the version the resolver picked (the image's own may be any older one the release accepted).
    `lacking`: wheel filenames measured missing on the device; each must be among the resolved,
    else the two do not describe the same resolution (PayloadError naming them)."""
    lack = {}
    for fn in lacking:
        n, v = wheel_requirement(fn)
        lack[canon(n)] = v
    got = {r.name: r.version for r in resolved}
    stray = sorted(f"{n}=={v} (resolved: {got.get(n, 'absent')})" for n, v in lack.items() if got.get(n) != v)
    if stray:
        raise PayloadError(f"the lacking list names wheels this resolution does not pick: {stray}; "
                           "resolve again or check the list's date", 3)
    return [f"{r.name}=={r.version}" for r in resolved if r.name not in lack]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_freeze(path: Path) -> dict[str, str]:
    out = {}
    if not path.is_file():
        raise PayloadError(f"image freeze {path} not found (give --image-freeze PATH: `pip list --format=freeze` "
                           "output, one name==version a line)", 2)
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line:  # `pip list --format=freeze` prints `name @ file://…` for local installs
            continue
        n, v = line.split("==", 1)
        out[canon(n)] = v.strip()
    if not out:
        raise PayloadError(f"image freeze {path} names no name==version line", 2)
    return out


# ---------------------------------------------------------------------------------------------
# manifest


def write_manifest(path: Path, manifest: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def load_manifest(path: Path) -> dict:
    try:
        m = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PayloadError(f"manifest {path} not found", 2) from None
    except json.JSONDecodeError as e:
        raise PayloadError(f"manifest {path} is not JSON: {e}", 2) from None
    need = ("format", "release", "tar", "parts", "wheels")
    missing = [k for k in need if k not in m]
    if missing or m.get("format") != FORMAT:
        raise PayloadError(f"manifest {path}: missing {missing} or format {m.get('format')!r} != {FORMAT}", 2)
    return m


def payload_key(m: dict) -> str:
    return f"vllm-{m['release']}-{m['tar']['sha256'][:12]}"


# ---------------------------------------------------------------------------------------------
# the store (remote)


@dataclass
class Store:
    root: Path  # the store's top: one sub-directory per payload
    manifest: dict

    @property
    def dir(self) -> Path:
        return self.root / payload_key(self.manifest)

    def part_path(self, name: str) -> Path:
        return self.dir / name

    def have(self) -> list[str]:
        """Parts present whose size matches and whose sha256 was verified on receipt (a
        `.ok` sidecar with that sha256)."""
        out = []
        for p in self.manifest["parts"]:
            f, ok = self.part_path(p["name"]), self.part_path(p["name"] + ".ok")
            if f.is_file() and ok.is_file() and f.stat().st_size == p["size"] \
                    and ok.read_text().strip() == p["sha256"]:
                out.append(p["name"])
        return out

    def missing(self) -> list[str]:
        have = set(self.have())
        return [p["name"] for p in self.manifest["parts"] if p["name"] not in have]

    def status(self) -> dict:
        have, missing = self.have(), self.missing()
        return {"release": self.manifest["release"], "store": str(self.dir),
                "parts": len(self.manifest["parts"]), "have": len(have), "missing": missing,
                "complete": not missing}


def open_store(root: Path, manifest: dict) -> Store:
    s = Store(Path(root), manifest)
    s.dir.mkdir(parents=True, exist_ok=True)
    mpath = s.dir / "manifest.json"
    if mpath.is_file():
        old = load_manifest(mpath)
        if old["tar"]["sha256"] != manifest["tar"]["sha256"]:  # cannot happen: the key holds it
            raise PayloadError(f"store {s.dir} holds another payload's manifest", 3)
    else:
        write_manifest(mpath, manifest)
    return s


def find_manifest(explicit: str | None, parts: list[Path], store_root: Path, release: str | None) -> dict:
    if explicit:
        return load_manifest(Path(explicit))
    for p in parts:
        cand = p.parent / "manifest.json"
        if cand.is_file():
            return load_manifest(cand)
    # A store that holds exactly one payload (of the release, when given) is unambiguous.
    found = sorted(store_root.glob("vllm-*/manifest.json")) if store_root.is_dir() else []
    ms = [load_manifest(f) for f in found]
    if release:
        ms = [m for m in ms if m["release"] == release]
    if len(ms) == 1:
        return ms[0]
    where = ", ".join(str(f) for f in found) or "none"
    raise PayloadError("no manifest: give --manifest PATH or carry manifest.json next to the part "
                       f"(manifests in the store: {where}; --release picks one)", 2)


def receive(parts: list[Path], store_root: Path, manifest: dict, log=print) -> dict:
    s = open_store(store_root, manifest)
    by_name = {p["name"]: p for p in manifest["parts"]}
    for src in parts:
        entry = by_name.get(src.name)
        if entry is None:
            raise PayloadError(f"{src.name} is not a part of the {manifest['release']} payload "
                               f"(parts: part-000..{manifest['parts'][-1]['name']})", 2)
        if not src.is_file():
            if src.name in s.have():
                log(f"{src.name}: already in the store", file=sys.stderr)
                continue
            raise PayloadError(f"{src} not found (was it carried?)", 2)
        size, digest = src.stat().st_size, sha256_file(src)
        if size != entry["size"] or digest != entry["sha256"]:
            raise PayloadError(f"{src.name} is corrupt: {size} bytes sha256 {digest[:16]}…, the manifest "
                               f"says {entry['size']} bytes sha256 {entry['sha256'][:16]}…; carry it again", 3)
        dst = s.part_path(src.name)
        tmp = dst.with_name(dst.name + ".partial")
        shutil.move(str(src), tmp)
        os.replace(tmp, dst)
        (dst.with_name(dst.name + ".ok")).write_text(digest + "\n")
        log(f"{src.name}: verified ({size / MIB:.1f} MiB), stored in {s.dir}", file=sys.stderr)
    return s.status()


def print_status(st: dict, log=print) -> None:
    miss = st["missing"]
    human = "complete" if not miss else f"missing {len(miss)}: {' '.join(miss)}"
    log(f"{st['release']}: {st['have']}/{st['parts']} parts in {st['store']}; {human}")
    log(STATUS_PREFIX + json.dumps(st, sort_keys=True))


# ---------------------------------------------------------------------------------------------
# install (remote)


class ConcatReader:
    """Read the parts back to back as one stream (for tarfile's 'r|' mode)."""

    def __init__(self, paths: list[Path]):
        self._paths = iter(paths)
        self._f: BinaryIO | None = None

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            if self._f is None:
                nxt = next(self._paths, None)
                if nxt is None:
                    break
                self._f = open(nxt, "rb")
            b = self._f.read(-1 if n < 0 else n - len(out))
            if not b:
                self._f.close()
                self._f = None
                continue
            out += b
        return bytes(out)


def verify_complete(s: Store) -> list[Path]:
    """Every part present, and the assembled tar's sha256 equals the manifest's; else PayloadError
    naming what is missing or which part is bad."""
    missing = s.missing()
    if missing:
        raise PayloadError(f"payload {s.dir} incomplete: missing {len(missing)} of "
                           f"{len(s.manifest['parts'])} parts ({' '.join(missing)}); receive them first", 3)
    paths = [s.part_path(p["name"]) for p in s.manifest["parts"]]
    h, size = hashlib.sha256(), 0
    r = ConcatReader(paths)
    while b := r.read(4 * MIB):
        h.update(b)
        size += len(b)
    if h.hexdigest() != s.manifest["tar"]["sha256"] or size != s.manifest["tar"]["size"]:
        bad = [p["name"] for p in s.manifest["parts"] if sha256_file(s.part_path(p["name"])) != p["sha256"]]
        for name in bad:  # forget them, so `receive` asks for them again
            s.part_path(name + ".ok").unlink(missing_ok=True)
        raise PayloadError(f"assembled payload sha256 {h.hexdigest()[:16]}… != manifest "
                           f"{s.manifest['tar']['sha256'][:16]}…; bad parts: {bad or 'none found'}", 3)
    return paths


def env_lines(prefix: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{prefix}:{prefix}/nvidia_cutlass_dsl/dsl_packages",
            "VLLM_USE_FLASHINFER_SAMPLER": "0", "PATH_PREPEND": f"{prefix}/bin"}


def write_env_sh(prefix: Path) -> Path:
    e = env_lines(prefix)
    text = ("# written by lab/device_payload.py install: source this before `vllm serve`\n"
            f'export PYTHONPATH="{e["PYTHONPATH"]}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
            f'export PATH="{e["PATH_PREPEND"]}:$PATH"\n'
            "# no FlashInfer sampler cubins offline\n"
            "export VLLM_USE_FLASHINFER_SAMPLER=0\n")
    p = prefix / "env.sh"
    p.write_text(text)
    return p


def prefix_env(prefix: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    e = env_lines(prefix)
    env["PYTHONPATH"] = e["PYTHONPATH"] + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = e["PATH_PREPEND"] + ":" + env.get("PATH", "")
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


VERSIONS_CODE = r"""
import importlib, json, sys
out = {}
for mod in sys.argv[1:]:
    try:
        m = importlib.import_module(mod)
        out[mod] = {"version": getattr(m, "__version__", "?"), "file": getattr(m, "__file__", None)}
        if mod == "torch":
            out[mod]["cuda"] = m.version.cuda
            out[mod]["cuda_available"] = m.cuda.is_available()
    except Exception as e:
        out[mod] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


# The parsers the recipe's `vllm serve` loads lazily at boot (--reasoning-parser qwen3,
# --tool-call-parser qwen3_coder): their imports reach packages no top-level import does
# (H200, twice: qwen3's parser imports mistral_common's language codes, which need pycountry).
# The tool parsers the profiles name (TOOL_PARSER; tests/unit/test_device_payload.py keeps this in step).
TOOL_PARSERS = ("qwen3_coder", "qwen3_xml")
PARSERS_CODE = r"""
import importlib
try:
    from vllm.reasoning import ReasoningParserManager
    ReasoningParserManager.get_reasoning_parser("qwen3")
    for where in ("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers"):
        try:
            mod = importlib.import_module(where)
        except ImportError:
            continue
        for name in TOOL_PARSERS:
            mod.ToolParserManager.get_tool_parser(name)
        break
except Exception as e:
    raise SystemExit(f"{type(e).__name__}: {e}")
"""


def parsers_problem(prefix: Path, timeout: float = 300) -> str | None:
    """None when the recipe's reasoning and tool parsers load from the prefix, else why not."""
    r = subprocess.run([sys.executable, "-c", f"TOOL_PARSERS = {TOOL_PARSERS!r}\n" + PARSERS_CODE], env=prefix_env(prefix), capture_output=True, text=True,
                       timeout=timeout)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["(no message)"])[-1][-600:]


def imported_versions(prefix: Path, modules: Iterable[str] = VERSION_MODULES, timeout: float = 300) -> dict:
    r = subprocess.run([sys.executable, "-c", VERSIONS_CODE, *modules], env=prefix_env(prefix),
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not r.stdout.strip():
        raise PayloadError(f"importing from {prefix} failed (rc {r.returncode}): {r.stderr.strip()[-800:]}", 4)
    return json.loads(r.stdout.strip().splitlines()[-1])


MARKER = ".flash-payload.json"


def installed_marker(prefix: Path) -> dict | None:
    try:
        return json.loads((prefix / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def install(s: Store, prefix: Path, pip: list[str] | None = None, log=print) -> dict:
    """Install the complete payload into `prefix` (built in PREFIX.partial, renamed into place
    when pip succeeded); a prefix already holding this payload is left as it is."""
    m = s.manifest
    mark = installed_marker(prefix)
    if mark and mark.get("tar_sha256") == m["tar"]["sha256"]:
        log(f"{prefix} already holds the {m['release']} payload (installed {mark.get('installed')})",
            file=sys.stderr)
        return mark
    paths = verify_complete(s)
    t0 = time.monotonic()
    partial = prefix.with_name(prefix.name + ".partial")
    unpack = prefix.with_name(prefix.name + ".wheels")
    for d in (partial, unpack):
        shutil.rmtree(d, ignore_errors=True)
    unpack.mkdir(parents=True)
    with tarfile.open(fileobj=ConcatReader(paths), mode="r|") as tar:
        for member in tar:
            if not member.isfile() or not member.name.startswith("wheels/") or "/" in member.name[7:] \
                    or not member.name.endswith(".whl"):
                raise PayloadError(f"unexpected tar member {member.name!r}", 3)
            with open(unpack / member.name[7:], "wb") as f:
                shutil.copyfileobj(tar.extractfile(member), f)
    wheels = sorted(str(p) for p in unpack.glob("*.whl"))
    if sorted(Path(w).name for w in wheels) != sorted(w["name"] for w in m["wheels"]):
        raise PayloadError("the tar's wheels differ from the manifest's list", 3)
    t_untar = time.monotonic() - t0
    argv = (pip or [sys.executable, "-m", "pip"]) + [
        "install", "--no-index", "--no-deps", "--no-compile", "--disable-pip-version-check",
        "--quiet", "--target", str(partial), *wheels]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise PayloadError(f"pip install failed (rc {r.returncode}): {r.stderr.strip()[-1500:]}", 4)
    t_pip = time.monotonic() - t0 - t_untar
    if prefix.exists():
        shutil.rmtree(prefix)
    os.replace(partial, prefix)
    shutil.rmtree(unpack, ignore_errors=True)
    write_env_sh(prefix)
    mark = {"release": m["release"], "tar_sha256": m["tar"]["sha256"], "wheels": len(wheels),
            "installed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "untar_s": round(t_untar, 1), "pip_s": round(t_pip, 1)}
    (prefix / MARKER).write_text(json.dumps(mark, indent=1) + "\n")
    log(f"installed {len(wheels)} wheels into {prefix}: untar {t_untar:.1f}s, pip {t_pip:.1f}s",
        file=sys.stderr)
    return mark


# ---------------------------------------------------------------------------------------------
# CLI


def _err(*a, **k):
    print(*a, file=sys.stderr, **{x: y for x, y in k.items() if x != "file"})


def cmd_pack(a) -> int:
    # the part size first: a tree too big to carry beside any part fails before a download
    if a.part_size_mib is None:
        tree = tree_bytes()
        part_size = carry_part_size(tree)
        print(f"part size {part_size / MIB:g} MiB: " + (
            f"{CALL_LIMIT / MIB:g} MiB a call - the {tree / MIB:.1f} MiB tree - {CARRY_HEADROOM / MIB:g} MiB headroom"
            if tree is not None else "no git checkout to measure the tree by"))
        a.part_size_mib = part_size / MIB
    elif a.part_size_mib <= 0:
        raise PayloadError(f"--part-size-mib {a.part_size_mib:g}: give a positive size in MiB", 2)
    cache = Path(a.cache)
    if a.list:
        lst = Path(a.list)
        names = read_list(lst)
        source = f"list {lst.name}"
    else:
        lst = default_list(a.release)
        if lst is not None:
            names, source = read_list(lst), f"list {lst.name}"
        else:
            freeze = Path(a.image_freeze) if a.image_freeze else default_freeze()
            exclude = read_freeze(freeze) if freeze else {}
            python = device_python(a.python)
            _err(f"no wheel list for {a.release}: resolving vllm=={a.release} with {python} -m pip, "
                 + (f"minus {len(exclude)} image packages of {freeze}" if freeze
                    else "no --image-freeze and no lab/payload/" + APPROX_FREEZE + ": nothing excluded"))
            names = resolve_release(a.release, exclude, python)
            source = "pip resolver" + (f" minus {freeze.name}" if freeze else "")
    extra = add_extra(names, a.release, a.extra_list)
    if extra:
        source += f" + {extra.name}"
    vllm = [n for n in names if canon(wheel_requirement(n)[0]) == "vllm"]
    if not vllm:  # the release's own wheel rides along unless the list already holds it
        local = sorted(n.name for d in VLLM_WHEEL_DIRS for n in d.glob(f"vllm-{a.release}-*.whl"))
        names.append(local[0] if local else f"vllm-{a.release}-cp38-abi3-manylinux_2_28_x86_64.whl")
    elif wheel_requirement(vllm[0])[1] != a.release:
        raise PayloadError(f"the list names {vllm[0]}, not vllm {a.release}", 2)
    wheels = fetch_wheels(names, cache, pip_downloader, local_dirs=VLLM_WHEEL_DIRS, log=print)
    out = Path(a.out or f".payload/vllm-{a.release}")
    t0 = time.monotonic()
    m = pack(a.release, wheels, out, int(a.part_size_mib * MIB), source=source)
    (out / "wheels.txt").write_text("".join(w["name"] + "\n" for w in m["wheels"]))
    print(f"packed {len(m['wheels'])} wheels, {m['tar']['size'] / MIB:.0f} MiB, into {len(m['parts'])} "
          f"parts of <= {a.part_size_mib:g} MiB under {out} in {time.monotonic() - t0:.1f}s; "
          f"tar sha256 {m['tar']['sha256']}")
    print(f"parts: {len(m['parts'])}")
    return 0


def add_extra(names: list[str], release: str, explicit: str | None) -> Path | None:
    """Append (in place, once each) the release's extra wheels: what real boots on the device found
    missing beyond the kept list (`explicit`, else lab/payload/vllm-RELEASE-extra.txt when
    present). Returns the file read, or None."""
    extra = Path(explicit) if explicit else PAYLOAD_DIR / f"vllm-{release}-extra.txt"
    if not extra.is_file():
        return None
    names += [n for n in read_list(extra) if n not in names]
    return extra


def cmd_image_freeze(a) -> int:
    lst = Path(a.list) if a.list else default_list(a.release)
    if lst is None:
        raise PayloadError(f"no wheel list for {a.release} (give --list: the wheels the device lacked)", 2)
    lacking = read_list(lst)
    extra = add_extra(lacking, a.release, a.extra_list)
    python = device_python(a.python)
    pip_v = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[:2]
    py_v = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True).stdout.strip()
    resolved = resolve(f"vllm=={a.release}", python)
    lines = approx_freeze(resolved, lacking)
    header = [
        "APPROXIMATE device image freeze: derived here, NOT measured on the device. Replace it with the",
        "device's real `python3 -m pip list --format=freeze` when a session can run one.",
        f"Derived {time.strftime('%Y-%m-%d', time.gmtime())} by `lab/device_payload.py image-freeze "
        f"--release {a.release}`: {' '.join(pip_v)} under CPython {py_v} resolved",
        f"vllm=={a.release} for cp{PY_VERSION.replace('.', '')} manylinux_2_5..2_{RESOLVE_GLIBC_MAX} x86_64 "
        f"(`pip install --dry-run --report`, nothing installed): {len(resolved)} packages,",
        f"minus the {len(lacking)} wheels the device lacked ({lst.name}"
        + (f" + {extra.name}" if extra else "") + f") = {len(lines)} packages.",
        f"So: what the image has among what vLLM {a.release} needs, each at the version pip picked that day;",
        f"the image's own may be older (any that vLLM {a.release} accepted). Packages vLLM does not need are absent.",
        *a.note,
    ]
    text = "".join(f"# {h}\n" for h in header) + "".join(x + "\n" for x in lines)
    if a.out == "-":
        sys.stdout.write(text)
    else:
        out = Path(a.out or PAYLOAD_DIR / APPROX_FREEZE)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out)
        print(f"wrote {out}: {len(lines)} packages ({len(resolved)} resolved - {len(lacking)} lacking)")
    return 0


def cmd_receive(a) -> int:
    parts = [Path(p) for p in a.parts]
    m = find_manifest(a.manifest, parts, Path(a.store), a.release)
    st = receive(parts, Path(a.store), m, log=print)
    print_status(st)
    return 0


def cmd_install(a) -> int:
    m = find_manifest(a.manifest, [], Path(a.store), a.release)
    prefix = Path(a.prefix or f"/var/tmp/flash-vllm-{m['release']}")
    s = open_store(Path(a.store), m)
    mark = install(s, prefix, log=print)
    versions = imported_versions(prefix)
    print(f"prefix {prefix} ({mark['wheels']} wheels); source {prefix / 'env.sh'}")
    for mod, v in versions.items():
        print(f"  {mod:11s} {v.get('version', '-'):24s} {v.get('error') or v.get('file')}"
              + (f"  cuda {v['cuda']} available={v['cuda_available']}" if "cuda" in v else ""))
    print(STATUS_PREFIX + json.dumps({"prefix": str(prefix), "versions": versions, **mark}, sort_keys=True))
    bad = [mod for mod, v in versions.items() if "error" in v]
    if bad:
        raise PayloadError(f"installed, but {bad} do not import from {prefix}", 4)
    problem = parsers_problem(prefix)
    if problem:
        raise PayloadError(f"installed, but the recipe's parsers (reasoning qwen3, tool {', '.join(TOOL_PARSERS)}) do not load "
                           f"from {prefix}: {problem} (add the missing wheel to lab/payload/vllm-"
                           f"{m['release']}-extra.txt and pack again)", 4)
    print(f"  parsers    qwen3 (reasoning), {', '.join(TOOL_PARSERS)} (tool): load")
    return 0


def cmd_status(a) -> int:
    root = Path(a.store)
    found = sorted(root.glob("vllm-*/manifest.json")) if root.is_dir() else []
    if not found:
        print(f"store {root}: empty")
    for f in found:
        print_status(Store(root, load_manifest(f)).status())
    prefixes = [Path(a.prefix)] if a.prefix else sorted(Path("/var/tmp").glob("flash-vllm-*"))
    for p in prefixes:
        mark = installed_marker(p)
        if mark:
            print(f"prefix {p}: vllm {mark['release']} installed {mark['installed']} ({mark['wheels']} wheels)")
        elif p.exists():
            print(f"prefix {p}: present but not a finished install")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m lab.device_payload", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="download, tar and split a release's wheels (here)")
    p.add_argument("--release", required=True, help="vLLM release, e.g. 0.33.0")
    p.add_argument("--list", help="file of exact wheel filenames (default: lab/payload/vllm-RELEASE-wheels.txt; "
                                  "without one, pip resolves vllm==RELEASE)")
    p.add_argument("--image-freeze", help="without a list: the device's `pip list --format=freeze`, whose "
                                          "exact name==version pairs are left out (default: "
                                          f"lab/payload/{REAL_FREEZE} (measured), else "
                                          f"lab/payload/{APPROX_FREEZE})")
    p.add_argument("--python", help=f"a CPython {PY_VERSION} to run pip's resolver under (default: this one, "
                                    f"python{PY_VERSION} on PATH, or ~/.pyenv/versions/{PY_VERSION}*)")
    p.add_argument("--out", help="output dir (default .payload/vllm-RELEASE)")
    p.add_argument("--part-size-mib", type=float, default=None,
                   help=f"default: what fits one device call ({CALL_LIMIT // MIB} MiB) beside this checkout's "
                        f"tree, less {CARRY_HEADROOM // MIB} MiB headroom")
    p.add_argument("--extra-list", help="more wheel filenames (default: lab/payload/vllm-RELEASE-extra.txt when present)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="wheel download cache")
    p.set_defaults(func=cmd_pack)
    p = sub.add_parser("image-freeze", help="approximate the device image's freeze: a release's resolution "
                                            "minus the wheels the device lacked (here)")
    p.add_argument("--release", required=True, help="the release whose lacking list was measured, e.g. 0.33.0")
    p.add_argument("--list", help="wheels the device lacked (default: lab/payload/vllm-RELEASE-wheels.txt)")
    p.add_argument("--extra-list", help="more lacking wheels (default: lab/payload/vllm-RELEASE-extra.txt when present)")
    p.add_argument("--python", help=f"a CPython {PY_VERSION} to run pip's resolver under")
    p.add_argument("--note", action="append", default=[], help="a header comment line to add (repeatable)")
    p.add_argument("--out", help=f"output file, '-' for stdout (default lab/payload/{APPROX_FREEZE})")
    p.set_defaults(func=cmd_image_freeze)
    for name, func, hlp in (("receive", cmd_receive, "verify a carried part and move it into the store (remote)"),
                            ("install", cmd_install, "assemble, verify and install a complete payload (remote)"),
                            ("status", cmd_status, "what the store and prefixes hold")):
        p = sub.add_parser(name, help=hlp)
        if name == "receive":
            p.add_argument("parts", nargs="*", help="carried part file(s); none: just stage the manifest/report")
        p.add_argument("--store", default=DEFAULT_STORE)
        if name != "status":
            p.add_argument("--manifest", help="manifest.json (default: next to the part, else the store's)")
            p.add_argument("--release", help="pick the store's payload of this release")
        if name != "receive":
            p.add_argument("--prefix", help="install dir (default /var/tmp/flash-vllm-RELEASE)")
        p.set_defaults(func=func)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except PayloadError as e:
        print(f"device_payload: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
