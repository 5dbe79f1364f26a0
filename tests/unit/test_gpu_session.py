"""lab/gpu_session.sh on CPU: `start` launches the phases detached and returns at once, the decode
phases run lab/bench_decode.py against a faithful stand-in `vllm` (real HTTP, streamed
completions, Prometheus counters), a phase not asked for is skipped and said so, and `watch` brings
everything back as ONE archive (the device tool returns only a handful of files a call), plus the
JIT caches for the next session, which `start` unpacks."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tests.fakes import vllm_cli


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "lab" / "gpu_session.sh"


def _test_constant(test_file: str, name: str) -> str:
    """A module-level string of another test file (its stand-in server), read without importing it."""
    tree = ast.parse((ROOT / "tests" / "unit" / test_file).read_text())
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == [name])


def _fake_vllm(bindir: Path) -> None:
    body = _test_constant("test_bench_decode.py", "FAKE_VLLM").replace("#!PYTHON", "#!" + sys.executable)
    exe = bindir / "vllm"
    exe.write_text(body)
    exe.chmod(0o755)


def _session_env(tmp_path: Path, env_sh: str = "", **more: str) -> dict:
    """The environment every test gives the script: its own session, repo, bench and env.sh under
    tmp_path, and no carried JIT pack (a checkout's .payload/jit-cache.tar.gz must not leak in)."""
    (tmp_path / "env.sh").write_text(env_sh)
    return {**os.environ, "FLASH_E2E_VLLM_ENV": str(tmp_path / "env.sh"), "FLASH_SESSION_DIR": str(tmp_path / "gs"),
            "FLASH_SESSION_REPO": str(tmp_path / "repo"), "FLASH_SESSION_BENCH": str(tmp_path / "bench"),
            "FLASH_SESSION_JIT_TAR": str(tmp_path / "no-carried-jit.tar.gz"), **more}


def _start(env: dict, budget: str, phases: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "start", "c0ffee1", budget, phases], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _watch(env: dict, secs: str = "240") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "watch", secs], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_start_runs_detached_and_watch_returns_one_archive(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_vllm(bindir)
    (bindir / "python3").symlink_to(sys.executable)  # the phases call python3 (the device's)
    gs, out = tmp_path / "gs", tmp_path / "out"
    out.mkdir()
    home = tmp_path / "home"
    (home / ".triton" / "cache" / "ab12").mkdir(parents=True)
    (home / ".triton" / "cache" / "ab12" / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(1000))
    env = _session_env(tmp_path, "export VLLM_USE_FLASHINFER_SAMPLER=0\n", HOME=str(home),
                       PATH=f"{bindir}:{os.environ['PATH']}", FLASH_SESSION_PLE_ROWS="40000", OUT=str(out),
                       DECODE_REPEATS="2", DECODE_TOKENS="24", DECODE_CONFIGS="stock,hoisted")
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(SCRIPT), "start", "abc1234", "420", "decode8"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 30 and "launched" in r.stdout  # returns at once: the phases run detached
    r = subprocess.run(["bash", str(SCRIPT), "watch", "200"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=260)
    assert r.returncode == 0, r.stderr
    assert "all phases ended" in r.stdout
    phases = (gs / "phases.log").read_text()
    assert "commit abc1234" in phases and "skip e2e (not asked)" in phases and "end decode8 rc=0" in phases
    assert sorted(p.name for p in out.iterdir()) == ["gs.tar.gz", "jit-cache.tar.gz.00"], phases
    assert "jit caches: jit-cache.tar.gz" in phases
    with tarfile.open(out / "gs.tar.gz") as tar:
        names = set(tar.getnames())
        rows = [json.loads(line) for line in tar.extractfile("gs/decode/raw.jsonl").read().decode().splitlines()]
    assert {"gs/phases.log", "gs/decode/stock-L8.log", "gs/decode/hoisted-L8.log"} <= names
    # DECODE_CONFIGS reached the matrix: eager was neither booted nor measured
    assert "gs/decode/eager-L8.log" not in names
    assert sorted(r["label"] for r in rows if r.get("event") == "booted") == ["hoisted", "stock"]
    assert {r.get("commit") for r in rows} == {"abc1234"}  # every raw row names the commit it measured
    meas = [r for r in rows if "aggregate_tok_s" in r]
    assert {r["layers"] for r in meas} == {8} and {(r["repeat"], r["max_tokens"]) for r in meas} == {(0, 24), (1, 24)}


def test_usage_and_a_missing_payload_are_refused(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    env = {**os.environ, "FLASH_E2E_VLLM_ENV": str(tmp_path / "nope.sh"), "FLASH_SESSION_DIR": str(tmp_path / "gs")}
    r = subprocess.run(["bash", str(SCRIPT), "start", "abc", "100"], env=env, capture_output=True, text=True)
    assert r.returncode == 3 and "install the payload first" in r.stderr


def test_jit_caches_come_back_small_and_are_restored_by_the_next_start(tmp_path):
    """`watch` returns the JIT caches only under the size cap (saying so otherwise); the next session's
    `start` unpacks a carried archive into $HOME before any phase runs."""
    old_home, new_home, out = tmp_path / "h1", tmp_path / "h2", tmp_path / "out"
    (old_home / ".cache" / "flashinfer" / "autotune").mkdir(parents=True)
    (old_home / ".cache" / "flashinfer" / "autotune" / "cfg.json").write_text('{"tile": 128}')
    (old_home / ".cache" / "flashinfer" / "big.bin").write_bytes(os.urandom(2 << 20))
    new_home.mkdir()
    out.mkdir()
    base = _session_env(tmp_path, OUT=str(out))

    def session(home, phases, **extra):
        env = {**base, "HOME": str(home), **extra}
        r = subprocess.run(["bash", str(SCRIPT), "start", "c0ffee1", "60", phases], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(["bash", str(SCRIPT), "watch", "60"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "all phases ended" in r.stdout, r.stdout + r.stderr
        return (tmp_path / "gs" / "phases.log").read_text()

    log = session(old_home, "none", FLASH_SESSION_JIT_MAX_MIB="1")  # 2 MiB of random bytes: over the cap
    assert "over 1 MiB: not returned" in log and not list(out.glob("jit-cache*"))
    log = session(old_home, "none", FLASH_SESSION_JIT_MAX_MIB="40")
    parts = sorted(out.glob("jit-cache.tar.gz.*"))
    assert parts and "carry it as" in log
    carried = tmp_path / "carried.tar.gz"  # what `cat jit-cache.tar.gz.* >` gives here
    carried.write_bytes(b"".join(p.read_bytes() for p in parts))
    log = session(new_home, "none", FLASH_SESSION_JIT_TAR=str(carried))
    assert "jit caches restored from" in log.splitlines()[0]
    assert "prepare" not in log and not (tmp_path / "bench").exists()  # no decode phase: no 4.8 GiB table
    assert (new_home / ".cache" / "flashinfer" / "autotune" / "cfg.json").read_text() == '{"tile": 128}'


def test_phases_run_in_the_order_asked_and_unknown_ones_are_refused(tmp_path):
    env = _session_env(tmp_path, OUT=str(tmp_path), HOME=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(["bash", str(SCRIPT), "start", "c0ffee1", "60", "kernels,decode5"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown phase 'decode5'" in r.stderr and not (tmp_path / "gs").exists()
    r = subprocess.run(["bash", str(SCRIPT), "start", "c0ffee1", "60", "decode8"], cwd=ROOT,
                       env={**env, "DECODE_REPEATS": "six"}, capture_output=True, text=True)
    assert r.returncode == 2 and "DECODE_REPEATS='six'" in r.stderr and not (tmp_path / "gs").exists()
    for configs, says in (("stock,fast", "unknown config 'fast' (stock, eager, hoisted, hoisted-dedup256)"),
                          ("stock,hoisted,stock", "stock twice"), (",", "DECODE_CONFIGS is empty")):
        r = subprocess.run(["bash", str(SCRIPT), "start", "c0ffee1", "60", "decode8"], cwd=ROOT,
                           env={**env, "DECODE_CONFIGS": configs}, capture_output=True, text=True)
        assert r.returncode == 2 and says in r.stderr and not (tmp_path / "gs").exists(), r.stderr
    for layers in ("30", "52", "x"):  # recipe48's layer count: a multiple of 4 up to the real 48
        r = subprocess.run(["bash", str(SCRIPT), "start", "c0ffee1", "60", "kernels"], cwd=ROOT,
                           env={**env, "RECIPE_LAYERS": layers}, capture_output=True, text=True)
        assert r.returncode == 2 and f"RECIPE_LAYERS='{layers}'" in r.stderr and not (tmp_path / "gs").exists()
    # sidegemm, kernels, then e2e; on this CPU machine each ends at once (no CUDA or vLLM: exit 3)
    r = _start(env, "700", "sidegemm,kernels,e2e")
    assert r.returncode == 0, r.stderr
    r = _watch(env)
    assert "all phases ended" in r.stdout, r.stdout[-2000:]
    log = (tmp_path / "gs" / "phases.log").read_text()
    starts = [line.split()[2] for line in log.splitlines() if " start " in line]
    assert starts == ["sidegemm", "kernels", "e2e"], log
    # both of the phase's runs ran and said why they could not time anything here
    assert (tmp_path / "gs" / "sidegemm.log").read_text().count("needs torch and vLLM") == 2
    assert "skip decode8 (not asked)" in log and "skip decode4 (not asked)" in log and "prepare" not in log


def test_e2e_deadline_keeps_what_the_later_phases_need(tmp_path):
    """The e2e tier gets what the budget leaves after the phases asked after it (run37's fixed 900 s
    cut 14 wave servers short while 644 s went to later phases), capped; the JIT caches are packed
    as soon as e2e ends, so a session cut short later still returns them."""
    home = tmp_path / "home"
    (home / ".triton" / "cache").mkdir(parents=True)
    (home / ".triton" / "cache" / "k.cubin").write_bytes(b"\x7fELF")
    env = _session_env(tmp_path, OUT=str(tmp_path / "out"), HOME=str(home), CUDA_VISIBLE_DEVICES="")
    (tmp_path / "out").mkdir()

    def deadline(budget, phases, **extra):
        r = _start({**env, **extra}, str(budget), phases)
        assert r.returncode == 0, r.stderr
        r = _watch({**env, **extra})
        assert "all phases ended" in r.stdout, r.stdout[-2000:]
        log = (tmp_path / "gs" / "phases.log").read_text()
        line = next(x for x in log.splitlines() if " e2e deadline " in x)
        return int(line.split()[3]), int(line.split()[5].strip("(")), log

    d, kept, log = deadline(1000, "e2e,kernels")  # kernels needs 160
    assert kept == 160 and 1000 - 160 - 30 - 15 <= d <= 1000 - 160 - 30, log
    assert log.index("e2e deadline") < log.index("jit caches: jit-cache.tar.gz")  # packed after e2e
    assert (tmp_path / "out" / "jit-cache.tar.gz.00").is_file()
    d, kept, log = deadline(1000, "e2e", FLASH_SESSION_E2E_MAX="700")  # nothing after: the cap
    assert (d, kept) == (700, 0), log
    d, kept, log = deadline(560, "e2e,kernels")  # 370 s would be under e2e's 420: e2e first, all but 30 s
    assert kept == 160 and 560 - 30 - 15 <= d <= 560 - 30, log


def test_a_budget_under_the_first_phases_floor_is_refused_and_e2e_starts_with_less_than_it_reserves(tmp_path):
    """2026-12-05: `start COMMIT 310 e2e` launched, then skipped e2e whole (420 s reserved for it)
    and spent the session's last call on nothing. Now e2e starts from its 240 s floor (the deadline
    logic gives it all but 30 s) and a budget under the first phase's floor is refused before launch."""
    env = _session_env(tmp_path, OUT=str(tmp_path), HOME=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    for budget, phases, says in (("200", "e2e", "a budget of 200 s is under what e2e needs to start (240 s)"),
                                 ("250", "recipe48,e2e", "recipe48 needs to start (300 s)"),
                                 ("210", "latency48", "latency48 needs to start (220 s)"),
                                 ("5m", "e2e", "BUDGET_S '5m': give whole seconds")):
        r = _start(env, budget, phases)
        assert r.returncode == 2 and says in r.stderr and not (tmp_path / "gs").exists(), r.stderr
    r = _start(env, "310", "e2e")
    assert r.returncode == 0, r.stderr
    _watch(env)
    log = (tmp_path / "gs" / "phases.log").read_text()
    assert "start e2e" in log and "skip e2e" not in log, log
    d = int(next(x for x in log.splitlines() if " e2e deadline " in x).split()[3])
    assert 310 - 30 - 15 <= d <= 310 - 30, log


def test_jit_returns_the_caches_mid_session_once_and_refuses_without_a_session(tmp_path):
    """`jit` packs what the caches hold now and returns it in parts (run2 of recipe48: the session's
    device time ended with its phase, so the end-of-phases pack never came back); `watch` does not
    return the same pack again."""
    home, out = tmp_path / "h", tmp_path / "out"
    (home / ".triton" / "cache" / "k1").mkdir(parents=True)
    (home / ".triton" / "cache" / "k1" / "kernel.cubin").write_bytes(b"\x7fELF" + os.urandom(4096))
    out.mkdir()
    env = {**_session_env(tmp_path, OUT=str(out)), "HOME": str(home)}
    r = subprocess.run(["bash", str(SCRIPT), "jit"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "no session" in r.stderr, r.stderr
    assert _start(env, "60", "none").returncode == 0
    end = time.monotonic() + 30
    while not (tmp_path / "gs" / "done").exists() and time.monotonic() < end:  # its own pack made first
        time.sleep(0.1)
    (home / ".triton" / "cache" / "k2").mkdir()  # compiled after the session started
    (home / ".triton" / "cache" / "k2" / "kernel.cubin").write_bytes(b"\x7fELF" + os.urandom(4096))
    r = subprocess.run(["bash", str(SCRIPT), "jit"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    parts = sorted(out.glob("jit-cache.tar.gz.*"))
    assert parts, r.stdout + r.stderr
    packed = subprocess.run(["tar", "tzf", "-"], input=b"".join(p.read_bytes() for p in parts), capture_output=True)
    assert {".triton/cache/k1/kernel.cubin", ".triton/cache/k2/kernel.cubin"} <= set(packed.stdout.decode().split())
    for p in parts:
        p.unlink()
    w = _watch(env, "60")
    assert w.returncode == 0 and "all phases ended" in w.stdout, w.stdout + w.stderr
    assert not list(out.glob("jit-cache.tar.gz.*"))  # returned once: `jit`'s pack is the newest


def test_latency48_runs_at_fewer_layers_with_a_set_as_the_next_session_will(tmp_path, monkeypatch):
    """The H100 plan's command (docs/GPU-E2E.md): latency48 on the 32-layer-style dirs with
    `LATENCY_ARGS="--set GPU_MEM=…"`, through the script, against bench_latency's stand-in server."""
    vllm_cli.install(tmp_path, monkeypatch, _test_constant("test_bench_latency.py", "FAKE_MAIN"))  # sets PYTHONPATH
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    env = _session_env(tmp_path, OUT=str(tmp_path / "out"), HOME=str(tmp_path), PATH=f"{bindir}:{os.environ['PATH']}",
                       FLASH_SESSION_PLE_ROWS="40000", RECIPE_LAYERS="4",
                       LATENCY_CONFIGS="stock,shared",
                       LATENCY_ARGS="--set GPU_MEM=0.7 --prefixes 256,1024 --tails 32 --prefill 3000 "
                                    "--itl-tokens 80 --repeats 1 --boot-timeout 120")
    (tmp_path / "out").mkdir()
    r = _start(env, "300", "latency48")  # under need()'s 500 s for three servers: started from its 220 s floor
    assert r.returncode == 0, r.stderr
    r = _watch(env)
    assert "all phases ended" in r.stdout, r.stdout[-2000:]
    log = (tmp_path / "gs" / "phases.log").read_text()
    assert "prepare48 rc=0" in log and "end latency48 rc=0" in log, log
    rows = [json.loads(x) for x in (tmp_path / "gs" / "decode" / "latency48.jsonl").read_text().splitlines()]
    booted = [r for r in rows if r.get("event") == "booted"]
    assert [r["label"] for r in booted] == ["stock", "shared"] and all(r["layers"] == 4 for r in rows)
    assert all(float(b["argv"][b["argv"].index("--gpu-memory-utilization") + 1]) == 0.7 for b in booted)
    assert {r["study"] for r in rows if "study" in r} == {"prefix", "itl"}


def test_profile48_runs_through_the_script_and_its_configs_are_checked_first(tmp_path, monkeypatch):
    """profile48 (lab/bench_profile.py) on the 4-layer dirs against its stand-in server, which writes
    a trace per profile: one row per scenario back in the session's decode/; a config typo in
    PROFILE_CONFIGS is refused at `start`, before any boot."""
    vllm_cli.install(tmp_path, monkeypatch, _test_constant("test_bench_profile.py", "FAKE_MAIN"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    env = _session_env(tmp_path, OUT=str(tmp_path / "out"), HOME=str(tmp_path), PATH=f"{bindir}:{os.environ['PATH']}",
                       FLASH_SESSION_PLE_ROWS="40000", RECIPE_LAYERS="4", PROFILE_CONFIGS="shared-25,stok")
    (tmp_path / "out").mkdir()
    r = _start(env, "300", "profile48")
    assert r.returncode == 2 and "'shared-25,stok'" in r.stderr and not (tmp_path / "gs").exists(), r.stderr
    env.update(PROFILE_CONFIGS="shared-25",
               PROFILE_ARGS="--set GPU_MEM=0.7 --scenarios mixed:1500,decode:2 --steps 20 --boot-timeout 120")
    r = _start(env, "300", "profile48")
    assert r.returncode == 0, r.stderr
    r = _watch(env)
    assert "all phases ended" in r.stdout, r.stdout[-2000:]
    log = (tmp_path / "gs" / "phases.log").read_text()
    assert "prepare48 rc=0" in log and "end profile48 rc=0" in log, log
    rows = [json.loads(x) for x in (tmp_path / "gs" / "decode" / "profile48.jsonl").read_text().splitlines()]
    assert [r["scenario"] for r in rows if r.get("study") == "profile"] == ["mixed:1500", "decode:2"]
    assert all(r["layers"] == 4 for r in rows)
    assert "execute_context_1(25)_generation_1(1)" in rows[1]["summary"]["classes"]
