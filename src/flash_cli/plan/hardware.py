"""Hardware the plan is made for: presets, and detection from /proc/meminfo + nvidia-smi.

On a unified-memory GB10 the GPU budget and the host (OS, Docker, page cache for the PLE table)
share one pool. vLLM reads the device total from cudaMemGetInfo (121.69 GiB on a Spark) but, on
an integrated GPU, the *free* memory from psutil's MemAvailable
(`vllm/utils/mem_utils.py::MemorySnapshot.measure`, `is_integrated_gpu`); nvidia-smi reports no
memory total on GB10 ("[N/A]"), so detection takes the pool from /proc/meminfo.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UsageError

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    name: str
    desc: str
    device_total: int  # what cudaMemGetInfo reports as total (vLLM's gpu_memory_utilization base)
    unified: bool  # GPU and host share one pool (GB10)
    host_total: int | None  # MemTotal; None when unknown (a preset for a discrete card)
    host_available: int | None = None  # MemAvailable at detection time (live only)
    sm: str = ""  # compute capability
    cuda_major: int = 13
    host_reserve: int = 4 * GIB  # OS + Docker + desktop-less DGX OS, not vLLM (assumption)
    vllm_baseline: int = 3 * GIB  # vLLM processes before the engine's first memory snapshot
    detected: bool = False
    evidence: tuple[str, ...] = ()

    @property
    def flashinfer_gdn(self) -> bool:
        """0.33 `_resolve_gdn_prefill_backend`: FlashInfer GDN prefill on SM90, or SM10x/SM12x
        with head_k_dim 128 and a CUDA 13 runtime."""
        major = int(self.sm.split(".")[0]) if self.sm else 0
        return major == 9 or (major in (10, 12) and self.cuda_major >= 13)


PRESETS: dict[str, Hardware] = {
    "gb10": Hardware(
        "gb10", "NVIDIA DGX Spark / ASUS GX10 (GB10, sm_121, 128 GB unified LPDDR5X)",
        device_total=int(121.69 * GIB), unified=True, host_total=128_501_256_192, sm="12.1",
        evidence=("device total 121.69 GiB: cudaMemGetInfo on a Spark (MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks#47)",
                  "MemTotal 128,501,256,192 B = 119.68 GiB (leptonai/gpud#1170, sysinfo on GB10)")),
    "h200": Hardware(
        "h200", "NVIDIA H200 (141 GB HBM3e, sm_90, discrete: the PLE table's page cache is host RAM, separate)",
        device_total=int(139.81 * GIB), unified=False, host_total=None, sm="9.0", host_reserve=0,
        vllm_baseline=int(0.5 * GIB),
        evidence=("139.81 GiB: cudaMemGetInfo total on an H200 (torch OOM messages 'GPU 0 has a total capacity of "
                  "139.81 GiB'; 139.72-139.81 GiB seen across H200 boards); nvidia-smi says 143,771 MiB = 140.4 GiB, "
                  "which counts memory the driver keeps",)),
    "h100": Hardware(
        "h100", "NVIDIA H100 80GB HBM3 (sm_90, discrete: the PLE table's page cache is host RAM, separate)",
        device_total=int(79.18 * GIB), unified=False, host_total=None, sm="9.0", host_reserve=0,
        vllm_baseline=int(0.5 * GIB),
        evidence=("79.18 GiB: vLLM 0.33's 'Free memory on device (78.48/79.18 GiB) on startup' on an H100 80GB HBM3 "
                  "(gpu-e2e run46); nvidia-smi says 81,559 MiB = 79.65 GiB, which counts memory the driver keeps",)),
    "rtx-pro-6000": Hardware(
        "rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell (96 GB GDDR7, sm_120, discrete)",
        device_total=97_887 * 1024**2, unified=False, host_total=None, sm="12.0", host_reserve=0,
        vllm_baseline=int(0.5 * GIB), evidence=("97,887 MiB: nvidia-smi memory.total on an RTX PRO 6000",)),
}


def preset(name: str) -> Hardware:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown hardware {name!r}",
                         hint=f"--hardware accepts: {', '.join(PRESETS)} (or leave it out to detect)") from None


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    from ..mempressure import read_meminfo as _read  # one parser, importable without the planner

    return _read(path)


def query_gpus(runner=subprocess.run) -> list[tuple[str, str, str]] | None:
    """[(name, memory.total MiB or "[N/A]", compute_cap)] from nvidia-smi, None without it."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        res = runner([exe, "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
                     capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    rows = []
    for line in res.stdout.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= 3:
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def detect(meminfo: dict[str, int] | None = None, gpus: list[tuple[str, str, str]] | None = None,
           probe: bool = True) -> tuple[Hardware, str]:
    """(hardware, how it was decided). Without a GPU the recipe's target (gb10) is assumed, with
    this machine's memory only when it looks like a Spark."""
    meminfo = read_meminfo() if meminfo is None and probe else (meminfo or {})
    if gpus is None and probe:
        gpus = query_gpus()
    total, avail = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
    if gpus:
        name, mem, cap = gpus[0]
        if "GB10" in name.upper():
            hw = replace(PRESETS["gb10"], host_total=total or PRESETS["gb10"].host_total, host_available=avail,
                         sm=cap or "12.1", detected=True)
            return hw, f"detected {name} (nvidia-smi) with /proc/meminfo"
        dev = int(float(mem)) * 1024**2 if mem.replace(".", "", 1).isdigit() else None
        base = next((p for p in PRESETS.values() if p.name != "gb10" and dev and abs(p.device_total - dev) < 2 * GIB), None)
        hw = Hardware(name.lower().replace(" ", "-"), f"{name} (detected)", device_total=dev or 0, unified=False,
                      host_total=total, host_available=avail, sm=cap, host_reserve=0, vllm_baseline=int(0.5 * GIB),
                      detected=True) if base is None else replace(base, host_total=total, host_available=avail, detected=True)
        if not hw.device_total:
            raise UsageError(f"nvidia-smi reports no memory total for {name!r}",
                             hint=f"pass --hardware ({', '.join(PRESETS)})")
        return hw, f"detected {name} (nvidia-smi)"
    return PRESETS["gb10"], "no NVIDIA GPU visible here: planned for the recipe's target, gb10 (pass --hardware to choose)"
