#!/usr/bin/env python3
"""Where a step's time goes, per server, from vLLM's own torch profiler (issue 33's open "why"s):

- mixed:P  one stream decoding, then (ALONE steps into the profile) another client's P-token prompt:
  the steps that carry a piece of it beside the stream against the stream's steps alone, one trace. latency48 measured such a step at
  27-35 ms over idle whatever the piece's size (F in lab/decode/pieces.py, "host work between
  piecewise graphs": an inference); this splits F into GPU kernel families and host time.
- decode:C  C streams decoding: a decode step's kernels, stock against the recipe (the 3-6% at c >= 4
  on the H200 at 48 layers).
- prefill:P  one P-token prompt alone: its chunks' steps, stock against the recipe (the long-prompt
  TTFT 14-27% over stock's).

Each server is the one bench_recipe renders (`flash serve`'s RunSpec, the same substitutions) with
two more deviations, named in its booted row: `--profiler-config` (the worker's torch profiler into
the log directory, without Python stacks, no front-end trace) and VLLM_CUSTOM_SCOPES_FOR_PROFILING=1
(vLLM's sections of a step: preprocess, forward, postprocess, sample, draft, bookkeep). Per scenario: the load starts, then
POST /start_profile (a prefix naming the scenario; `--steps` engine steps, then the worker stops
by itself), POST /stop_profile, the trace is read (lab/decode/trace.py) into one raw row, and
removed unless --keep-traces (one is 20-200 MB). The profiler's own per-kernel table
(`*.profiler_out.txt`, vLLM's) stays beside the log. Profiling slows every launch: read shares and
differences between classes of one trace, not absolute step times. vLLM's async scheduling lets the
thread run up to a step ahead of the GPU: a GPU-bound step shows its wait as `sync_ms`, a host-bound
one as GPU idle; launches from another thread land `outside` every step (each trace's line says how
many GPU events did).

  run DIR --out RAW.jsonl [--configs stock,default,shared-25] [--scenarios mixed:8192,decode:1,…]
      [--steps N] [--set KEY=VALUE …] [--keep-traces]
  report RAW.jsonl… [--json J] [--png P] [--ref LABEL]   per server and class: the step's figures; each mixed
      class against its decode class; each class against the same class of the --ref server
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import threading
import time
from pathlib import Path

from lab import bench_latency as bl  # the streaming client
from lab import bench_recipe as br  # the servers
from lab.decode import client, trace

SCENARIOS = ("mixed", "decode", "prefill")
DEFAULT_SCENARIOS = "mixed:8192,decode:1,decode:8,prefill:6144"
STEPS = 60              # engine steps per profile: enough of each class for a median
LEAD = 16               # chunks a stream has before the profile starts (past its first steps)
ALONE = 10              # mixed: the stream's steps alone inside the profile before the prompt is sent
CAP = 16384             # a stream's tokens at most; it is closed once the scenario is done
WAIT_S = 600.0          # a scenario's longest wait for its chunks or its prompt
TRACE_WAIT_S = 300.0    # the trace file's longest wait after /stop_profile


def parse_scenarios(text: str) -> list[tuple[str, int]]:
    out = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        kind, _, n = word.partition(":")
        if kind not in SCENARIOS or not n.isascii() or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--scenarios {text!r}: {word!r} is not KIND:N with KIND one of {', '.join(SCENARIOS)} "
                             f"and N >= 1 (streams for decode, prompt tokens for mixed and prefill), e.g. {DEFAULT_SCENARIOS}")
        out.append((kind, int(n)))
    if not out or len(set(out)) < len(out):
        raise SystemExit(f"--scenarios {text!r}: give each KIND:N once, e.g. {DEFAULT_SCENARIOS}")
    return out


# vLLM's own record_function sections of a step, named in the trace (else a null context)
SCOPES = {"VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"}


def profiler_config(d: Path) -> str:
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(d.resolve()), "torch_profiler_with_stack": False,
                       "ignore_frontend": True, "torch_profiler_use_gzip": True}, separators=(",", ":"))


def with_profiler(spec: dict, d: Path) -> dict:
    """The rendered server with the worker's torch profiler writing into `d` (an absolute path)."""
    cfg = profiler_config(d)
    return {**spec, "argv": [*spec["argv"], "--profiler-config", cfg], "env": {**spec["env"], **SCOPES},
            "deviations": [*spec["deviations"], f"--profiler-config {cfg}: the worker's torch profiler (every launch slower)",
                           "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1: vLLM's step sections (preprocess, forward, sample, "
                           "draft, …) recorded"]}


