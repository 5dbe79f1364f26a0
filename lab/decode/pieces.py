"""What a step that carries a prefill piece costs a decoding stream beside it: a model from the experts.

Each token a step runs picks TOPK of the EXPERTS routed experts in every MoE layer, so the step reads
the weights of every expert its tokens touch. With routing spread evenly (random weights route so;
a trained router is held near even over a batch by its balancing loss) t tokens touch on average a
share cov(t) = 1 - (1 - TOPK/EXPERTS)^t of the experts: 3 tokens (one stream, 1 + MTP 2) touch 6%,
25 tokens 39%, 100 tokens 86%, 400 tokens all of them. A step with a piece of n prompt tokens beside
that stream therefore costs

    step(n) = idle + F + E * (cov(n + 3) - cov(3)) + s * n      (n > 0; idle alone for n = 0)

- idle: the stream's own step (measured, the ITL bench's idle gaps);
- F: what any step carrying a prompt piece pays whatever the piece's size. vLLM 0.33 replays a FULL
  graph only for a batch of uniform decodes (FULL_AND_PIECEWISE: CudagraphDispatcher.dispatch); a
  batch with a piece gets the PIECEWISE graphs, and this model's splitting ops (its PLE short conv,
  QSA prepare and QSA, GDN core: CompilationConfig._attention_ops) run eagerly between them, in
  every layer. That F is that eager, host-paced work is a reading, not a measurement; it fits F
  varying between machines whose decode steps agree;
- E: reading every expert of every layer once;
- s: the work a prompt token adds once the experts are read (attention, GDN, the side layers).

E comes from the decode steps at c = 1, 4, 8 (3, 12, 24 tokens: each pair's step difference over its
coverage difference; the rest of what grows with c is charged to E, so it is an upper reading). F and
s are fitted, for each E, by least squares to a sweep of piece sizes measured beside a stream inside
CUDA graphs on the same machine in the same session. E is never below the experts' bytes at the
card's peak bandwidth; that floor is kept as a corner too. The corners give a range per piece size:
an estimate from the model, not a statistical interval.

F was not in the model committed before the sweep (9e32fb4: F = 0, s from one 800-token piece). That
model put the sweep's 100- and 200-token gaps at 22-29 and 28-35 ms; latency48 run3 measured 53 and
64 (benchmarks/latency48-h100/run3-32layers/piece-check-committed.txt), so F was added and fitted there.

The point of it: a piece costs at least F, and one that touches most experts at least F + E, whatever
its size. So the piece size at which the stream's gaps stay within a factor of its idle step is set
by (F + E) / idle; where F alone exceeds the idle step (the H100 at 32 layers) no piece does, and on a
card where reading the experts takes several idle steps (a GB10: ~68 GB at 273 GB/s) no piece that
finishes a long prompt in useful time gets there.

  python3 -m lab.decode.pieces [--json OUT] [--png PNG] [--check LATENCY_RAW.jsonl …]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lab.decode import model

ROOT = Path(__file__).resolve().parents[2]
STREAM_TOKENS = 1 + model.MTP     # one decoding stream's tokens in a step
PROMPT = 32768                    # the ITL bench's long prompt (bench_latency.PREFILL)
GOAL = 2.0                        # issue 33: p99 gap with `shared` <= 2x its idle p99
# each divides the 1,600-token block (a piece that does not gets cut at the block: docs/PREFIX-CACHE.md)
PIECES = (10, 25, 50, 100, 200, 400, 800, 8000)
CHUNK = 8000                      # `default`'s and stock's prefill step on 0.33: 8,192 down to the block

# The rows the H100 fit reads (32 of 48 layers, NVFP4 experts on HUMMING, random weights): one
# machine, one session (2026-12-07), so the mixed step's machine-to-machine spread stays out of the fit
DECODE_REPORT = "benchmarks/recipe48-h200/run6-h100-32layers/report.json"  # step_ms at c = 1, 4, 8
PIECE_RAW = "benchmarks/latency48-h100/run3-32layers/raw.jsonl"           # the sweep: each piece its argv says ran in graphs
# held out, each from another H100 machine: stock's 8,000-token chunks (run1), `shared`'s 800 (run2)
HELD_OUT = (("latency48 run1: stock, 8,000-token chunks", "benchmarks/latency48-h100/run1-32layers/report.json", "stock", 8000),
            ("latency48 run2: `shared`, 800-token pieces in graphs", "benchmarks/latency48-h100/run2-32layers/report.json",
             "shared-graphs", 800))
H100_LAYERS, H100_PEAK_GBS = 32, 3350.0

# The GB10 corners (assumptions, each said in the output)
GB10_BAND = "benchmarks/recipe48-h200/gb10-band.json"  # its idle c=1 step, 47-68 ms
GB10_GBS = 273.0
GB10_BW_FRACTION = (0.59, 1.0)         # the H100 fit's share of its peak (59-68%) .. the peak
# the Spark prefill published recipes measured at 8k-32k-token prompts (the anchor's 2,400-2,900, peers' 2,003-2,962)
GB10_PREFILL_TOK_S = (2000.0, 2962.0)
# A published Spark decode ladder, prose, aggregate tok/s at c = 1, 2, 4, 8 (a peer recipe's README,
# trained weights with MTP): per-stream acceptance cancels in c*step(1)/step(c), so the ladder's
# shape constrains E / idle. Two more peers' points are held out.
FIELD_LADDER = {1: 48.7, 2: 74.6, 4: 113.7, 8: 162.9}
FIELD_HELD_OUT = {"a second peer, prose, c=8": (54.4, 8, 207.0), "a third peer, code, c=4": (50.5, 4, 124.0)}


def coverage(tokens: float) -> float:
    """The expected share of the routed experts `tokens` tokens touch, routing spread evenly."""
    return 1.0 - (1.0 - model.TOPK / model.EXPERTS) ** tokens


def expert_gb(layers: int) -> float:
    """Every routed expert of `layers` layers in NVFP4, block scales included, in GB."""
    return layers * model.EXPERTS * 3 * model.HIDDEN * model.MOE_INTER * model.EXPERT_BYTES["nvfp4"] / 1e9


def step_ms(n: int, idle: float, e: float, s: float, fixed: float = 0.0, stream: int = STREAM_TOKENS) -> float:
    """A step with `n` prompt tokens beside `stream` decoding tokens (`fixed`: F, paid when n > 0)."""
    return idle + (fixed if n else 0.0) + e * (coverage(n + stream) - coverage(stream)) + s * n


def gap(n: int, corner: dict) -> float:
    """step_ms at a corner ({idle, e, s, fixed})."""
    return step_ms(n, corner["idle"], corner["e"], corner["s"], corner["fixed"])


def e_from_decode(steps: dict[int, float]) -> list[float]:
    """E read from each pair of adjacent concurrencies' decode steps ({c: ms}, c streams of
    STREAM_TOKENS tokens)."""
    cs = sorted(steps)
    return [(steps[b] - steps[a]) / (coverage(b * STREAM_TOKENS) - coverage(a * STREAM_TOKENS)) for a, b in zip(cs, cs[1:])]


def s_from_piece(e: float, n: int, gap: float, idle: float, fixed: float = 0.0) -> float:
    """s given E (and F), from one piece size's measured gap beside an idle-`idle` stream."""
    s = (gap - idle - fixed - e * (coverage(n + STREAM_TOKENS) - coverage(STREAM_TOKENS))) / n
    if s <= 0:
        raise ValueError(f"a {gap} ms step with {n} prompt tokens cannot read every expert in {e:.1f} ms "
                         f"(and pay {fixed:.1f} ms) beside a {idle} ms step")
    return s


