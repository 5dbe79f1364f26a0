"""lab/bench_step_kernels.py without a GPU: the --cpu-smoke run (tiny shapes, CPU torch) goes
through every path but the CUDA kernels and graphs; its equality checks pass, they fail when the
compared results differ, and its JSON lines have the shape the summary and KERNELS.md rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # the unit tier's venv has CPU torch (the test extra)

from lab import bench_step_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bk():
    return bench_step_kernels


def _run(*args, **env):
    e = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT / "src"), **env)
    return subprocess.run([sys.executable, "-m", "lab.bench_step_kernels", *args], env=e, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bk") / "smoke.jsonl"
    proc = _run("--cpu-smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    stdout = [json.loads(line) for line in proc.stdout.splitlines()]
    assert stdout == [json.loads(line) for line in out.read_text().splitlines()]
    return stdout


def test_smoke_runs_every_part_once_per_shape(bk, smoke):
    plan = bk.make_plan("cpu-smoke")
    assert smoke[0]["kind"] == "env" and smoke[0]["device"] == "cpu" and smoke[-1]["kind"] == "summary"
    timed = [r for r in smoke if r["kind"] in ("draft_head", "qsa_topk")]
    draft = {(r["tokens"], r["impl"]) for r in timed if r["kind"] == "draft_head"}
    assert draft == {(t, i) for t in plan.draft_tokens for i in ("stock", "patched")}
    qsa = {(r["batch"], r["context"], r["max_model_len"], r["impl"]) for r in timed if r["kind"] == "qsa_topk"}
    assert qsa == {(b, c, m, i) for b in plan.batches for c in plan.contexts for m in plan.max_model_lens
                   for i in ("stock", "patched", "radix", "repair")}
    for r in timed:
        assert r["mode"] == "eager" and "error" not in r
        assert r["n"] == plan.iters == len(r["raw_us"])
        assert min(r["raw_us"]) == r["min_us"] <= r["p10_us"] <= r["median_us"] <= r["p90_us"] <= max(r["raw_us"])
    rows = {r["batch"]: r["rows"] for r in timed if r["kind"] == "qsa_topk"}
    assert rows == {b: 3 * b for b in plan.batches}  # MTP=2: 1 + 2 positions per request
    bw = [r for r in smoke if r["kind"] == "copy_bandwidth"]
    assert len(bw) == 1 and bw[0]["ok"] and bw[0]["bytes"] == plan.copy_bytes
    per_s = bw[0]["bytes"] / (bw[0]["median_us"] * 1e-6) / 1e9  # both figures are rounded to 0.1 GB/s
    assert bw[0]["gbps_copied"] == pytest.approx(per_s, abs=0.051)
    assert bw[0]["gbps_read_plus_write"] == pytest.approx(2 * per_s, abs=0.051)


def test_smoke_checks_prove_equal_results(smoke):
    draft = [r for r in smoke if r["kind"] == "check" and r["bench"] == "draft_head"]
    assert len(draft) == 2
    for c in draft:
        assert c["ok"] and c["minus_inf_elsewhere"] and c["finite_on_set"] and c["within_2ulp"] and c["shape_ok"]
        assert c["ids"] == 256 and c["ids_source"] == "random (smoke)"
    qsa = [r for r in smoke if r["kind"] == "check" and r["bench"] == "qsa_topk"]
    assert len(qsa) == 4
    for c in qsa:
        assert c["ok"] and c["stock_equals_expected"] and c["patched_equals_expected"] and c["radix_equals_expected"]
        assert c["repair_equals_expected"]
        assert c["random_sets_equal"] == {"stock": True, "patched": True, "radix": True, "repair": True}


def test_summary_ratios_are_patched_over_stock(smoke):
    s = smoke[-1]
    med = {(r["kind"], r.get("tokens"), r.get("batch"), r.get("context"), r["impl"]): r["median_us"]
           for r in smoke if r["kind"] in ("draft_head", "qsa_topk")}
    # one ratio per flash implementation and shape: patched (draft head, QSA), radix and repair (QSA only)
    assert len(s["ratios"]) == sum(1 for k in med if k[-1] in ("patched", "radix", "repair"))
    assert s["checks"] == s["checks_passed"] == 10 and s["errors"] == []  # 2 draft, 4 QSA, 4 Stager
    for r in s["ratios"]:
        key = (r["bench"], r.get("tokens"), r.get("batch"), r.get("context"))
        assert r["vs"] == "stock" and r["patched_us"] == med[key + (r["impl"],)] and r["ref_us"] == med[key + ("stock",)]
        assert r["ratio"] == round(r["patched_us"] / r["ref_us"], 3)
        assert r["meets_goal"] == (r["patched_us"] / r["ref_us"] <= {"draft_head": 0.30, "qsa_topk": 1.0}[r["bench"]])
    assert s["draft_head_ratio_vs_stock_max"] == max(r["ratio"] for r in s["ratios"] if r["bench"] == "draft_head")
    assert s["qsa_topk_radix_ratio_vs_stock_max"] == max(r["ratio"] for r in s["ratios"] if r["impl"] == "radix")
    assert s["qsa_topk_repair_ratio_vs_stock_max"] == max(r["ratio"] for r in s["ratios"] if r["impl"] == "repair")
    assert {r["impl"] for r in s["ratios"] if r["bench"] == "draft_head"} == {"patched"}
    assert s["gb10_over_this_device_bandwidth"] == round(273.0 / s["copy_gbps_read_plus_write"], 4)


def test_ple_stage_times_both_dedup_sides_and_checks_the_rows(bk, smoke):
    plan = bk.make_plan("cpu-smoke")
    timed = [r for r in smoke if r["kind"] == "ple_stage"]
    assert {(r["tokens"], r["impl"], r["dedup_min"]) for r in timed} == {
        (t, i, m) for t in plan.stage_tokens for i, m in (("dedup256", 256), ("nodedup", 1025))}
    assert all(r["rows"] == 16 * r["tokens"] and r["mode"] == "wall" and r["n"] == plan.iters for r in timed)
    checks = [r for r in smoke if r["kind"] == "check" and r["bench"] == "ple_stage"]
    assert len(checks) == 2 * len(plan.stage_tokens) and all(c["ok"] for c in checks)
    med = {(r["tokens"], r["impl"]): r["median_us"] for r in timed}
    ratios = smoke[-1]["ple_stage"]
    assert [r["tokens"] for r in ratios] == sorted(plan.stage_tokens)
    for r in ratios:
        assert r["ratio_nodedup_vs_dedup256"] == round(med[(r["tokens"], "nodedup")] / med[(r["tokens"], "dedup256")], 3)


def test_ple_stage_check_fails_on_wrong_rows(bk, monkeypatch, capsys):
    from flash_vllm.ple.stager import Stager

    real = Stager.lookup

    def off_by_one_row(self, ids, raw=False, out=None):
        res = real(self, ids, raw=raw, out=out)
        if self.dedup_min == 1025:
            res.view(-1, res.shape[-1])[0] += 1  # the no-dedup side serves one wrong row
        return res

    monkeypatch.setattr(Stager, "lookup", off_by_one_row)
    assert bk.main(["--cpu-smoke", "--only", "ple_stage"]) == bk.EXIT_CHECK_FAILED
    checks = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"check"' in x]
    assert {c["impl"]: c["ok"] for c in checks} == {"dedup256": True, "nodedup": False}


def test_ple_stage_check_accepts_another_nan_payload_only(bk):
    want = torch.tensor([1.5, float("nan"), -2.0], dtype=torch.bfloat16)
    other_nan = want.clone()
    other_nan.view(torch.int16)[1] = -64  # 0xFFC0: a NaN with the sign bit, as a GPU may write it
    assert not torch.equal(other_nan.view(torch.int16), want.view(torch.int16))
    assert bk.same_bits(torch, other_nan, want)
    moved = want.clone()
    moved[0], moved[1] = float("nan"), 1.5  # a NaN where the table has a number: wrong rows
    assert not bk.same_bits(torch, moved, want)
    off = want.clone()
    off.view(torch.int16)[2] += 1  # one bit off in a number
    assert not bk.same_bits(torch, off, want)


def test_draft_check_fails_on_a_wrong_scatter_or_value(bk):
    g = torch.Generator().manual_seed(1)
    full = torch.randn(3, 50, generator=g).to(torch.bfloat16)
    ids = torch.tensor([2, 7, 11, 40])
    good = torch.full_like(full, float("-inf"))
    good[:, ids] = full[:, ids]
    assert bk.check_reduced(torch, full, good, ids)["ok"]
    shifted = torch.full_like(full, float("-inf"))
    shifted[:, ids + 1] = full[:, ids]  # scattered one column off
    res = bk.check_reduced(torch, full, shifted, ids)
    assert not res["ok"] and not res["minus_inf_elsewhere"] and not res["finite_on_set"]
    zero_fill = good.clone()
    zero_fill[:, 0] = 0.0  # a column outside the set that is not -inf
    assert not bk.check_reduced(torch, full, zero_fill, ids)["ok"]
    off = good.clone()
    off[1, 7] = off[1, 7] + 0.25 * max(1.0, float(off[1, 7].abs()))  # far beyond 2 bf16 ulps
    res = bk.check_reduced(torch, full, off, ids)
    assert not res["ok"] and not res["within_2ulp"] and not res["bitwise_equal"]


def test_qsa_check_fails_when_the_stock_side_selects_a_wrong_block(bk, monkeypatch, capsys):
    real = bk.cpu_standin_topk

    def drops_the_best(logits, visible, token_topk, ratio, out, ws):
        real(logits, visible, token_topk, ratio, out, ws)
        k = token_topk // ratio
        v = int(visible[0])
        out[0, k - 1] = torch.topk(logits[0, :v], k + 1).indices[k]  # swaps the best for the (k+1)-th

    monkeypatch.setattr(bk, "cpu_standin_topk", drops_the_best)
    assert bk.main(["--cpu-smoke", "--only", "qsa_topk"]) == bk.EXIT_CHECK_FAILED
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    checks = [r for r in lines if r["kind"] == "check"]
    # repair is not judged here: it is the (broken) stock op plus a pass that trusts its threshold
    assert checks and all(not c["ok"] and not c["stock_equals_expected"] and c["patched_equals_expected"]
                          and c.get("radix_equals_expected", True) for c in checks)
    assert lines[-1]["checks_passed"] == 0


def test_patched_qsa_is_patch_8s_installed_hook(bk, monkeypatch, capsys):
    """The `patched` side is what patch 8 installs: `_qsa_topk.make_hook(stock, "det", ...)`; the
    `radix` and `repair` sides what it installs with VLLM_QSA_DET_TOPK=radix / =repair, around the
    same stock function (here the CPU stand-in: the stock CUDA ops do not exist on CPU)."""
    from flash_vllm.patches.p05_qsa_exact_topk import hook as _qsa_topk

    seen = []
    real = _qsa_topk.make_hook
    monkeypatch.setattr(_qsa_topk, "make_hook", lambda orig, mode, base: seen.append((orig, mode, base))
                        or real(orig, mode, base))
    triton_runs = bk.triton_unavailable("cpu") is None  # not in a process that imported Triton for a GPU
    assert bk.main(["--cpu-smoke", "--only", "qsa_topk"]) == 0
    notes = [json.loads(x) for x in capsys.readouterr().out.splitlines() if '"note"' in x]
    assert seen == [(bk.cpu_standin_topk, m, "v0.30") for m in ("det",) + (("radix", "repair") if triton_runs else ())]
    # a candidate left out is said, never silent
    assert [n["impl"] for n in notes] == ([] if triton_runs else ["radix", "repair"])
    hook = real(bk.cpu_standin_topk, "det", "v0.30")
    assert hook.flash_mode == "det"


def test_without_cuda_it_exits_3_with_a_reason():
    proc = _run()
    assert proc.returncode == 3 and proc.stdout == ""
    assert "no CUDA device" in proc.stderr and "--cpu-smoke" in proc.stderr


def test_bad_arguments_are_refused(tmp_path):
    proc = _run("--cpu-smoke", "--out", str(tmp_path / "missing" / "x.jsonl"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = _run("--cpu-smoke", "--quick")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr
    proc = _run("--cpu-smoke", "--only", "nope")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_a_candidate_that_cannot_run_is_reported_and_the_rest_are_timed(bk, monkeypatch, capsys):
    """run38: the radix kernel did not compile on the GPU and the whole qsa_topk bench was lost
    (no patch-8 ratio at all). A failing candidate is now a setup record of its own (both Triton
    candidates fail here)."""
    from flash_vllm.patches.p05_qsa_exact_topk import hook as _qsa_topk

    real = _qsa_topk.make_hook

    def make_hook(orig, mode, base):
        if mode not in ("radix", "repair"):
            return real(orig, mode, base)

        def broken(*args):
            raise RuntimeError(f"CompilationError in {mode}: at 13:8: constexpr cannot be reassigned")
        return broken

    monkeypatch.setattr(_qsa_topk, "make_hook", make_hook)
    monkeypatch.setattr(bk, "triton_unavailable", lambda device: None)
    assert bk.main(["--cpu-smoke", "--only", "qsa_topk"]) == bk.EXIT_CHECK_FAILED  # an error is not a pass
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    setup = [r for r in lines if r["kind"] == "setup"]
    assert setup and all(r["impl"] in ("radix", "repair") and f"in {r['impl']}:" in r["error"] for r in setup)
    assert {r["impl"] for r in setup} == {"radix", "repair"}
    summary = lines[-1]
    assert summary["qsa_topk_ratio_vs_stock_max"] is not None and summary["qsa_topk_radix_ratio_vs_stock_max"] is None
    assert summary["qsa_topk_repair_ratio_vs_stock_max"] is None
    assert all(any(f"qsa_topk/{m}" in e for e in summary["errors"]) for m in ("radix", "repair"))
    assert {r["impl"] for r in lines if r["kind"] == "qsa_topk"} == {"stock", "patched"}  # the rest are timed


def test_the_serial_repair_is_judged_beside_the_sliced_one(bk):
    """On CUDA the bench also times run43's one-program-per-row repair (`repair_serial`) after the same
    stock op: its ratio against stock in the same run is the sliced repair's before."""
    shape = {"batch": 1, "context": 131072, "max_model_len": 500000}
    records = [dict(shape, kind="qsa_topk", mode="graph", impl=impl, median_us=us)
               for impl, us in (("stock", 9.0), ("repair", 18.0), ("repair_serial", 55.3))]
    s = bk.summarize(records)
    assert s["qsa_topk_repair_ratio_vs_stock_max"] == 2.0
    assert s["qsa_topk_repair_serial_ratio_vs_stock_max"] == round(55.3 / 9.0, 3)
    assert {r["impl"] for r in s["ratios"]} == {"repair", "repair_serial"}


def test_the_serial_repair_runs_the_stock_op_then_the_one_program_per_row_pass(bk, monkeypatch):
    from flash_vllm.patches.p08_qsa_det_topk import radix as _qsa_radix

    calls = []
    monkeypatch.setattr(_qsa_radix, "repair_block_topk",
                        lambda *a, **kw: calls.append(("repair", a[3], a[4], kw)))
    fn = bk.serial_repair(lambda *a: calls.append(("stock", a[2], a[3])))
    fn(torch.zeros(2, 700), torch.tensor([700, 9]), 2048, 4, torch.zeros(2, 512, dtype=torch.int32), None)
    assert calls == [("stock", 2048, 4), ("repair", 512, 700, {"slice_columns": None})]