def _post(url: str, path: str, body: dict | None = None) -> None:
    import requests

    r = requests.post(url + path, json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")


def _wait(cond, what: str, timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.005)


def _thread(fn, errors: list) -> threading.Thread:
    def run():
        try:
            fn()
        except Exception as exc:  # the main thread raises it after the join
            errors.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def drive(url: str, kind: str, n: int, steps: int, prefix: str, rng: random.Random) -> dict:
    """Run one scenario with the profile around its steady part; the client's side of it."""
    errors: list = []
    facts: dict = {}
    if kind == "prefill":
        _post(url, "/start_profile", {"profile_prefix": prefix})
        try:
            facts["ttft_s"] = bl.stream(url, bl.ids(rng, n), 1)["ttft_s"]
        finally:
            _post(url, "/stop_profile")
        return facts
    done = threading.Event()
    stamps: list[list[float]] = [[] for _ in range(n if kind == "decode" else 1)]
    # every prompt drawn here, in one order: the threads must not share the generator
    prompts = [bl.ids(rng, 64) for _ in stamps]
    long_prompt = bl.ids(rng, n) if kind == "mixed" else None
    streams = [_thread(lambda s=s, p=p: bl.stream(url, p, CAP, s, stop=done.is_set), errors) for s, p in zip(stamps, prompts)]
    prompt = None
    try:
        _wait(lambda: errors or all(len(s) >= LEAD for s in stamps), "the streams' first chunks")
        _post(url, "/start_profile", {"profile_prefix": prefix, "max_iterations": steps})
        mark = len(stamps[0])
        try:
            if kind == "mixed":  # the stream's own steps first, then the prompt's pieces beside it
                _wait(lambda: errors or len(stamps[0]) >= mark + ALONE, f"{ALONE} steps of the stream alone")

                def other():
                    facts["prompt_ttft_s"] = bl.stream(url, long_prompt, 1)["ttft_s"]
                prompt = _thread(other, errors)
            _wait(lambda: errors or len(stamps[0]) >= mark + steps + 2 or (prompt is not None and not prompt.is_alive()),
                  f"{steps} steps of {kind}:{n}")
        finally:
            _post(url, "/stop_profile")
        facts["chunks_in_profile"] = len(stamps[0]) - mark
        facts["prompt_done_in_profile"] = prompt is not None and not prompt.is_alive()
        if prompt is not None:
            prompt.join(WAIT_S)
    finally:
        done.set()
        for t in streams:
            t.join(WAIT_S)
    if errors:
        raise RuntimeError(f"{kind}:{n}: {errors[0]}")
    return facts


def _whole(p: Path) -> bool:
    """A gzip member read to its end checks its length and CRC (a file still being written fails);
    a plain trace must parse."""
    try:
        if p.name.endswith(".gz"):
            with gzip.open(p, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        else:
            json.loads(p.read_text())
        return True
    except (OSError, EOFError, ValueError):
        return False


def find_trace(d: Path, prefix: str, since: float, timeout: float = TRACE_WAIT_S) -> Path:
    """The newest `{prefix}_*.pt.trace.json.gz` written after `since`, once it reads whole (the
    worker writes it after the profile's last step, a large one over seconds)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = sorted((p for p in d.glob(f"{prefix}_*.pt.trace.json*") if p.stat().st_mtime >= since - 1),
                       key=lambda p: p.stat().st_mtime)
        if found:
            p = found[-1]
            size = p.stat().st_size
            time.sleep(0.5)
            if p.stat().st_size == size and _whole(p):
                return p
        time.sleep(1)
    raise RuntimeError(f"no readable {prefix}_*.pt.trace.json.gz in {d} after {timeout:.0f} s (vLLM 0.32+ names a "
                       "trace by /start_profile's profile_prefix; an older release by the rank alone)")


def run(args) -> int:
    d = Path(args.dir).resolve()
    meta = json.loads((d / "meta.json").read_text())
    configs = br._configs(args.configs)
    scenarios = parse_scenarios(args.scenarios)
    if args.steps < 4:
        raise SystemExit(f"--steps {args.steps}: give at least 4 (a class's median needs steps)")
    sink = client.jsonl_sink(args.out)
    logs = Path(args.logs or Path(args.out).parent).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    specs = br.render_all(configs, d, args.port, args.set)
    base = br.row_base(meta)
    failed = 0
    with br.exit_on_term():
        for name in configs:
            pdir = logs / f"profile-{name}"
            pdir.mkdir(exist_ok=True)

            with br.serving(with_profiler(specs[name], pdir), logs / f"profile-{name}.log", args.boot_timeout,
                            lambda row: sink({**base, **row, "label": name})) as srv:
                if srv is None:
                    failed += 1
                    continue
                rng = random.Random(7)
                bl.stream(srv.url, bl.ids(rng, 64), 8)  # untimed: the first request's one-time costs
                for kind, n in scenarios:
                    prefix = f"{kind}-{n}"
                    since = time.time()
                    facts = drive(srv.url, kind, n, args.steps, prefix, rng)
                    path = find_trace(pdir, prefix, since)
                    summary = trace.summarize(path)
                    sink({**base, "label": name, "study": "profile", "scenario": f"{kind}:{n}", "steps_asked": args.steps,
                          "client": facts, "trace_bytes": path.stat().st_size, "summary": summary})
                    if not args.keep_traces:
                        path.unlink()
    return 1 if failed else 0


# --- report ----------------------------------------------------------------------------------------

def decode_class(classes: dict, name: str) -> str | None:
    """The decode-only class a mixed class's stream ran alone: same generation part, no context."""
    m = trace.STEP.match(name)
    if not m or m[1] == "0":
        return None
    want = f"execute_context_0(0)_generation_{m[3]}({m[4]})"
    return want if want in classes else None


def report(rows: list[dict], ref: str | None = None) -> dict:
    """Per label: every class (merged over scenarios: a class seen in two keeps the one with more
    steps); each mixed class against its decode class; each class against --ref's same class."""
    by_label: dict[str, dict] = {}
    traces: dict[str, dict] = {}
    for r in rows:
        if r.get("study") != "profile":
            continue
        sm = r["summary"]
        traces.setdefault(r["label"], {})[r["scenario"]] = {
            k: sm[k] for k in ("steps", "gpu_events", "unlinked", "outside")} | {"trace_bytes": r.get("trace_bytes")}
        mine = by_label.setdefault(r["label"], {})
        for cname, c in r["summary"]["classes"].items():
            if cname not in mine or c["steps"] > mine[cname]["steps"]:
                mine[cname] = {**c, "scenario": r["scenario"]}
    out: dict = {}
    for label, cls in by_label.items():
        mixed = {}
        for cname in cls:
            base = decode_class(cls, cname)
            if base:
                mixed[cname] = {"against": base, **trace.delta(cls[base], cls[cname])}
        entry = {"traces": traces[label], "classes": cls, "mixed_vs_decode": mixed}
        if ref and ref in by_label and label != ref:
            entry["vs_ref"] = {cname: trace.delta(by_label[ref][cname], c) for cname, c in cls.items() if cname in by_label[ref]}
        out[label] = entry
    return out


def _top(d: dict, k: int = 5) -> str:
    items = sorted(d.items(), key=lambda kv: -abs(kv[1] or 0.0))[:k]
    return ", ".join(f"{n[:40]} {v:+.2f}" for n, v in items) or "none"


def lines(summary: dict) -> list[str]:
    out = []
    for label, e in summary.items():
        out.append(f"{label}:")
        for scen, t in e["traces"].items():
            out.append(f"  trace {scen}: {t['steps']} steps, {t['gpu_events']} GPU events in them ({t['unlinked']} by "
                       f"stream order), {t['outside']} outside every step")
        for cname, c in sorted(e["classes"].items(), key=lambda kv: (kv[1]["ctx_tokens"], kv[1]["gen_tokens"])):
            fams = ", ".join(f"{f} {v:.2f}" for f, v in sorted(c["by_family"].items(), key=lambda kv: -(kv[1] or 0))[:5])
            out.append(f"  {cname} ({c['scenario']}, {c['steps']} steps): period {c['period_ms']} ms, GPU busy "
                       f"{c['gpu_busy_ms']}, idle {c['idle_ms']}; launches eager {c['eager']} graphs {c['graphs']} "
                       f"({c['launch_ms']} ms), sync {c['sync_ms']} ms; {fams}")
        for cname, d in e["mixed_vs_decode"].items():
            f = d["figures"]
            out.append(f"  {cname} - {d['against']}: period {f.get('period_ms', 0):+.2f} ms = GPU busy "
                       f"{f.get('gpu_busy_ms', 0):+.2f} + idle {f.get('idle_ms', 0):+.2f}; eager launches "
                       f"{f.get('eager', 0):+.0f}, graphs {f.get('graphs', 0):+.0f}; families: {_top(d['by_family'])}; host "
                       f"sections: {_top(d['sections'], 4)}; host ops: {_top(d['top_host_ops'], 3)}")
        for cname, d in e.get("vs_ref", {}).items():
            f = d["figures"]
            out.append(f"  vs ref {cname}: period {f.get('period_ms', 0):+.2f} ms, GPU busy {f.get('gpu_busy_ms', 0):+.2f}; "
                       f"families: {_top(d['by_family'])}; kernels: {_top(d['top_kernels'], 3)}")
    return out


def plot(summary: dict, rows: list[dict], out: str | Path) -> None:
    """One horizontal bar per server and step class: the median step period, split into the GPU's
    busy time by kernel family (medians, scaled to the busy median so they add up) and the rest
    (the GPU idle: host work, waits), so a mixed class reads against its decode class above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(label, cname, c) for label, e in summary.items()
            for cname, c in sorted(e["classes"].items(), key=lambda kv: (kv[1]["ctx_tokens"], kv[1]["gen_tokens"]))
            if c.get("period_ms")]
    fams = sorted({f for _, _, c in bars for f in c["by_family"]})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(bars) + 1.6))
    for y, (label, cname, c) in enumerate(bars):
        total = sum(v or 0.0 for v in c["by_family"].values())
        scale = (c["gpu_busy_ms"] or 0.0) / total if total else 0.0
        x = 0.0
        for i, f in enumerate(fams):
            w = (c["by_family"].get(f) or 0.0) * scale
            ax.barh(y, w, left=x, color=f"C{i % 10}", label=f if y == 0 else None)
            x += w
        rest = max(0.0, c["period_ms"] - x)
        ax.barh(y, rest, left=x, color="lightgrey", hatch="//", label="GPU idle (host, waits)" if y == 0 else None)
        ax.annotate(f"{c['period_ms']:.1f} ms, eager {c['eager']:g}", (x + rest, y), va="center", fontsize=7,
                    xytext=(3, 0), textcoords="offset points")
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([f"{label}: {cname.removeprefix('execute_')}" for label, cname, _ in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("median step period (ms), profiled: every launch slower than unprofiled")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    layers = sorted({r["layers"] for r in rows if "layers" in r})
    gpus = sorted({r["gpu"] for r in rows if r.get("event") == "booted" and r.get("gpu")})
    ax.set_title(f"{'/'.join(map(str, layers))} layers, dummy weights, {', '.join(gpus) or 'GPU not named'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def report_cmd(args) -> int:
    rows = [json.loads(x) for f in args.files for x in Path(f).read_text().splitlines() if x.strip()]
    summary = report(rows, args.ref)
    if not summary:
        raise SystemExit(f"{', '.join(args.files)}: no profile rows (study 'profile')")
    if args.ref and args.ref not in summary:
        raise SystemExit(f"--ref {args.ref}: no profile rows of that label (have {', '.join(summary)})")
    print("\n".join(lines(summary)))
    if args.png:
        plot(summary, rows, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_profile", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("dir", help="bench_recipe.py prepare's directory")
    p.add_argument("--out", required=True)
    p.add_argument("--logs", help="server logs, the profiler's tables and (--keep-traces) traces; default: --out's directory")
    p.add_argument("--configs", default="stock,default,shared-25")
    p.add_argument("--scenarios", default=DEFAULT_SCENARIOS)
    p.add_argument("--steps", type=int, default=STEPS, help="engine steps profiled per scenario (prefill: the whole prompt)")
    p.add_argument("--port", type=int, default=18760)
    p.add_argument("--boot-timeout", type=float, default=900)
    p.add_argument("--keep-traces", action="store_true")
    br.add_set_option(p)
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    p.add_argument("--json")
    p.add_argument("--ref", help="the label every other server's classes are set against (e.g. stock)")
    p.add_argument("--png", help="the plot: each class's step period split into GPU kernel families and the GPU's idle rest")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else report_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
