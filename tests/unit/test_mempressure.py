"""Memory pressure from synthetic /proc trees (issue 16): PSI, MemAvailable vs the plan, swap,
swappiness, compaction_proactiveness, direct reclaim; and doctor reading them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flash_cli import mempressure

GIB = 1024**3


def proc(tmp_path: Path, *, some60=0.0, full60=0.0, avail_gib=30, swap_gib=0, swap_free_gib=None,
         swappiness=60, proactive=20, psi=True) -> Path:
    root = tmp_path / "proc"
    (root / "pressure").mkdir(parents=True)
    (root / "sys" / "vm").mkdir(parents=True)
    if psi:
        (root / "pressure" / "memory").write_text(
            f"some avg10={some60 * 2:.2f} avg60={some60:.2f} avg300={some60 / 2:.2f} total=123456\n"
            f"full avg10=0.00 avg60={full60:.2f} avg300=0.00 total=789\n")
    free = swap_gib if swap_free_gib is None else swap_free_gib
    (root / "meminfo").write_text(
        f"MemTotal:       125000000 kB\nMemFree:         1000000 kB\nMemAvailable:   {avail_gib * 1048576} kB\n"
        f"SwapTotal:      {swap_gib * 1048576} kB\nSwapFree:       {free * 1048576} kB\n")
    (root / "sys" / "vm" / "swappiness").write_text(f"{swappiness}\n")
    (root / "sys" / "vm" / "compaction_proactiveness").write_text(f"{proactive}\n")
    (root / "vmstat").write_text("nr_free_pages 12345\npgscan_direct 4242\nallocstall_normal 7\nallocstall_movable 3\n")
    return root


def levels(findings, level):
    return [t for lv, t in findings if lv == level]


def test_reads_every_source(tmp_path):
    st = mempressure.read(proc(tmp_path, some60=3.5, swap_gib=8, swap_free_gib=6))
    assert st.psi["some"]["avg60"] == 3.5 and st.psi["full"]["total"] == 789
    assert st.meminfo["MemAvailable"] == 30 * GIB and st.meminfo["SwapTotal"] == 8 * GIB
    assert (st.swappiness, st.compaction_proactiveness) == (60, 20)
    assert (st.direct_reclaim_scanned, st.allocstalls) == (4242, 10)
    json.dumps(st.as_dict())  # --json ready


def test_calm_host_is_ok(tmp_path):
    f = mempressure.findings(mempressure.read(proc(tmp_path, some60=0.4, proactive=0)), warn_pct=10)
    assert not levels(f, "warn")
    assert any("PSI" in t and "0.4" in t for t in levels(f, "ok"))


def test_sustained_pressure_warns_naming_the_threshold(tmp_path):
    f = mempressure.findings(mempressure.read(proc(tmp_path, some60=25.0, proactive=0)), warn_pct=10)
    warn = levels(f, "warn")
    assert len(warn) == 1 and "25.0" in warn[0] and "MEM_PRESSURE_WARN=10%" in warn[0]
    f = mempressure.findings(mempressure.read(proc(tmp_path / "b", some60=5, full60=12, proactive=0)), warn_pct=10)
    assert levels(f, "warn")  # full stalls count too


def test_memavailable_against_the_plan_when_serving(tmp_path):
    st = mempressure.read(proc(tmp_path, avail_gib=4, proactive=0))
    f = mempressure.findings(st, warn_pct=10, plan_page_cache=14 * GIB, running=True)
    assert any("MemAvailable 4.0 GiB" in t and "14.0 GiB" in t for t in levels(f, "warn"))
    f = mempressure.findings(mempressure.read(proc(tmp_path / "b", avail_gib=13, proactive=0)), warn_pct=10,
                             plan_page_cache=14 * GIB, running=True)
    assert not levels(f, "warn")


def test_swap_swappiness_and_compaction(tmp_path):
    f = mempressure.findings(mempressure.read(proc(tmp_path, swap_gib=16, swap_free_gib=10, swappiness=60,
                                                   proactive=20)), warn_pct=10)
    warn = " | ".join(levels(f, "warn"))
    assert "vm.swappiness=60" in warn and "6.0 GiB swapped out" in warn and "compaction_proactiveness=20" in warn
    f = mempressure.findings(mempressure.read(proc(tmp_path / "b", swap_gib=16, swappiness=1, proactive=0)),
                             warn_pct=10)
    assert not levels(f, "warn")


def test_kernel_without_psi_says_so(tmp_path):
    f = mempressure.findings(mempressure.read(proc(tmp_path, psi=False, proactive=0)), warn_pct=10)
    assert any("no /proc/pressure/memory" in t for t in levels(f, "info"))


@pytest.mark.parametrize("bad", ["garbage\n", "some avg10=x\n", ""])
def test_unreadable_psi_is_treated_as_absent(tmp_path, bad):
    root = proc(tmp_path)
    (root / "pressure" / "memory").write_text(bad)
    assert mempressure.read(root).psi is None


def test_doctor_reports_pressure_from_synthetic_proc(tmp_path, monkeypatch, capsys):
    from flash_cli.commands import doctor
    from flash_cli.output import Report
    from flash_cli.settings import resolve

    monkeypatch.setattr(doctor, "PROC", str(proc(tmp_path, some60=30.0, proactive=20)))
    rep = Report(quiet=True)
    doctor.check_host(resolve(), rep)
    texts = [i["text"] for i in rep.items if i["status"] == "warn"]
    assert any("memory pressure (PSI)" in t and "30.0" in t for t in texts)
    assert any("compaction_proactiveness=20" in t for t in texts)


@pytest.mark.parametrize("gpus, status", [("all", "fail"), ("none", "warn")])
def test_doctor_counts_a_missing_gpu_as_a_problem_when_the_recipe_needs_one(tmp_path, monkeypatch, gpus, status):
    """A box without an NVIDIA driver cannot serve GPUS=all: a problem (exit 1), not a warning
    among others; a GPU-less test recipe (GPUS=none) only hears about it."""
    from flash_cli.commands import doctor
    from flash_cli.output import Report
    from flash_cli.settings import resolve

    monkeypatch.setattr(doctor, "PROC", str(proc(tmp_path)))
    monkeypatch.setenv("PATH", str(tmp_path / "no-driver-here"))  # no nvidia-smi on PATH
    rep = Report(quiet=True)
    doctor.check_host(resolve(None, None, {"GPUS": gpus}), rep)
    gpu = [i for i in rep.items if "nvidia-smi not found" in i["text"]]
    assert len(gpu) == 1 and gpu[0]["status"] == status
    assert ("GPUS=all cannot start" in gpu[0]["text"]) == (gpus == "all")
