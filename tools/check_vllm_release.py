#!/usr/bin/env python3
"""Check every flash_vllm patch against a vLLM release from PyPI, on this CPU-only machine.

    tools/check_vllm_release.py X.Y.Z [--json]       check one release, print the matrix
    tools/check_vllm_release.py X.Y.Z --propose      print the release-catalogue entry it needs
    tools/check_vllm_release.py --setup X.Y.Z ...    only build/reuse the environments (tier hook)

`--propose` reads the release's wheel (no venv, no import): its torch pin, and each capability of
`flash_common.releases.CAPS` from the source markers in `PROBES`; a capability no marker tells is
copied from the newest catalogued release and flagged in the output, for the reviewer.

For a release it fetches the wheel from PyPI (cached), installs it `--no-deps` into its own
directory beside a shared venv per torch pin (CPU torch plus the minimum of vLLM's dependencies
that the patched modules import), then runs `python -m flash_vllm.selfcheck --json` there:
every patch meant for the release must apply, be idempotent and rebind its targets; "upstream"
patches must find the fix in the release's source. A release newer than the newest base is
checked against the newest base's expectations (that is how a new release is verified the day
it appears). Exit status 1 when a patch meant for the release is broken, 2 on setup errors.
The last line of `--json` output is one JSON object: {"release", "patches": [{"number", "name",
"status"}, ...], ...}.

Cache: $FLASH_TEST_CACHE/vllm (default ~/.cache/flash-tests/vllm): wheels/, venv-torch-*/,
site-X.Y.Z/, shim/. Everything is built in a temporary sibling and renamed into place, so an
interrupted run leaves nothing half-built behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

# CPU venvs per torch pin. 0.29-0.32 pin torch==2.13.0, which a 2.13.0+cpu wheel satisfies;
# 0.33 pins 2.14.0, of which only the CUDA build exists: 2.14.1 (same ABI line) resolves here.
TORCH_FOR_PIN = {"2.14.0": "2.14.1"}
# What the patched modules import on CPU (found by importing them; vLLM's own Requires-Dist minus
# CUDA-only packages). transformers 5.17.0 satisfies every supported release's range.
DEPS = [
    "numpy==2.3.5", "transformers==5.17.0", "huggingface_hub==1.33.0", "tokenizers==0.23.3",
    "safetensors==0.8.0", "pydantic==2.14.4", "cachetools==8.0.2", "psutil==7.2.2",
    "msgspec==0.23.0", "pyzmq==27.3.0", "cloudpickle==3.1.3", "blake3==1.0.11",
    "py-cpuinfo==9.0.0", "prometheus_client==0.26.0", "openai==3.57.0", "fastapi==0.165.0",
    "aiohttp==3.14.5", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0", "einops==0.8.2",
    "pybase64==1.5.1", "cbor2==6.3.0", "ijson==3.6.0", "setproctitle==1.3.8",
    "python-json-logger==4.2.0", "jsonschema==4.26.0", "sentencepiece==0.2.3", "tiktoken==0.14.0",
    "regex==2026.11.19", "protobuf==7.36.2", "PyYAML==6.0.4", "openai-harmony==0.0.8",
    "uvloop==0.23.0", "llguidance==1.7.6", "loguru==0.7.3", "mistral_common==1.13.1",
    "pytest==9.2.0",
]
# Installed without their dependencies: each would pull CUDA packages or a second triton.
NO_DEPS = ["compressed-tensors==0.17.0", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11"]
TRITON = "triton==3.8.0"  # real autotuner objects for patch 2 (torch 2.14.1 brings its own)

# torchvision's PyPI build needs CUDA torch; vLLM only imports it for vision models. The test
# harness answers `import torchvision` with a stub module (never used by any patched code path).
SHIM = '''"""Test-harness shim for the CPU venvs of tools/check_vllm_release.py (never in an image).

