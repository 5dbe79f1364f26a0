"""lab/bench_side_gemm.py without a GPU: the shapes it times are the model's merged side linears,
its block quantization keeps each block's scale with its block, its per-forward sums weigh each
shape by its count, and its command line fails plainly. The timings themselves need a GPU
(benchmarks/side-gemm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # the unit tier's venv has CPU torch (the test extra)

from lab import bench_side_gemm as sg
from lab.decode import model

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "lab.bench_side_gemm", *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_shapes_are_the_merged_side_linears_of_48_layers():
    shapes = {s.name: (s.n, s.k, s.per_forward) for s in sg.side_shapes()}
    assert shapes == {
        "gdn.in_proj_qkvz": (16384, 2560, 36),   # q, k 16 x 128 each; v, z 48 x 128 each
        "gdn.out_proj": (2560, 6144, 36),
        "qsa.qkv_indexer": (13952, 2560, 12),    # 24 x 256 x 2 (gate) + 2 x 2 x 256 + 5 x 128
        "qsa.o_proj": (2560, 6144, 12),
        "shared.gate_up": (1280, 2560, 48),
        "shared.down": (2560, 640, 48),
    }
    # every one is FP8_PB_WO-able: both sides whole 128-blocks
    assert all(n % sg.BLOCK == 0 and k % sg.BLOCK == 0 for n, k, _ in shapes.values())


def test_shapes_follow_the_config():
    cfg = model.text_config(model.FULL_NGRAM_BASE, layers=8)
    cfg["output_gate_type"] = None
    cfg["shared_expert_intermediate_size"] = 1024
    shapes = {s.name: (s.n, s.k, s.per_forward) for s in sg.side_shapes(cfg)}
    assert shapes["qsa.qkv_indexer"] == (6144 + 1024 + 640, 2560, 2)
    assert shapes["shared.gate_up"] == (2048, 2560, 8)
    assert shapes["gdn.in_proj_qkvz"][2] == 6


def test_quantize_blocks_keeps_each_scale_with_its_block():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g)
    w[:128, 128:256] *= 100          # one loud block
    q, scale, deq = sg.quantize_blocks(torch, w.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 384)
    assert scale.shape == (2, 3)
    assert scale[0, 1] > 50 * scale[1, 1]
    err = (deq.float() - w.to(torch.bfloat16).float()).norm() / w.norm()
    assert err < 0.05
    # the same blocks with the scales swapped are far off: what the GPU check catches
    wrong = (q.float().view(2, 128, 3, 128) * scale.flip(0)[:, None, :, None]).view(256, 384)
    assert (wrong - w).norm() / w.norm() > 0.5


@pytest.mark.parametrize("weight_bytes,l2,expected", [(40 << 20, 50 << 20, 5), (1 << 30, 50 << 20, 2),
                                                     (1 << 20, 50 << 20, sg.MAX_COPIES)])
def test_copies_span_the_l2(weight_bytes, l2, expected):
    assert sg.copies_for(weight_bytes, l2) == expected


def test_summary_weighs_by_count_and_compares_like_with_like():
    rows = [
        {"kind": "gemm", "shape": "a", "m": 3, "path": "bf16", "per_forward": 36, "median_us": 10.0},
        {"kind": "gemm", "shape": "b", "m": 3, "path": "bf16", "per_forward": 12, "median_us": 5.0},
        {"kind": "gemm", "shape": "a", "m": 3, "path": "fp8_auto", "per_forward": 36, "median_us": 12.0},
        {"kind": "gemm", "shape": "b", "m": 3, "path": "fp8_auto", "per_forward": 12, "median_us": 4.0},
        {"kind": "gemm", "shape": "a", "m": 3, "path": "fp8_deepgemm", "per_forward": 36, "median_us": 9.0},
        {"kind": "gemm", "shape": "b", "m": 3, "path": "fp8_deepgemm", "per_forward": 12, "error": "boom"},
        {"kind": "check", "shape": "a", "m": 3, "path": "fp8_auto", "ok": True},
    ]
    per = sg.summarize(rows)["3"]
    assert per["bf16"]["forward_ms"] == pytest.approx((36 * 10 + 12 * 5) / 1e3)
    assert per["fp8_auto"]["minus_bf16_ms"] == pytest.approx((36 * 2 - 12) / 1e3)
    assert per["fp8_auto"]["ratio_to_bf16"] == pytest.approx(480 / 420, rel=1e-3)
    # a path that ran one shape is compared with BF16 on that shape only
    assert per["fp8_deepgemm"]["shapes"] == 1
    assert per["fp8_deepgemm"]["minus_bf16_ms"] == pytest.approx(-36 / 1e3)


def test_plan_prints_the_shapes_without_a_gpu():
    proc = _run("--plan")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["name"] for r in rows] == [s.name for s in sg.side_shapes()]


@pytest.mark.parametrize("tokens", ["0", "3,x", "", "5000"])
def test_bad_tokens_name_the_value(tokens):
    proc = _run("--tokens", tokens)
    assert proc.returncode == sg.EXIT_USAGE
    assert repr(tokens) in proc.stderr and "1 to 4096" in proc.stderr


@pytest.mark.parametrize("paths", ["cutlas", "", "auto,bf16"])
def test_bad_paths_name_the_value(paths):
    proc = _run("--paths", paths)
    assert proc.returncode == sg.EXIT_USAGE
    assert repr(paths) in proc.stderr and "auto, cutlass, deepgemm" in proc.stderr


def test_no_gpu_says_so():
    proc = _run("--tokens", "3")
    assert proc.returncode == sg.EXIT_NO_CUDA
    assert "vLLM" in proc.stderr or "CUDA" in proc.stderr


def _rows(path, bf16_us: float, fp8_us: float, gpu="GPU X"):
    rows = [{"kind": "device", "gpu": gpu}]
    for s in sg.side_shapes():
        for m in (3, 12):
            rows.append({"kind": "gemm", "shape": s.name, "m": m, "path": "bf16", "per_forward": s.per_forward,
                         "median_us": bf16_us})
            rows.append({"kind": "gemm", "shape": s.name, "m": m, "path": "fp8_cutlass", "per_forward": s.per_forward,
                         "median_us": fp8_us * (2 if m == 12 else 1)})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_report_tables_each_shape_and_the_per_forward_difference(tmp_path):
    f = _rows(tmp_path / "a.jsonl", 10.0, 8.0)
    png = tmp_path / "p.png"
    proc = _run("--report", str(f), "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "| gdn.in_proj_qkvz | 3 | 10.0 | 8.0 |" in lines
    assert "| shared.down | 12 | 10.0 | 16.0 |" in lines
    per_forward = sum(s.per_forward for s in sg.side_shapes())  # 216 linears a forward
    assert f"| 3 | {per_forward * 10 / 1e3:.2f} | {per_forward * 8 / 1e3:.2f} ({-per_forward * 2 / 1e3:+.2f}) |" in lines
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_report_of_a_missing_file_names_it(tmp_path):
    proc = _run("--report", str(tmp_path / "nope.jsonl"))
    assert proc.returncode == sg.EXIT_USAGE and "nope.jsonl" in proc.stderr