def fit_fixed_and_s(e: float, points: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """F and s given E, by least squares over measured (piece, gap, idle) points, each kept >= 0;
    with the rms residual (ms). What is left of a gap once the idle step and the experts are taken
    out is F + s * n."""
    ys = [(n, g - idle - e * (coverage(n + STREAM_TOKENS) - coverage(STREAM_TOKENS))) for n, g, idle in points]
    if all(y <= 0 for _, y in ys):
        raise ValueError(f"gaps {[g for _, g, _ in points]} ms cannot read every expert in {e:.1f} ms")
    k = len(ys)
    mn, my = sum(n for n, _ in ys) / k, sum(y for _, y in ys) / k
    var = sum((n - mn) ** 2 for n, _ in ys)
    s = sum((n - mn) * (y - my) for n, y in ys) / var if var else 0.0
    fixed = my - s * mn
    if s < 0:          # a sweep whose gaps shrink with the piece: all of it is F
        s, fixed = 0.0, my
    elif fixed < 0:    # a line through the origin: all of it is per token
        fixed, s = 0.0, sum(n * y for n, y in ys) / sum(n * n for n, _ in ys)
    rms = math.sqrt(sum((fixed + s * n - y) ** 2 for n, y in ys) / k)
    return fixed, s, rms


def prompt_ms(n: int, c: dict, prompt: int = PROMPT) -> float:
    """The long prompt in pieces of `n` (the last one shorter), each step beside the stream: a prompt
    under steady traffic. vLLM 0.31+ cuts a prompt only while another request runs (PREFIX-CACHE.md);
    a prompt alone takes whole steps, and a bench stream that ends first leaves it so (latency48 run4)."""
    return (prompt // n) * gap(n, c) + (gap(prompt % n, c) if prompt % n else 0.0)


def predict(corners: list[dict], pieces=PIECES, prompt: int = PROMPT) -> list[dict]:
    """Per piece size, over the corners ({idle, e, s}): the step (= the stream's gap), the gap over
    the idle step, and the long prompt's time in pieces (its steps times the step)."""
    rows = []
    for n in pieces:
        steps = [gap(n, c) for c in corners]
        ratios = [st / c["idle"] for st, c in zip(steps, corners)]
        prompt_s = [prompt_ms(n, c, prompt) / 1000.0 for c in corners]
        rows.append({"piece": n, "gap_ms": _range(steps), "gap_over_idle": _range(ratios, 2),
                     "prompt_s": _range(prompt_s, 1)})
    return rows


def largest_piece(corners: list[dict], goal: float = GOAL, prompt: int = PROMPT) -> dict:
    """The largest piece whose gap stays within `goal` x idle, at the most and least favourable
    corner, with the long prompt's time at that piece."""
    def at(c: dict) -> int:
        n = 0
        while gap(n + 1, c) <= goal * c["idle"]:
            n += 1
        return n

    ns = [at(c) for c in corners]
    if not min(ns):   # a corner where not even one prompt token a step stays within the goal
        return {"goal": goal, "piece": [0, max(ns)], "prompt_s": None}
    return {"goal": goal, "piece": [min(ns), max(ns)],
            "prompt_s": _range([prompt_ms(n, c, prompt) / 1000.0 for n, c in zip(ns, corners)], 1)}


def _range(xs, nd: int = 1) -> list[float]:
    return [round(min(xs), nd), round(max(xs), nd)]


def _read(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text())


def h100_corners() -> tuple[list[dict], dict]:
    """The H100 (32 layers) corners: E from each decode pair of stock's and `default`'s steps and
    the bytes at peak, F and s fitted to the sweep's pieces for each E."""
    from lab.decode import recipe_report

    steps = _read(DECODE_REPORT)["step_ms"]
    sweep = pieces_in_graphs(recipe_report.load_rows([str(ROOT / PIECE_RAW)]))
    points = sorted((n, i["busy_p50_ms"], i["idle_p50_ms"]) for n, i in sweep.values())
    idle = sorted(i for _, _, i in points)[len(points) // 2]   # the sweep's median idle step
    es = {f"{cfg} c={a}->{b}": e
          for cfg in ("stock", "default")
          for (a, b), e in zip(((1, 4), (4, 8)), e_from_decode({c: steps[cfg][f"c={c} p=64"]["step"] for c in (1, 4, 8)}))}
    es["bytes at peak"] = expert_gb(H100_LAYERS) / H100_PEAK_GBS * 1000.0
    corners = []
    for k, e in es.items():
        fixed, s, rms = fit_fixed_and_s(e, points)
        corners.append({"from": k, "idle": idle, "e": e, "s": s, "fixed": fixed, "rms": rms})
    return corners, {"idle_p50_ms": idle, "points": [{"piece": n, "gap_p50_ms": g, "idle_p50_ms": i} for n, g, i in points],
                     "rms_ms": _range([c["rms"] for c in corners])}


def held_out(corners: list[dict]) -> list[dict]:
    """What the corners say of the runs on other H100 machines: the gap (p99 for stock's chunks,
    whose few gaps are all chunk steps; p50 for the pieces) and the 32k prompt's time, against the
    measured ones, at each run's own idle step. Only the decode-fitted corners: the bytes-at-peak
    one is a floor, not a reading."""
    out = []
    for case, rel, cfg, n in HELD_OUT:
        itl = _read(rel)[cfg]["itl"]
        idle = itl["idle_p50_ms"]
        fitted = [c | {"idle": idle} for c in corners if c["from"] != "bytes at peak"]
        measured = itl["busy_p99_ms"] if n == CHUNK else itl["busy_p50_ms"]
        out.append({"case": case, "piece": n, "predicted_gap_ms": _range([gap(n, c) for c in fitted]),
                    "measured_gap_ms": measured, "measured": "p99" if n == CHUNK else "p50", "measured_idle_p50_ms": idle,
                    # 0.33 cuts the 32k prompt into 8,000 x 4 and 768 (PREFIX-CACHE.md's table)
                    "predicted_prompt_s": _range([prompt_ms(n, c) / 1000.0 for c in fitted], 2),
                    "measured_prompt_s": itl["prefill_ttft_s"]})
    return out


def _gb10_idle_band() -> list[float]:
    """The GB10 band's c=1 step, [fast, slow] ms (recipe48's gb10-band.json, run1's row)."""
    return _read(GB10_BAND)["bands"][0]["gb10_step_ms"]


def _gb10_fixed(h100: list[dict]) -> tuple[float, float]:
    """F on a GB10 at 48 layers, assumed: none, up to the H100 fit's largest scaled from its 32
    layers (the eager ops run in every layer; the GB10's host is taken as no faster)."""
    return 0.0, max(c["fixed"] for c in h100 if c["from"] != "bytes at peak") * model.LAYERS / H100_LAYERS


def gb10_corners(fixeds: tuple[float, float]) -> list[dict]:
    """The GB10 (48 layers) corners, all assumptions: idle from the GB10 band, E from the experts'
    bytes at GB10_BW_FRACTION of 273 GB/s, F from `fixeds`, s from the published Spark prefill rates
    in CHUNK-token steps."""
    corners = []
    for idle in _gb10_idle_band():
        for frac in GB10_BW_FRACTION:
            e = expert_gb(model.LAYERS) / (GB10_GBS * frac) * 1000.0
            for rate in GB10_PREFILL_TOK_S:
                chunk_ms = CHUNK / rate * 1000.0
                for fixed in fixeds:
                    corners.append({"from": f"idle {idle} ms, {frac:.0%} of {GB10_GBS:.0f} GB/s, prefill {rate:.0f} tok/s, "
                                            f"F {fixed:.1f} ms", "idle": idle, "e": e, "fixed": fixed,
                                    "s": s_from_piece(e, CHUNK, chunk_ms + idle, idle, fixed)})
    return corners


def decode_step(c: int, corner: dict) -> float:
    """The decode step of c streams (3 tokens each) beside nothing: the idle step plus the experts the
    other streams' tokens add, plus their per-token work (s: an upper reading at short contexts)."""
    return corner["idle"] + corner["e"] * (coverage(c * STREAM_TOKENS) - coverage(STREAM_TOKENS)) + corner["s"] * STREAM_TOKENS * (c - 1)


def ladder(corner: dict, cs=(2, 4, 8)) -> dict[int, float]:
    """Aggregate throughput at c over c=1's: c * step(1) / step(c)."""
    return {c: c * decode_step(1, corner) / decode_step(c, corner) for c in cs}


def fit_e_to_ladder(idle: float, s: float, measured: dict[int, float] = FIELD_LADDER) -> tuple[float, float]:
    """The E (ms, to 0.1) whose ladder best matches the measured one in log terms, and the rms error."""
    want = {c: v / measured[1] for c, v in measured.items() if c != 1}

    def err(e: float) -> float:
        got = ladder({"idle": idle, "e": e, "s": s}, tuple(want))
        return math.sqrt(sum((math.log(got[c]) - math.log(w)) ** 2 for c, w in want.items()) / len(want))

    lo, hi = 1.0, 2000.0   # the error has one minimum in E (the ladder falls as E grows): golden section
    g = (math.sqrt(5) - 1) / 2
    while hi - lo > 0.01:
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if err(a) < err(b) else (a, hi)
    e = round((lo + hi) / 2, 1)
    return e, err(e)


def gb10_field_corners(fixeds: tuple[float, float] = (0.0, 0.0)) -> tuple[list[dict], dict]:
    """The GB10 corners narrowed by the field's ladder: for each prefill rate's s and each idle step
    in the band (0.1 ms apart), E fitted to the ladder, kept where it is no faster than the experts'
    bytes at the full 273 GB/s; the corners are the smallest and largest idle kept, per s, each with
    both ends of `fixeds` (F: no decode step pays it, so the ladder says nothing of it). s is read
    with F = 0 (gb10_corners reads it with F): at 8,000-token chunks F is ~1-2% of the step."""
    band = _gb10_idle_band()
    floor = expert_gb(model.LAYERS) / GB10_GBS * 1000.0
    corners, fits = [], []
    for rate in GB10_PREFILL_TOK_S:
        kept = []
        for i in range(round(band[0] * 10), round(band[1] * 10) + 1):
            idle, chunk_ms = i / 10, CHUNK / rate * 1000.0
            s = s_from_piece(floor, CHUNK, chunk_ms + idle, idle)
            e, rms = fit_e_to_ladder(idle, s)
            s = s_from_piece(e, CHUNK, chunk_ms + idle, idle)   # s again with the fitted E
            e, rms = fit_e_to_ladder(idle, s)
            fits.append({"prefill_tok_s": rate, "idle_ms": idle, "e_ms": e, "rms": rms})
            if e >= floor:
                kept.append({"from": f"idle {idle} ms, E fitted to the field's ladder ({e / idle:.2f} idle steps), prefill {rate:.0f} tok/s",
                             "idle": idle, "e": e, "s": s})
        if kept:
            corners += [k | {"fixed": f, "from": f"{k['from']}, F {f:.1f} ms"}
                        for k in ([kept[0], kept[-1]] if len(kept) > 1 else kept) for f in fixeds]
    held = {}
    for name, (one, c, at_c) in FIELD_HELD_OUT.items():
        got = [ladder(k, (c,))[c] for k in corners]
        held[name] = {"measured": round(at_c / one, 2), "predicted": _range(got, 2)}
    lad = [ladder(k) for k in corners]
    return corners, {"ladder_measured": {c: round(v / FIELD_LADDER[1], 2) for c, v in FIELD_LADDER.items() if c != 1},
                     "ladder_predicted": {c: _range([x[c] for x in lad], 2) for c in (2, 4, 8)},
                     "rms_log_error": _range([f["rms"] for f in fits if f["e_ms"] >= floor], 3),
                     "e_floor_ms": round(floor, 1),
                     "idle_kept_ms": _range([k["idle"] for k in corners]),
                     "held_out": held}


def build() -> dict:
    h100, fit = h100_corners()
    fixeds = _gb10_fixed(h100)
    gb10 = gb10_corners(fixeds)
    field, field_fit = gb10_field_corners(fixeds)
    return {
        "model": "step(n) = idle + F + E*(cov(n+3) - cov(3)) + s*n for n > 0, cov(t) = 1 - (1 - 10/512)^t: an estimate",
        "h100_32_layers": {"fit": fit, "corners": _rounded(h100), "pieces": predict(h100),
                           "within_goal": largest_piece(h100), "held_out": held_out(h100)},
        "gb10_48_layers": {"corners": _rounded(gb10), "pieces": predict(gb10), "within_goal": largest_piece(gb10),
                           "assumed": {"idle": GB10_BAND, "bw_fraction": list(GB10_BW_FRACTION),
                                       "prefill_tok_s": list(GB10_PREFILL_TOK_S), "fixed_ms": _range(fixeds)}},
        "gb10_48_layers_field": {"fit": field_fit, "corners": _rounded(field), "pieces": predict(field),
                                 "within_goal": largest_piece(field)},
    }


def _rounded(corners: list[dict]) -> list[dict]:
    return [{"from": c["from"], "idle_ms": round(c["idle"], 2), "e_ms": round(c["e"], 1), "fixed_ms": round(c["fixed"], 1),
             "s_ms_per_token": round(c["s"], 4)} for c in corners]


def piece_in_graphs(argv: list[str]) -> int | None:
    """The piece a server cut a long prompt into (its --long-prefill-token-threshold), where the step
    carrying it beside every seat ran inside CUDA graphs, read from the argv the server booted with
    (`flash plan`'s own reading, prefill.argv_capture_max): a raw row outlives the profile that made
    it (run2's `shared` had graphs to 48 tokens; today's to 832). None for no piece, a piece outside
    graphs (there a step pays the eager forward too: run2, 127 against 54 ms), or a stream of other
    than STREAM_TOKENS a step (the model's MTP 2)."""
    from flash_cli.plan import prefill

    ap = argparse.ArgumentParser(add_help=False)
    for flag in ("--long-prefill-token-threshold", "--max-num-seqs", "--max-num-batched-tokens"):
        ap.add_argument(flag, type=int)
    ap.add_argument("--speculative-config")
    a, _ = ap.parse_known_args(argv)
    if not a.long_prefill_token_threshold or a.max_num_seqs is None or a.max_num_batched_tokens is None:
        return None
    mtp = json.loads(a.speculative_config).get("num_speculative_tokens", 0) if a.speculative_config else 0
    if 1 + mtp != STREAM_TOKENS:
        return None
    graphs = prefill.argv_capture_max(argv, a.max_num_seqs, mtp, a.max_num_batched_tokens)
    piece = a.long_prefill_token_threshold
    return piece if graphs is not None and piece + a.max_num_seqs * STREAM_TOKENS <= graphs else None


def pieces_in_graphs(rows: list[dict]) -> dict[str, tuple[int, dict]]:
    """{server: (its piece, its ITL summary from bench_latency's report)} for each server of a latency
    run's raw rows that measured a stream beside pieces run inside graphs (`piece_in_graphs` on its
    `booted` row's argv): what the fit reads and what `check` holds to the prediction."""
    from lab import bench_latency

    booted = {r["label"]: r["argv"] for r in rows if r.get("event") == "booted" and r.get("argv")}
    out = {}
    for cfg, res in bench_latency.report(rows).items():
        itl = res.get("itl") or {}
        piece = piece_in_graphs(booted[cfg]) if itl.get("busy_p50_ms") is not None and cfg in booted else None
        if piece is not None:
            out[cfg] = (piece, itl)
    return out


def check(rows: list[dict], prediction: dict) -> list[dict]:
    """A latency run's raw rows (bench_latency's) against the H100 prediction: for each server
    `pieces_in_graphs` takes, the measured p50 gap inside the predicted range or not. The prediction
    is for 32 layers on an H100; a run on another card or depth is not comparable."""
    table = {r["piece"]: r["gap_ms"] for r in prediction["h100_32_layers"]["pieces"]}
    out = []
    for cfg, (piece, itl) in pieces_in_graphs(rows).items():
        if piece not in table:   # a piece the committed prediction has no row for: the same model, asked now
            table[piece] = predict(h100_corners()[0], pieces=(piece,))[0]["gap_ms"]
        lo, hi = table[piece]
        out.append({"config": cfg, "piece": piece, "predicted_gap_ms": [lo, hi], "measured_gap_p50_ms": itl["busy_p50_ms"],
                    # the range is rounded to 0.1 ms: half of that either side belongs to it
                    "inside": lo - 0.05 <= itl["busy_p50_ms"] <= hi + 0.05, "p99_over_idle_p99": itl.get("p99_ratio")})
    return out


def plot(pred: dict, path: Path) -> None:
    """The trade-off as a picture: the gap over the idle step, and the long prompt's time, against
    the piece size, each card's range as a band; the measured H100 points on top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, colour in (("h100_32_layers", "H100, 32 layers (fitted)", "tab:blue"),
                               ("gb10_48_layers", "GB10, 48 layers (assumed)", "tab:red"),
                               ("gb10_48_layers_field", "GB10, narrowed by a Spark decode ladder", "tab:green")):
        rows = pred[key]["pieces"]
        n = [r["piece"] for r in rows]
        for ax, field in ((left, "gap_over_idle"), (right, "prompt_s")):
            ax.fill_between(n, [r[field][0] for r in rows], [r[field][1] for r in rows], alpha=0.3, color=colour, label=label)
    fit, held = pred["h100_32_layers"]["fit"], pred["h100_32_layers"]["held_out"]
    pts = fit["points"]
    left.plot([x["piece"] for x in pts], [x["gap_p50_ms"] / x["idle_p50_ms"] for x in pts], "o", color="tab:blue",
              label="measured: run3's sweep, in graphs (fit)")
    for h, mark in zip(held, "sD"):
        left.plot([h["piece"]], [h["measured_gap_ms"] / h["measured_idle_p50_ms"]], mark, color="black",
                  label=f"held out, {h['case']}")
        right.plot([h["piece"]], [h["measured_prompt_s"]], mark, color="black")
    left.axhline(GOAL, ls="--", color="grey", label=f"issue 33's goal, {GOAL:g}x idle")
    left.set(xscale="log", yscale="log", xlabel="prompt tokens in a step (LONG_PREFILL)", ylabel="stream's gap / its idle step")
    right.set(xscale="log", yscale="log", xlabel="prompt tokens in a step (LONG_PREFILL)", ylabel=f"a {PROMPT}-token prompt, s")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.suptitle("A stream beside a long prompt cut into pieces: expert-coverage model (an estimate)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m lab.decode.pieces", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the prediction here")
    p.add_argument("--png", type=Path, help="draw the trade-off here")
    p.add_argument("--check", type=Path, nargs="*", default=[],
                   help="bench_latency raw.jsonl files (a run's rows, argv included) to hold against it")
    a = p.parse_args(argv)
    pred = build()
    parts = (("H100, 32 layers", pred["h100_32_layers"]), ("GB10, 48 layers (assumed)", pred["gb10_48_layers"]),
             ("GB10, 48 layers (narrowed by the field's decode ladder)", pred["gb10_48_layers_field"]))
    for name, part in parts:
        print(f"{name}: a stream's gap beside a piece of n prompt tokens (range over {len(part['corners'])} corners)")
        for r in part["pieces"]:
            print(f"  n={r['piece']:>5}: gap {r['gap_ms'][0]:>7.1f}-{r['gap_ms'][1]:<7.1f} ms  "
                  f"{r['gap_over_idle'][0]:>5.2f}-{r['gap_over_idle'][1]:<5.2f}x idle  "
                  f"a {PROMPT}-token prompt {r['prompt_s'][0]}-{r['prompt_s'][1]} s")
        w = part["within_goal"]
        if w["prompt_s"] is None:
            print(f"  within {w['goal']}x idle: pieces of {w['piece'][0]}-{w['piece'][1]} tokens: at some corner none, "
                  f"not one prompt token a step")
        else:
            print(f"  within {w['goal']}x idle: pieces of {w['piece'][0]}-{w['piece'][1]} tokens; "
                  f"the prompt then takes {w['prompt_s'][0]}-{w['prompt_s'][1]} s")
    fit = pred["h100_32_layers"]["fit"]
    print(f"H100 fit: F {_range([c['fixed_ms'] for c in pred['h100_32_layers']['corners']])} ms, s "
          f"{_range([c['s_ms_per_token'] for c in pred['h100_32_layers']['corners']], 4)} ms/token over pieces "
          f"{[x['piece'] for x in fit['points']]} (rms residual {fit['rms_ms']} ms)")
    for h in pred["h100_32_layers"]["held_out"]:
        print(f"held out, {h['case']}: gap {h['predicted_gap_ms']} ms predicted, {h['measured']} {h['measured_gap_ms']} "
              f"measured; prompt {h['predicted_prompt_s']} s predicted, {h['measured_prompt_s']} measured")
    f = pred["gb10_48_layers_field"]["fit"]
    print(f"field ladder c=2/4/8 over c=1: measured {f['ladder_measured']}, predicted {f['ladder_predicted']} "
          f"(rms log error {f['rms_log_error']}); idle kept {f['idle_kept_ms']} ms (E no faster than {f['e_floor_ms']} ms); "
          + "; ".join(f"held out, {k}: {v['measured']} measured, {v['predicted']} predicted" for k, v in f["held_out"].items()))
    checked = []
    for path in a.check:
        from lab.decode import recipe_report

        for r in check(recipe_report.load_rows([str(path)]), pred):
            checked.append({"report": str(path), **r})
            print(f"{path}: {r['config']} (piece {r['piece']}): p50 gap {r['measured_gap_p50_ms']} ms, predicted "
                  f"{r['predicted_gap_ms']}: {'inside' if r['inside'] else 'OUTSIDE'}")
    if a.png:
        plot(pred, a.png)
    if a.json:
        a.json.write_text(json.dumps(pred | ({"checked": checked} if checked else {}), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