torchvision's PyPI wheel needs a CUDA torch; vLLM's qwen4_exp imports it only through the vision
tower. A stub module answers the import; no patched code path uses it.
"""
import importlib.abc
import importlib.machinery
import sys
from unittest import mock


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__path__, m.__spec__, m.__name__, m.__version__ = [], spec, spec.name, "0.0+stub"
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _TorchvisionStub())
'''


def say(msg: str) -> None:
    print(f"check_vllm_release: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    base = os.environ.get("FLASH_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flash-tests")
    return Path(base) / "vllm"


def run(argv: list[str], **kw) -> None:
    subprocess.run(argv, check=True, **kw)


def pip(python: Path, *args: str) -> None:
    run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args])


def fetch_wheel(version: str, cache: Path) -> Path:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    tmp = wheels / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    t = time.monotonic()
    say(f"downloading vllm=={version} from PyPI")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
         "--python-version", "3.11", "-d", str(tmp), f"vllm=={version}"])
    got = sorted(tmp.glob(f"vllm-{version}-*.whl"))
    if not got:
        raise SystemExit(f"check_vllm_release: no wheel for vllm=={version}")
    dest = wheels / got[0].name
    os.replace(got[0], dest)
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"  {dest.name} ({dest.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - t:.0f}s")
    return dest


def torch_pin(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    m = re.search(r"^Requires-Dist: torch==([\w.+]+)\s*$", text, re.M)
    if not m:
        raise SystemExit(f"check_vllm_release: {wheel.name} has no torch==X pin")
    return m.group(1)


def ensure_venv(torch_version: str, cache: Path) -> Path:
    venv = cache / f"venv-torch-{torch_version}"
    if (venv / ".complete").exists():
        return venv
    tmp = cache / f".tmp-venv-{torch_version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.monotonic()
    say(f"building {venv.name} (CPU torch + minimum deps)")
    run([sys.executable, "-m", "venv", str(tmp)])
    py = tmp / "bin" / "python"
    pip(py, f"torch=={torch_version}", *DEPS)
    pip(py, "--no-deps", *NO_DEPS)
    probe = subprocess.run([str(py), "-c", "import triton"], capture_output=True)
    if probe.returncode != 0:
        pip(py, "--no-deps", TRITON)
    (tmp / ".complete").write_text(f"torch=={torch_version}\n" + "\n".join(DEPS + NO_DEPS) + "\n")
    shutil.rmtree(venv, ignore_errors=True)
    os.replace(tmp, venv)
    say(f"  {venv.name} ready in {time.monotonic() - t:.0f}s")
    return venv


def ensure_site(version: str, wheel: Path, cache: Path) -> Path:
    """The release, --no-deps, in its own directory: the wheel's payload minus compiled extensions.

    The CUDA extensions (`*.so`, ~70% of the wheel) cannot load without a GPU driver (vLLM then
    logs "Failed to import from vllm._C" either way), so they are not unpacked; every Python
    module, template and data file is, with the dist-info (version and entry points).
    """
    site = cache / f"site-{version}"
    if (site / ".complete").exists():
        return site
    tmp = cache / f".tmp-site-{version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.monotonic()
    skipped = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if re.search(r"\.so(\.\d+)*$", info.filename):
                skipped += info.file_size
                continue
            z.extract(info, tmp)
    (tmp / ".complete").write_text(f"{wheel.name}\nskipped compiled extensions: {skipped} bytes\n")
    shutil.rmtree(site, ignore_errors=True)
    os.replace(tmp, site)
    say(f"  site-{version} installed in {time.monotonic() - t:.0f}s")
    return site


def ensure_shim(cache: Path) -> Path:
    shim = cache / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    f = shim / "sitecustomize.py"
    if not f.exists() or f.read_text() != SHIM:
        tmp = f.with_suffix(".tmp")
        tmp.write_text(SHIM)
        os.replace(tmp, f)
    return shim


def ensure(version: str) -> dict:
    """Build or reuse everything a release needs; returns {python, env} to run code there."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    wheel = fetch_wheel(version, cache)
    pin = torch_pin(wheel)
    venv = ensure_venv(TORCH_FOR_PIN.get(pin, pin), cache)
    site = ensure_site(version, wheel, cache)
    shim = ensure_shim(cache)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASH_VLLM_BASE", "VLLM_"))}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(shim), str(SRC), str(site)]),
        # With triton installed and no GPU, vLLM keeps triton enabled only in this
        # "distributed init" case; the kernels are never launched here.
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONDONTWRITEBYTECODE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    })
    return {"python": str(venv / "bin" / "python"), "env": env, "torch_pin": pin}


def setup(versions: list[str]) -> None:
    """Wheels first, then the (independent) torch venvs side by side, then each release."""
    from concurrent.futures import ThreadPoolExecutor

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    pins = {TORCH_FOR_PIN.get(p, p) for p in (torch_pin(fetch_wheel(v, cache)) for v in versions)}
    with ThreadPoolExecutor(max_workers=len(pins)) as pool:
        list(pool.map(lambda tv: ensure_venv(tv, cache), sorted(pins)))
    for v in versions:
        ensure(v)
    say(f"{len(versions)} release(s) ready in {time.monotonic() - t:.0f}s")


# --- --propose: the catalogue entry from the release's own source ------------------------------

