"""Memory pressure on the host, from /proc (issue 16).

On a 128 GB unified-memory Spark, pressure shows up as direct reclaim burning CPU and the PLE
table's pages being evicted from the page cache (every prefill then faults on the disk). What
`flash doctor` and `flash status` report: PSI (`/proc/pressure/memory`), MemAvailable against
the plan, swap and `vm.swappiness`, `vm.compaction_proactiveness`, and direct-reclaim counters
from `/proc/vmstat`. Every reader takes the /proc root, so tests use synthetic files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from flash_common.memguard import parse_psi  # one PSI parser: the watchdog in the image uses it too

GIB = 1024**3


@dataclass
class MemState:
    psi: dict[str, dict[str, float]] | None  # {"some": {"avg10":…, "avg60":…, "avg300":…, "total":…}, "full": …}
    meminfo: dict[str, int] = field(default_factory=dict)  # bytes
    swappiness: int | None = None
    compaction_proactiveness: int | None = None
    direct_reclaim_scanned: int | None = None  # pages, since boot (pgscan_direct)
    allocstalls: int | None = None  # direct-reclaim entries, since boot (allocstall_*)

    def as_dict(self) -> dict:
        return asdict(self)


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text()
    except OSError:
        return None


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo → {key: bytes} (kB values scaled; unit-less counts kept)."""
    out: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def read(proc: str | Path = "/proc") -> MemState:
    root = Path(proc)
    psi_text = _read(root, "pressure/memory")
    try:
        psi = parse_psi(psi_text) if psi_text else None
    except ValueError:
        psi = None

    def num(rel: str) -> int | None:
        text = _read(root, rel)
        try:
            return int(text.strip()) if text is not None else None
        except ValueError:
            return None

    scanned = stalls = None
    vmstat = _read(root, "vmstat")
    if vmstat:
        counters = {}
        for line in vmstat.splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                counters[k] = int(v)
        if "pgscan_direct" in counters:
            scanned = counters["pgscan_direct"]
        stall_keys = [k for k in counters if k.startswith("allocstall")]
        if stall_keys:
            stalls = sum(counters[k] for k in stall_keys)
    return MemState(psi, read_meminfo(root / "meminfo"), num("sys/vm/swappiness"),
                    num("sys/vm/compaction_proactiveness"), scanned, stalls)


def findings(st: MemState, *, warn_pct: float, plan_page_cache: int | None = None,
             running: bool = False) -> list[tuple[str, str]]:
    """(level, text) lines, level ok | warn | info. `plan_page_cache`: the bytes the plan left to
    the page cache beside a running server (MemAvailable should be about that much)."""
    out: list[tuple[str, str]] = []
    if st.psi is None:
        out.append(("info", "no /proc/pressure/memory (kernel without PSI, or psi=0 on its command line): "
                            "memory stalls cannot be measured"))
    else:
        some, full = st.psi["some"], st.psi.get("full", {})
        text = (f"memory pressure (PSI) some avg10/60/300 {some.get('avg10', 0):.1f}/{some.get('avg60', 0):.1f}/"
                f"{some.get('avg300', 0):.1f}%" + (f", full avg60 {full.get('avg60', 0):.1f}%" if full else ""))
        if some.get("avg60", 0) > warn_pct or full.get("avg60", 0) > warn_pct:
            out.append(("warn", text + f" (above MEM_PRESSURE_WARN={warn_pct:g}%): tasks stall on direct reclaim "
                                "and the PLE table's pages are being evicted; free memory or lower GPU_MEM"))
        else:
            out.append(("ok", text))
    mi = st.meminfo
    avail = mi.get("MemAvailable")
    if avail is not None and plan_page_cache is not None and running:
        if plan_page_cache > 0 and avail < 0.5 * plan_page_cache:
            out.append(("warn", f"MemAvailable {avail / GIB:.1f} GiB, the plan left {plan_page_cache / GIB:.1f} GiB "
                                "beside the server: something else holds memory and the PLE table's page cache shrinks"))
        else:
            out.append(("ok", f"MemAvailable {avail / GIB:.1f} GiB (the plan left {plan_page_cache / GIB:.1f} GiB "
                              "beside the server)"))
    elif avail is not None:
        out.append(("info", f"MemAvailable {avail / GIB:.1f} GiB of {mi.get('MemTotal', 0) / GIB:.1f} GiB"))
    swap_total, swap_free = mi.get("SwapTotal", 0), mi.get("SwapFree", 0)
    used = swap_total - swap_free
    if swap_total and st.swappiness is not None and st.swappiness > 10:
        out.append(("warn", f"vm.swappiness={st.swappiness} with {swap_total / GIB:.0f} GiB swap on: under pressure "
                            "the engine's pages go to swap; sudo sysctl vm.swappiness=1"))
    if used > GIB:
        out.append(("warn", f"{used / GIB:.1f} GiB swapped out (of {swap_total / GIB:.0f} GiB)"))
    elif swap_total or st.swappiness is not None:
        out.append(("info", f"swap {swap_total / GIB:.0f} GiB ({used / GIB:.1f} used), vm.swappiness={st.swappiness}"))
    if st.compaction_proactiveness:
        out.append(("warn", f"vm.compaction_proactiveness={st.compaction_proactiveness}: the kernel moves pages in the "
                            "background, stalling the engine on a full pool; Spark recipes set "
                            "sudo sysctl vm.compaction_proactiveness=0"))
    if st.direct_reclaim_scanned is not None or st.allocstalls is not None:
        out.append(("info", f"direct reclaim since boot: {st.allocstalls or 0:,} stalls, "
                            f"{st.direct_reclaim_scanned or 0:,} pages scanned (/proc/vmstat)"))
    return out
