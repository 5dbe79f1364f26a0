"""Property-based fuzzing of every parser that reads outside input (issue 14).

Parsers: settings values, K=V arguments and layered resolve, profile files; safetensors headers
and index JSON; the Prometheus text the gates (prometheus_client) and `flash status` (line
reader) read; the OpenAI SSE stream; the boot-log line and container label `flash status`
parses, and Docker's multiplexed log stream. Property for each: on any input it returns a value
or raises its own documented error type whose message names the bad input. Anything else (a
crash) fails.

A few hundred cases per parser in the unit tier (derandomized: the same cases on every run);
`tests/run fuzz` (FLASH_FUZZ_EXAMPLES=10000, random) is the long run, and FLASH_FUZZ_REPORT=path
writes the number of cases each parser saw (benchmarks/fuzz/README.md).
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st

from flash_cli import api, kvline, profiles
from flash_cli.commands.status import plan_comparison
from flash_cli.engine_read import demux
from flash_cli.errors import ConfigError
from flash_cli.gates import metrics
from flash_cli.gates.client import Stream, StreamError, feed_sse_line
from flash_cli.settings import SETTINGS, parse_assignments, resolve

from flash_common import stheader as header

pytestmark = pytest.mark.fuzz
N = int(os.environ.get("FLASH_FUZZ_EXAMPLES", "300"))
FUZZ = hsettings(max_examples=N, deadline=None, database=None, derandomize=N <= 1000,
                 suppress_health_check=list(HealthCheck))
COUNTS: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    out = os.environ.get("FLASH_FUZZ_REPORT")
    if out:
        old = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
        old.update(COUNTS)
        Path(out).write_text(json.dumps(dict(sorted(old.items())), indent=1) + "\n")


def names_input(msg: str, *pieces: str) -> bool:
    """The message names the bad input: one of the pieces (or its repr, possibly cut) is in it."""
    for p in pieces:
        if p is None:
            continue
        r = repr(p)
        if (p and p in msg) or r in msg or r[:60] in msg:
            return True
    return False


text = st.text(st.characters(codec="utf-8"), max_size=80)
junk = st.one_of(text, st.sampled_from(["", " ", "nan", "inf", "-inf", "1e309", "9" * 400, "0x10", "1_000", "٣",
                                          "127.0.0.1", "::1", "256.1.1.1", "16G", "1.5t", "5.5.5", "\x00", "'", '"']))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | text,
                           lambda kids: st.lists(kids, max_size=4) | st.dictionaries(text, kids, max_size=4),
                           max_leaves=12)


# --- settings, K=V arguments, profiles ---------------------------------------------------------

BY = {s.name: s for s in SETTINGS}


# the crashes fuzzing found, kept as fixed cases
@example(BY["SHM_SIZE"], "9" * 400)  # float() → inf → int() raised OverflowError
@example(BY["NODES"], "@,")  # 10,000-case run: the message named the entry '@', not the value typed
@example(BY["PARALLEL"], "0 ")  # the parsers strip blanks first: naming the stripped value names the input
@example(BY["NODES"], " \u00a1")
@FUZZ
@given(st.sampled_from(SETTINGS), junk)
def test_fuzz_setting_values(setting, raw):
    COUNTS["settings: one value per setting"] += 1
    try:
        setting.parse(raw)
    except ConfigError as exc:
        assert setting.name in str(exc) and names_input(str(exc), raw, raw.strip()), str(exc)
        assert exc.hint and setting.name in exc.hint


@FUZZ
@given(st.lists(st.one_of(junk, st.builds(lambda k, v: f"{k}={v}", st.sampled_from([s.name for s in SETTINGS]) | text,
                                           junk)), max_size=5))
def test_fuzz_kv_arguments_and_resolve(words):
    COUNTS["K=V arguments + resolve"] += 1
    try:
        resolve(overrides=parse_assignments(words, "argument"))
    except ConfigError as exc:
        assert any(names_input(str(exc), w.partition("=")[0], w) for w in words), str(exc)


profile_lines = st.one_of(
    junk, st.builds(lambda k, v: f"{k}={v}", st.sampled_from([s.name for s in SETTINGS]) | text, junk),
    st.builds(lambda t, v: f"# {t}: {v}", st.sampled_from(["desc", "base"]), junk))


@example(["SHM_SIZE=" + "9" * 400])
@FUZZ
@given(st.lists(profile_lines, max_size=8))
def test_fuzz_profile_files(lines):
    COUNTS["profile files (+ resolve)"] += 1
    path = Path("/profiles/fuzz.env")
    try:
        prof = profiles.parse("\n".join(lines), "fuzz", path)
        resolve(prof.layer(), profile_name=prof.name)
    except ConfigError as exc:
        assert any(names_input(str(exc), ln.strip(), ln.strip().partition("=")[0].strip(), ln.partition(":")[2].strip())
                   for ln in "\n".join(lines).splitlines()), str(exc)


# --- safetensors headers and index JSON ---------------------------------------------------------

DTYPES = ["F8_E4M3", "BF16", "F16", "F32", "I64", "U8", "BOOL", "F4", "X9", ""]


@st.composite
def header_objects(draw):
    obj = {}
    pos = 0
    for i in range(draw(st.integers(0, 4))):
        shape = draw(st.lists(st.integers(-2, 6), max_size=3))
        n = 1
        for d in shape:
            n *= max(d, 0)
        end = pos + n * 2 + draw(st.sampled_from([0, 0, 0, 1, -1, 7]))
        obj[draw(text) if draw(st.booleans()) else f"t{i}"] = draw(st.one_of(
            st.just({"dtype": draw(st.sampled_from(DTYPES)), "shape": shape, "data_offsets": [pos, end]}),
            json_values))
        pos = max(end, 0)
    if draw(st.booleans()):
        obj["__metadata__"] = draw(st.one_of(st.dictionaries(text, text, max_size=3), json_values))
    return obj, pos


@FUZZ
@given(st.one_of(st.binary(max_size=200).map(lambda b: (b, len(b) + 8 + 64)),
                 header_objects().flatmap(lambda hp: st.tuples(
                     st.just(json.dumps(hp[0]).encode()), st.integers(0, 64).map(lambda extra: hp[1] + extra))),
                 ))
def test_fuzz_safetensors_header(case):
    COUNTS["safetensors header"] += 1
    raw, data_len = case
    try:
        h = header.parse_header(raw, file_size=8 + len(raw) + max(data_len - len(raw) - 8, 0), source="fuzz.safetensors")
    except header.HeaderError as exc:
        assert str(exc).startswith("fuzz.safetensors: ") and exc.problem, str(exc)
    else:
        for t in h.tensors.values():
            assert t.nbytes >= 0


@FUZZ
@given(st.one_of(st.binary(max_size=120),
                 st.dictionaries(st.sampled_from(["weight_map", "metadata", "x"]),
                                 st.one_of(json_values, st.dictionaries(text, st.one_of(text, json_values,
                                           st.sampled_from(["../x", "/etc/passwd", "a/../../b", "ok.safetensors",
                                                            "a\\..\\..\\b", "x\x00y"])), max_size=4)),
                                 max_size=3).map(lambda d: json.dumps(d).encode())))
def test_fuzz_index_json(tmp_path_factory, raw):
    COUNTS["safetensors index JSON"] += 1
    d = tmp_path_factory.mktemp("idx", numbered=True)
    (d / "model.safetensors.index.json").write_bytes(raw)
    try:
        wm = header.read_index(d)
    except header.HeaderError as exc:
        assert "model.safetensors.index.json" in str(exc) and exc.problem, str(exc)
    else:
        for fname in wm.values():
            assert ".." not in fname.replace("\\", "/").split("/") and not fname.startswith("/")
    from flash_cli import hfcache  # the host's own reader of the same file: never crashes either

    hfcache.missing_files(d)


# --- Prometheus text (gates: prometheus_client; status: the line reader) -----------------------

prom_lines = st.one_of(
    text,
    st.builds(lambda n, l, v: f"{n}{l} {v}", st.sampled_from(["vllm:num_requests_running", "vllm:prompt_tokens_total",
                                                             "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                                             "a", "9bad", ""]) | text,
              st.sampled_from(["", "{}", '{a="b"}', '{a="b c"}', "{a=b}", "{", '{a="\\x"}', '{position="0"}',
                               '{position="1",a="}"}', '{position="²"}', '{position="01"}', '{position=""}']) | text,
              junk),
    st.builds(lambda k, n, t: f"# {k} {n} {t}", st.sampled_from(["TYPE", "HELP", "UNIT", "EOF"]),
              st.sampled_from(["vllm:prompt_tokens", "x"]) | text,
              st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped", "info", "bogus"]) | text))


@example("vllm:num_requests_running " + "9" * 400)  # int too large for float() in the gates' parser
@FUZZ
@given(st.lists(prom_lines, max_size=8).map("\n".join))
def test_fuzz_prometheus_text(body):
    COUNTS["Prometheus text (gates + status)"] += 1
    try:
        snap = metrics.parse(body)
    except metrics.MetricsError as exc:
        assert str(exc).startswith("not Prometheus text format") and names_input(str(exc), *body.split("\n")), str(exc)
    else:
        snap.total("vllm:num_requests_running")
    sums = api.metric_sums(body, ("vllm:num_requests_running", "vllm:prompt_tokens_total", "a"))
    assert all(isinstance(v, float) for v in sums.values())
    from flash_cli.commands.status import mtp_by_position  # the per-position reader never crashes status

    per_pos = api.metric_by_label(body, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert all(isinstance(v, float) for v in per_pos.values())
    got = mtp_by_position(body, drafts=7.0)
    assert not got or len(got["mtp_acceptance_per_position"]) == len(got["mtp_tokens_per_step_by_depth"])


# --- the SSE stream ----------------------------------------------------------------------------

sse_lines = st.one_of(
    text, st.just("data: [DONE]"),
    json_values.map(lambda v: "data: " + json.dumps(v)),
    st.fixed_dictionaries({}, optional={"choices": st.one_of(json_values, st.lists(st.one_of(json_values, st.fixed_dictionaries(
        {}, optional={"text": json_values, "delta": st.one_of(json_values, st.fixed_dictionaries({}, optional={
            "content": json_values, "reasoning_content": json_values})), "finish_reason": json_values})), max_size=3)),
        "usage": json_values}).map(lambda v: "data: " + json.dumps(v)),
)


@example(["data: 5"])  # a JSON scalar: .get on it raised AttributeError in the gates
@example(['data: {"choices": [{"delta": {"content": 1}}]}'])  # str + int raised TypeError
@FUZZ
@given(st.lists(sse_lines, max_size=6))
def test_fuzz_sse_stream(lines):
    COUNTS["SSE stream"] += 1
    out = Stream(200, sent=0.0)
    for line in lines:
        try:
            if feed_sse_line(line, out, now=1.0):
                break
        except StreamError as exc:
            assert str(exc).startswith("bad SSE line ") and names_input(str(exc), line), str(exc)
            break
    assert all(isinstance(p, str) and p for p in out.pieces)
    assert isinstance(out.completion_tokens, int)


# --- boot logs, labels and the Docker log stream that `flash status` parses -------------------

@example("GPU KV cache size: , tokens", None)  # int('') raised ValueError in `flash status`
@example("", '{"tokens": Infinity, "lo": 1, "hi": 2}')  # int(inf) raised OverflowError
@example("", '{"tokens": "abc", "lo": 1, "hi": 2}')  # ValueError without the label in it
@FUZZ
@given(st.one_of(text, st.builds(lambda a, b: f"{a}GPU KV cache size: {b} tokens", text,
                                 st.sampled_from(["0", "1,234", ",", ",,", "9" * 400, "-5", "1,2,3"]) | text)),
       st.one_of(st.none(), text, json_values.map(json.dumps),
                 st.fixed_dictionaries({"tokens": json_values, "lo": json_values, "hi": json_values},
                                       optional={"hardware": json_values}).map(json.dumps)))
def test_fuzz_boot_log_line_and_kv_label(line, label):
    COUNTS["boot log KV line + kv-plan label"] += 1
    assert isinstance(kvline.compare(1000, 900, 1100, line), str)
    if label is not None:
        try:
            kvline.parse_prediction(label)
        except ValueError as exc:
            assert names_input(str(exc), label), str(exc)
    out = plan_comparison({"org.flash.kv-plan": label} if label else {}, line)
    assert out is None or isinstance(out, str)


@FUZZ
@given(st.one_of(st.binary(max_size=200),
                 st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=20), st.integers(-3, 3)), max_size=5).map(
                     lambda frames: b"".join(struct.pack(">BxxxI", s, max(len(b) + d, 0)) + b for s, b, d in frames))))
def test_fuzz_docker_log_stream(raw):
    COUNTS["Docker multiplexed log stream"] += 1
    assert isinstance(demux(raw), bytes)


# --- the whole `flash serve --dry-run` path (issue 34) ---------------------------------------------
# resolve → spec (one box, or a deployment's boxes and pd's router) → render (docker run text, the
# vllm argv; --json: the specs as data), through the CLI's own main(). Values are drawn half from
# what each setting accepts (so cases get past validation and reach the render) and half hostile
# (junk above, plus control characters, over-long values, NODES forms). Property: main returns an
# exit code (0, or 2 with "Error: …" naming a word) and never raises; a traceback fails the test.

def _valid_value(s) -> st.SearchStrategy:
    if s.kind == "bool":
        return st.sampled_from(["0", "1", "true", "off"])
    if s.kind == "choice":
        return st.sampled_from([c for c in s.choices])
    if s.kind == "int":
        lo = int(s.minimum) if s.minimum is not None else -5
        hi = int(s.maximum) if s.maximum is not None else lo + 10**6
        return st.integers(lo, hi).map(str)
    if s.kind == "float":
        lo = s.minimum if s.minimum is not None else -1e6
        hi = s.maximum if s.maximum is not None else lo + 1e6
        return st.floats(lo, hi, allow_nan=False).map(repr)
    if s.kind == "size":
        return st.sampled_from(["16G", "512m", "1073741824", "0", "1t"])
    if s.kind == "host":
        return st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "::", "10.0.0.1", "fd00::1"])
    if s.pattern:
        return st.from_regex(s.pattern, fullmatch=True).filter(lambda v: len(v) <= 300)
    return text


hostile = st.one_of(junk, st.sampled_from(["a" * 5000, "x\x00y", "--x\nExecStart=/bin/sh", "\x1b[2J", "\udcff",
                                            "h:1:2,localhost", "a,,b", "http://h:2375,b", "a,a", "tcp://h:2375,b",
                                            "me@spark2:22,localhost", "1e309", "-0", "1" * 25]))
# one value in five hostile: most cases then get past validation to the render
# PARALLEL comes from MULTI's coherent deployments (a lone PARALLEL=tp2 only ever says "needs NODES")
serve_words = st.lists(st.sampled_from([s for s in SETTINGS if s.name != "PARALLEL"]).flatmap(
    lambda s: st.integers(0, 4).flatmap(lambda i: hostile if i == 0 else _valid_value(s)).map(
        lambda v, n=s.name: f"{n}={v}")), max_size=6)
MULTI = [[], [], ["PARALLEL=tp2", "NETWORK=host", "NODES=localhost,localhost", "NODE_ADDRS=127.0.0.1,127.0.0.1"],
         ["PARALLEL=dp2", "NETWORK=host", "NODES=a,me@b:2222", "NODE_ADDRS=10.0.0.1,10.0.0.2"],
         ["PARALLEL=pd", "NETWORK=host", "NODES=localhost,tcp://10.0.0.2:2375", "NODE_ADDRS=10.0.0.1,10.0.0.2"],
         ["PARALLEL=pd", "NETWORK=host", "NODES=localhost,localhost", "NODE_ADDRS=127.0.0.1,127.0.0.1"],
         ["PARALLEL=tp4ep", "NETWORK=host", "NODES=a,b,me@c,d:2222", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4"],
         ["PARALLEL=pd3", "NETWORK=host", "NODES=localhost,b,c", "NODE_ADDRS=10.0.0.1,10.0.0.2,10.0.0.3"],
         ["PARALLEL=pp3", "NETWORK=host", "NODES=localhost,localhost,localhost",
          "NODE_ADDRS=127.0.0.1,127.0.0.1,127.0.0.1"]]  # coherent deployments
SERVE_RC = Counter()


@FUZZ
@given(st.sampled_from(profiles.names()), serve_words, st.sampled_from(MULTI), st.booleans())
def test_fuzz_serve_dry_run_path(profile, words, multi, as_json):
    from flash_cli.__main__ import main

    COUNTS["serve --dry-run: resolve → spec → render"] += 1
    parallel = profiles.load(profile).layer().get("PARALLEL", "none")
    if not multi and parallel != "none":  # a multi-node profile: its boxes (else it only ever says "needs NODES")
        from flash_cli import layout

        n = layout.parse(parallel).boxes
        multi = [f"NODES={','.join(['localhost'] * n)}", f"NODE_ADDRS={','.join(['127.0.0.1'] * n)}"]
    argv = ["serve", profile, *multi, *words, "--dry-run", *(["--json"] if as_json else [])]
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)  # anything but a FlashError propagates out of main: a crash fails here
    SERVE_RC[rc] += 1
    COUNTS[f"serve --dry-run: exit {rc}"] += 1
    assert rc in (0, 2), (argv, rc, err.getvalue()[-500:])
    if rc == 0:
        assert out.getvalue().strip(), argv  # something was rendered
        if as_json:
            json.loads(out.getvalue())
    else:
        e = err.getvalue()
        assert e.startswith("Error: ") and "\nhint: " in e, e