def _qsa_fp8_native(read) -> bool:
    src = read("vllm/models/qwen4_exp/nvidia/qsa.py") or ""
    i = src.find("supported_kv_cache_dtypes")
    return i >= 0 and "fp8_e4m3" in src[i:src.find("]", i) + 1]


def _ple_storage(read, names) -> str | None:
    """Patch 1's targets (p01_ple_mmap.PINNED; its v029.STORAGE and IDS_OP), as names in the modules."""
    ngram = read("vllm/models/qwen4_exp/nvidia/ngram_embedding.py") or ""
    if "Qwen4ExpPLEPinnedHostEmbedding" in ngram and "vllm/compilation/breakable_cudagraph.py" in names:
        return "storage"
    layer = read("vllm/models/qwen4_exp/nvidia/ple_layer.py") or ""
    if "PLEVocabParallelEmbedding" in layer and "qwen4_exp_compute_ple_ngram_ids" in layer:
        return "splitting-op"
    return None


def _qsa_logits_workspace(read) -> str:
    """How the QSA top-k sizes its logits (flash_cli/plan/workspace.py): the prefill selection allocates
    its cap whole (`budget_bytes = max(max_logits_bytes, ...)`, 0.31+), chunks by the cap (0.30), or
    0.29's qsa_select_paged_tokens chunks by `_LOGITS_WORKSPACE_BYTES`."""
    indexer = read("vllm/models/qwen4_exp/nvidia/ops/qsa_indexer.py") or ""
    if "budget_bytes = max(max_logits_bytes" in indexer:
        return "worst-case-env"
    if "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB" in indexer:
        return "chunks-env"
    if "_LOGITS_WORKSPACE_BYTES = 128 * 1024 * 1024" in (read("vllm/models/qwen4_exp/nvidia/ops/qsa.py") or ""):
        return "chunks-128"
    return "worst-case-env"  # neither marker: the largest, until the release's code is read


# capability -> probe(read, names) -> value; read(path) is the text of a file in the wheel or None.
PROBES = {
    "ple_storage": _ple_storage,
    "dockerfile": lambda read, names: "Dockerfile.v0.29" if _ple_storage(read, names) == "splitting-op" else "Dockerfile",
    "qsa_fp8_kv": lambda read, names: "native" if _qsa_fp8_native(read) else None,
    "reasoning_effort_map": lambda read, names: "effort_map.get(effort, effort)" in (read("vllm/renderers/params.py") or ""),
    "mamba_prefill_checkpoints": lambda read, names: "def get_mamba_prefill_checkpoint_alignment" in (
        read("vllm/model_executor/layers/mamba/abstract.py") or ""),
    "spec_tokens_per_batch_size": lambda read, names: "num_speculative_tokens_per_batch_size:" in (
        read("vllm/config/speculative.py") or ""),
    "spec_eagle_block_drop_flag": lambda read, names: "disable_eagle_block_drop:" in (
        read("vllm/config/speculative.py") or ""),
    # patch 1's hoisted mode hooks the V2 runner's model state (p01_ple_mmap/hoist.py PREPARE) on the storage flavour
    "ple_hoisted": lambda read, names: _ple_storage(read, names) == "storage" and "def prepare_inputs" in (
        read("vllm/models/qwen4_exp/nvidia/model_state.py") or ""),
    # 0.30+ resolve the PLE table's FP8 through ModelOpt's per-layer quant_algo; 0.29 only under Fp8Config
    "ple_fp8_modelopt": lambda read, names: any("ModelOptMixedPrecisionConfig" in (read(f"vllm/models/qwen4_exp/{d}/"
                                                                                          "ngram_embedding.py") or "")
                                                for d in ("nvidia", "common")),
    # EngineCore._initialize_kv_caches: min over the groups that take part in prefix caching (0.30+)
    # or over every group (0.29: the QSA ring's block)
    "block_size_prefix_groups": lambda read, names: ((read("vllm/v1/engine/core.py") or "").split(
        "cache_config.block_size = min(", 1) + [""])[1].split()[:1] == ["participating"],
    # Scheduler.__init__ reads vllm_config.num_hash_lookahead_tokens (and then needs no drafter block drop)
    "mtp_hash_lookahead": lambda read, names: "self.num_hash_lookahead_tokens = vllm_config.num_hash_lookahead_tokens" in (
        read("vllm/v1/core/sched/scheduler.py") or ""),
    "overhead_fitted": lambda read, names: False,  # a new release has not been calibrated on hardware
    "qsa_logits_workspace": lambda read, names: _qsa_logits_workspace(read),
    # the QSA block top-k that patches 5 and 8 hook (p05_qsa_exact_topk/hook.py's targets)
    "qsa_topk_site": lambda read, names: (
        "indexer" if "def _topk(" in (read("vllm/models/qwen4_exp/nvidia/ops/qsa_indexer.py") or "")
        else "select-paged-tokens" if "def qsa_select_paged_tokens(" in (read("vllm/models/qwen4_exp/nvidia/ops/qsa.py")
                                                                          or "") else None),
}
NOT_FROM_SOURCE = {"overhead_fitted": "not calibrated on this release",
                   "ring_state_bucket": "no source marker: copied from the newest catalogued release"}


def propose_from(version: str, torch: str, read, names: set[str]) -> tuple[dict, str]:
    """(capabilities, the catalogue entry as Python) for a release, from its wheel's files."""
    from flash_common import releases

    newest = releases.get(releases.NEWEST)
    caps = {name: (PROBES[name](read, names) if name in PROBES else newest.caps[name]) for name in releases.CAPS}
    if caps["qsa_fp8_kv"] is None and version in {r.version for r in releases.RELEASES}:
        caps["qsa_fp8_kv"] = releases.by_version(version).caps["qsa_fp8_kv"]  # "patch": ours, not the source's
    args = ", ".join(f"{k}={v!r}" for k, v in caps.items())
    notes = "".join(f"\n    # {k}: {why}" for k, why in NOT_FROM_SOURCE.items())
    if caps["qsa_fp8_kv"] is None:
        notes += "\n    # qsa_fp8_kv: not native; patch 7 ships code for its ported releases only (port it, or leave None)"
    if caps["ple_storage"] is None:
        notes += "\n    # ple_storage: neither layout patch 1 knows: port patch 1 before serving this release"
    return caps, f'    _release("{version}", "{torch}", {args}),{notes}'


def propose(version: str) -> dict:
    cache = cache_dir()
    wheel = fetch_wheel(version, cache)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())

        def read(path: str) -> str | None:
            return z.read(path).decode(errors="replace") if path in names else None

        caps, entry = propose_from(version, torch_pin(wheel), read, names)
    return {"release": version, "torch": torch_pin(wheel), "caps": caps, "entry": entry}


def check(version: str) -> dict:
    from flash_vllm import compat

    base = compat.base_for_release(version)
    rt = ensure(version)
    argv = [rt["python"], "-m", "flash_vllm.selfcheck", "--json"]
    if compat.line_of(version) != base:
        argv += ["--assume-base", base]
    proc = subprocess.run(argv, env=rt["env"], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"check_vllm_release: selfcheck produced no result (exit {proc.returncode})")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("versions", nargs="+", metavar="X.Y.Z")
    ap.add_argument("--json", action="store_true", help="end with one JSON object")
    ap.add_argument("--setup", action="store_true", help="only build/reuse the environments")
    ap.add_argument("--propose", action="store_true",
                    help="print the flash_common.releases entry this release needs (from its wheel)")
    args = ap.parse_args(argv)
    bad = [v for v in args.versions if not re.fullmatch(r"\d+\.\d+\.\d+", v)]
    if bad:
        ap.error(f"not a release version: {', '.join(bad)} (expected X.Y.Z, e.g. 0.33.0)")
    try:
        if args.setup:
            setup(args.versions)
            return 0
        if len(args.versions) != 1:
            ap.error("check one release at a time (or use --setup)")
        if args.propose:
            proposal = propose(args.versions[0])
            print(json.dumps(proposal) if args.json else
                  "# add to RELEASES in src/flash_common/releases.py (oldest first), then run\n"
                  "# tools/gen_patches_doc.py, tools/gen_settings_doc.py and this tool without --propose:\n"
                  + proposal["entry"])
            return 0
        result = check(args.versions[0])
    except subprocess.CalledProcessError as e:
        say(f"setup failed: {' '.join(map(str, e.cmd))} exited {e.returncode}")
        return 2
    key = result.get("compile_key") or {"status": "broken", "detail": "selfcheck reported no compile_key"}
    broken = [p for p in result["patches"] if p["status"] == "broken"] + ([key] if key["status"] == "broken" else [])
    if args.json:
        print(json.dumps(result))
    else:
        print(f"vLLM {result['release']} (checked as {result['base']}"
              f"{', provisional' if result.get('provisional') else ''})")
        for p in result["patches"]:
            print(f"  {p['number']:>2} {p['name']:<22} {p['status']:<11} {p.get('detail', '')}")
        print(f"   - {'compile-cache key':<22} {key['status']:<11} {key['detail']}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
