"""`flash test` against the real stand-in server over HTTP: all green on a faithful server, and
each fault switch makes exactly the check that should catch it fail (and nothing else)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flash_cli.__main__ import main
from flash_cli.gates import checks, metrics, prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standin"))
from harness import StandIn  # noqa: E402

pytestmark = pytest.mark.timeout(120)
# small prompts and answers keep the suite fast; the thresholds stay the shipped defaults
FAST = ["TEST_PREFILL_TOKENS=1024", "TEST_DECODE_TOKENS=32", "TEST_DET_TOKENS=8", "TEST_DET_RUNS=2"]


def flash_test(capsys, url: str, *extra: str) -> tuple[int, dict]:
    profile = [w for w in extra[:1] if "=" not in w and not w.startswith("-")]  # a profile comes first
    words = [w for w in extra if "=" in w and not w.startswith("-")]
    opts = [w for w in extra if w not in words and w not in profile]
    rc = main(["test", *profile, *FAST, *words, "--url", url, "--json", *opts])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def test_faithful_server_passes_every_check(capsys):
    with StandIn("--reasoning-parser", "qwen3", env={"VLLM_PLE_MMAP": "1"}) as s:
        rc, report = flash_test(capsys, s.url)
    assert rc == 0 and report["ok"] is True
    assert [c["name"] for c in report["checks"]] == list(checks.CHECK_NAMES)
    by = {c["name"]: c for c in report["checks"]}
    # a URL needs no profile; without one there is no recipe to compare the context with: N/A, visibly
    assert by.pop("context")["status"] == "skip" and "N/A" in report["checks"][2]["detail"]
    assert {c["status"] for c in by.values()} == {"pass"}, report
    assert "PLE counters: 8/8" in by["metrics"]["detail"]
    assert by["prefix_cache"]["data"]["method"] == "metrics"
    assert by["prefill"]["data"]["prompt_tokens"] > 900


@pytest.mark.parametrize("fault, check", [
    ("nondeterministic", "determinism"),
    ("no_prefix_hits", "prefix_cache"),
    ("reject_high_effort", "effort"),
    ("no_tool_calls", "tool_call"),
    ("slow", "decode"),
    ("frozen_counters", "metrics"),
])
def test_each_fault_fails_exactly_its_check(capsys, fault, check):
    with StandIn(faults=fault) as s:
        rc, report = flash_test(capsys, s.url)
    st = statuses(report)
    assert rc == 1 and report["ok"] is False
    assert [n for n, v in st.items() if v == "fail"] == [check], report
    assert report["summary"]["failed_required"] == [check]
    assert st.pop("context") == "skip"  # --url without a recipe: N/A
    assert all(v == "pass" for n, v in st.items() if n != check)


def test_without_metrics_prefix_cache_falls_back_to_timing_and_says_so(capsys):
    # slow prefill makes the cold/hit timing difference unmistakable
    with StandIn(faults="no_metrics", env={"STANDIN_PREFILL_TPS": "4000"}) as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefix_cache", "--only", "metrics")
    by = {c["name"]: c for c in report["checks"]}
    assert by["prefix_cache"]["status"] == "pass" and by["prefix_cache"]["data"]["method"] == "timing"
    assert by["prefix_cache"]["detail"].startswith("timing fallback")
    assert by["metrics"]["status"] == "fail" and rc == 1


def test_prefix_caching_off_is_a_skip_not_a_pass(capsys):
    with StandIn("--no-enable-prefix-caching") as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefix_cache")
    by = {c["name"]: c for c in report["checks"]}
    assert by["prefix_cache"]["status"] == "skip" and "prefix caching is off" in by["prefix_cache"]["detail"]
    assert rc == 0


def test_api_key_missing_fails_model_and_skips_the_rest(capsys, monkeypatch):
    with StandIn(env={"VLLM_API_KEY": "sk-gate"}) as s:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        rc, report = flash_test(capsys, s.url)
        st = statuses(report)
        assert rc == 1 and st["health"] == "pass" and st["model"] == "fail"
        assert {st[n] for n in checks.CHECK_NAMES[2:]} == {"skip"}
        monkeypatch.setenv("VLLM_API_KEY", "sk-gate")
        rc, report = flash_test(capsys, s.url, "--only", "coherence")
    assert rc == 0 and statuses(report)["coherence"] == "pass"


def test_expect_ple_yes_fails_when_counters_are_absent(capsys):
    with StandIn() as s:
        rc, report = flash_test(capsys, s.url, "--only", "metrics", "--expect-ple", "yes")
    by = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and by["metrics"]["status"] == "fail" and "PLE counters missing" in by["metrics"]["detail"]


def test_server_down_fails_health_and_skips_the_rest(capsys):
    rc, report = flash_test(capsys, "http://127.0.0.1:9")
    st = statuses(report)
    assert rc == 1 and st["health"] == "fail"
    assert {st[n] for n in checks.CHECK_NAMES[1:]} == {"skip"}


def test_thresholds_are_settings(capsys):
    with StandIn() as s:
        rc, report = flash_test(capsys, s.url, "--only", "decode", "TEST_MIN_DECODE_TPS=1000000")
    by = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and "TEST_MIN_DECODE_TPS=1e+06" in by["decode"]["detail"]


def test_bad_threshold_value_is_a_usage_error(capsys):
    assert main(["test", "--url", "http://127.0.0.1:9", "TEST_MIN_DECODE_TPS=fast"]) == 2
    assert "TEST_MIN_DECODE_TPS" in capsys.readouterr().err


def test_human_output_names_every_check(capsys):
    with StandIn() as s:
        rc = main(["test", "--url", s.url, *FAST])
    out = capsys.readouterr().out
    assert rc == 0
    for name in checks.CHECK_NAMES:
        assert f" {name} " in out


# --- pure helpers ---------------------------------------------------------------------------------
def test_ledger_prompt_is_deterministic_and_nonce_goes_first():
    a, b = prompts.ledger_prompt(2048, "n1"), prompts.ledger_prompt(2048, "n2")
    assert a != b and a[20:] == b[20:] and a.startswith("Session n1.")
    assert prompts.ledger_prompt(2048) == prompts.ledger_prompt(2048)


def test_logprob_delta():
    assert checks._logprob_delta({"a": -0.1, "b": -2.0}, {"a": -0.1000005, "b": -2.0}) == pytest.approx(5e-7)
    assert checks._logprob_delta({"a": -0.1}, {"c": -0.1}) == float("inf")
    assert checks._logprob_delta(None, {"a": 0.0}) == float("inf")


def test_metrics_snapshot_totals_and_parse_errors():
    text = ('# TYPE vllm:prefix_cache_hits_total counter\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 7.0\n'
            '# TYPE vllm:ttft_seconds histogram\n'
            'vllm:ttft_seconds_bucket{le="1.0"} 2.0\nvllm:ttft_seconds_bucket{le="+Inf"} 3.0\n'
            'vllm:ttft_seconds_count 3.0\nvllm:ttft_seconds_sum 4.5\n')
    snap = metrics.parse(text)
    assert snap.total("vllm:prefix_cache_hits_total") == 12 and snap.total("vllm:prefix_cache_hits", engine="1") == 7
    assert snap.total("vllm:ttft_seconds_count") == 3 and snap.total("vllm:ttft_seconds_sum") == 4.5
    assert snap.total("vllm:absent") is None
    with pytest.raises(metrics.MetricsError):
        metrics.parse("vllm:x{le= 1\n")


def test_ple_counters_hidden_in_the_engine_fail_metrics_when_expected(capsys, tmp_path):
    with StandIn(faults="ple_engine_only", env={"VLLM_PLE_MMAP": "1"}) as s:
        rc, report = flash_test(capsys, s.url, "--only", "metrics", "--expect-ple", "yes")
    by = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and "PLE counters missing" in by["metrics"]["detail"] and "PROM_MULTIPROC" in by["metrics"]["data"]["hint"]
    with StandIn(faults="ple_engine_only", env={"VLLM_PLE_MMAP": "1", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}) as s:
        rc, report = flash_test(capsys, s.url, "--only", "metrics", "--expect-ple", "yes")
    assert rc == 0


# --- prompts sized to max_model_len; n/a declared, never silent (issue 11) ---------------------

def test_prompts_are_scaled_to_the_servers_max_model_len(capsys):
    with StandIn("--max-model-len", "2048") as s:
        rc, report = flash_test(capsys, s.url, "TEST_PREFILL_TOKENS=8192", "TEST_DECODE_TOKENS=4000",
                                "--only", "prefill", "--only", "prefix_cache", "--only", "decode")
    by = {c["name"]: c for c in report["checks"]}
    assert rc == 0, report
    assert by["model"]["data"]["max_model_len"] == 2048
    pre = by["prefill"]
    assert pre["status"] == "pass" and 1000 < pre["data"]["prompt_tokens"] <= 2048
    assert "scaled from 8,192" in pre["detail"] and "max_model_len 2,048" in pre["detail"]
    assert pre["data"]["requested_tokens"] == 8192 and pre["data"]["scaled_to_max_model_len"] == 2048
    assert by["prefix_cache"]["status"] == "pass" and "scaled from 8,192" in by["prefix_cache"]["detail"]
    assert by["decode"]["status"] == "pass" and "max_tokens scaled from 4000" in by["decode"]["detail"]


def test_unsized_prompt_is_what_the_server_refuses():
    """The control: the same 8,192-token prefill without the max_model_len read and without /tokenize
    is a 400; with /tokenize alone (its reply carries max_model_len) it fits again."""
    from flash_cli.gates.client import Client

    with StandIn("--max-model-len", "2048", faults="no_tokenize") as s:
        ctx = checks.Context(Client(s.url), checks.Thresholds(prefill_tokens=8192))
        assert checks.check_health(ctx).status == "pass" and checks.check_model(ctx).status == "pass"
        sized = checks.check_prefill(ctx)
        ctx.max_model_len, ctx.prefill = None, {}
        unsized = checks.check_prefill(ctx)
    assert sized.status == "pass"
    assert unsized.status == "fail" and "maximum context length" in unsized.detail
    with StandIn("--max-model-len", "2048") as s:
        ctx = checks.Context(Client(s.url), checks.Thresholds(prefill_tokens=8192))
        assert checks.check_health(ctx).status == "pass" and checks.check_model(ctx).status == "pass"
        ctx.max_model_len = None
        measured = checks.check_prefill(ctx)
    assert measured.status == "pass" and measured.data["prompt_tokens"] <= 2047, measured


def test_a_prompt_that_fits_is_not_touched():
    ctx = checks.Context(client=None, max_model_len=262144)
    assert checks.fit_tokens(ctx, 8192, 1) == (8192, "")
    ctx.max_model_len = None
    assert checks.fit_tokens(ctx, 8192, 1) == (8192, "")
    ctx.max_model_len = 2048
    n, note = checks.fit_tokens(ctx, 8192, 1)
    assert n + 1 + checks.PROMPT_RESERVE <= 2048 * checks.PROMPT_HEADROOM and "2,048" in note


def test_untrained_declares_the_trained_model_checks_na_visibly(capsys):
    # a server whose "model" calls no tool: on a random checkpoint that is expected, not a failure
    with StandIn(faults="no_tool_calls") as s:
        rc, report = flash_test(capsys, s.url, "--untrained", "--na=decode=timed separately")
        assert rc == 0, report
        st = statuses(report)
        assert st["coherence"] == st["tool_call"] == st["decode"] == "n/a"
        assert st["context"] == "skip"  # --url without a recipe: nothing to compare (issue 16)
        assert all(v == "pass" for n, v in st.items() if n not in ("coherence", "tool_call", "decode", "context"))
        by = {c["name"]: c for c in report["checks"]}
        assert by["coherence"]["detail"].startswith("n/a: untrained checkpoint (--untrained)")
        assert by["decode"]["detail"] == "n/a: timed separately"
        assert set(report["summary"]["not_applicable"]) == {"coherence", "tool_call", "decode"}
        # the human report shows them too, with the reason
        assert main(["test", *FAST, "--url", s.url, "--untrained", "--only", "coherence"]) == 0
        out = capsys.readouterr().out
    assert "n/a: untrained checkpoint" in out and "1 n/a (coherence)" in out
    # without the flag the same server fails tool_call: n/a is what changed the verdict
    with StandIn(faults="no_tool_calls") as s:
        rc, report = flash_test(capsys, s.url, "--only", "tool_call")
    assert rc == 1 and statuses(report)["tool_call"] == "fail"


def test_na_refuses_unknown_and_mandatory_checks(capsys):
    assert main(["test", "--url", "http://127.0.0.1:9", "--na", "nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["test", "--url", "http://127.0.0.1:9", "--na", "health=down"]) == 2
    assert "--na accepts" in capsys.readouterr().err

def test_context_matches_the_recipe_given_with_url(capsys):
    with StandIn("--max-model-len", "262144") as s:
        rc, report = flash_test(capsys, s.url, "native", "--only", "context")
    by = {c["name"]: c for c in report["checks"]}
    assert rc == 0 and by["context"]["status"] == "pass", report
    assert by["context"]["data"] == {"max_model_len": 262144, "expected": 262144}


def test_silent_yarn_fallback_fails_context_naming_both_numbers(capsys):
    # the recipe asks for 500,000 with YaRN; the server came up at the native 262,144
    with StandIn("--max-model-len", "262144") as s:
        rc, report = flash_test(capsys, s.url, "default", "--only", "context")
    by = {c["name"]: c for c in report["checks"]}
    assert rc == 1 and report["summary"]["failed_required"] == ["context"]
    assert "262,144" in by["context"]["detail"] and "500,000" in by["context"]["detail"]
    assert "YaRN override did not take" in by["context"]["data"]["hint"]


def test_a_recipe_setting_with_url_counts_as_a_recipe(capsys):
    with StandIn("--max-model-len", "131072") as s:
        rc, report = flash_test(capsys, s.url, "CTX=131072", "YARN=0", "--only", "context")
        assert rc == 0 and statuses(report)["context"] == "pass", report
        rc, report = flash_test(capsys, s.url, "CTX=100000", "YARN=0", "--only", "context")
        assert rc == 1 and statuses(report)["context"] == "fail"


def test_standin_yarn_fallback_fault_is_caught_by_context(capsys):
    with StandIn("--max-model-len", "500000", faults="yarn_ignored") as s:
        rc, report = flash_test(capsys, s.url, "default", "--only", "context")
    assert rc == 1 and statuses(report)["context"] == "fail"


# --- prompts measured with the server's own tokenizer (issue 11, the H200 run) ------------------

# A small-vocabulary stand-in: every word cut into pieces of <= 3 characters, ~3 tokens a ledger
# word where the estimate assumes 1.41 (the tiny model's BPE made 2,605 tokens of a "1,024-token"
# prompt and vLLM refused it: max_model_len 2,048).
SMALL_VOCAB = {"STANDIN_TOKEN_CHARS": "3"}


def test_standin_small_vocab_really_overshoots_the_estimate():
    """The control that makes the next tests real: by the estimate's sizing the prompt does not fit."""
    import requests

    with StandIn("--max-model-len", "2048", env=SMALL_VOCAB) as s:
        prompt = prompts.ledger_prompt(1024, nonce="x")
        tok = requests.post(s.url + "/tokenize", json={"model": "qwen3.8-flash-next", "prompt": prompt}, timeout=30).json()
        assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}  # vLLM 0.33's TokenizeResponse
        assert tok["count"] > 2048 and tok["max_model_len"] == 2048 and len(tok["tokens"]) == tok["count"]
        r = requests.post(s.url + "/v1/completions", json={"model": "qwen3.8-flash-next", "prompt": prompt,
                                                           "max_tokens": 1, "temperature": 0}, timeout=30)
        assert r.status_code == 400 and "maximum context length is 2048" in r.json()["error"]["message"]


def test_prefill_prompt_is_measured_with_the_servers_tokenizer(capsys):
    with StandIn("--max-model-len", "2048", env=SMALL_VOCAB) as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefill", "--only", "prefix_cache")
    by = {c["name"]: c for c in report["checks"]}
    assert rc == 0, report
    pre = by["prefill"]
    assert pre["status"] == "pass" and pre["data"]["prompt_sizing"] == "tokenize"
    # the server charged exactly what its /tokenize measured, and that is at most the 1,024 asked for
    assert pre["data"]["prompt_tokens"] == pre["data"]["prompt_tokens_sized"]
    assert 0.95 * 1024 <= pre["data"]["prompt_tokens"] <= 1024
    assert f"prompt {pre['data']['prompt_tokens']:,} tokens measured by the server's /tokenize" in pre["detail"]
    assert pre["data"]["tokenize_calls"] <= 8
    assert by["prefix_cache"]["status"] == "pass" and "measured by the server's /tokenize" in by["prefix_cache"]["detail"]


def test_measured_prompt_is_trimmed_to_max_model_len_from_tokenize(capsys):
    """8,192 asked, 2,048 served, ~3 tokens a word: the fit to 2,048 alone (by estimate) would overshoot."""
    with StandIn("--max-model-len", "2048", env=SMALL_VOCAB) as s:
        rc, report = flash_test(capsys, s.url, "TEST_PREFILL_TOKENS=8192", "--only", "prefill")
    pre = {c["name"]: c for c in report["checks"]}["prefill"]
    assert rc == 0 and pre["status"] == "pass", report
    assert pre["data"]["prompt_tokens"] <= pre["data"]["prompt_goal_tokens"] < 2048
    assert "scaled from 8,192" in pre["detail"] and "measured by the server's /tokenize" in pre["detail"]


def test_without_tokenize_the_estimate_is_used_and_said(capsys):
    with StandIn("--max-model-len", "2048", faults="no_tokenize") as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefill")
    pre = {c["name"]: c for c in report["checks"]}["prefill"]
    assert rc == 0 and pre["status"] == "pass", report
    assert pre["data"]["prompt_sizing"] == "estimate" and "HTTP 404" in pre["data"]["tokenize_unavailable"]
    assert "by estimate" in pre["detail"] and "NOT measured: /tokenize HTTP 404" in pre["detail"]
    # and where the estimate is wrong the failure names it
    with StandIn("--max-model-len", "2048", faults="no_tokenize", env=SMALL_VOCAB) as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefill")
    pre = {c["name"]: c for c in report["checks"]}["prefill"]
    assert rc == 1 and "maximum context length" in pre["detail"] and "NOT measured" in pre["detail"]


class _Tokenizer:
    """A fake client whose /tokenize counts `per_word` tokens a word (and 404s when told)."""

    def __init__(self, per_word: float, mml: int | None = None, status: int = 200):
        self.per_word, self.mml, self.status, self.calls = per_word, mml, status, []

    def post(self, path, body, timeout=None):
        from flash_cli.gates.client import Reply

        assert path == "/tokenize" and set(body) == {"model", "prompt"}
        self.calls.append(body["prompt"])
        if self.status != 200:
            return Reply(self.status, {"detail": "Not Found"}, '{"detail":"Not Found"}')
        n = int(len(body["prompt"].split()) * self.per_word)
        return Reply(200, {"count": n, "max_model_len": self.mml, "tokens": list(range(n))}, "")


@pytest.mark.parametrize("per_word", [0.7, 1.41, 2.5, 3.6, 9.0])
def test_sizer_lands_just_below_the_goal(per_word):
    from flash_cli.gates import sizing

    fake = _Tokenizer(per_word)
    got = sizing.ledger(fake, "m", 1024, nonce="n")
    assert got.measured and got.tokens == int(len(got.prompt.split()) * per_word)
    assert sizing.CLOSE_ENOUGH * 1024 <= got.tokens <= 1024, (per_word, got.tokens, got.tries)
    assert got.tries == len(fake.calls) <= sizing.MAX_TRIES and got.prompt.startswith("Session n.")


def test_sizer_caps_at_the_servers_max_model_len_and_falls_back_visibly():
    from flash_cli.gates import sizing

    got = sizing.ledger(_Tokenizer(2.0, mml=600), "m", 1024, completion=48)
    assert got.goal == 552 and got.tokens <= 552 and got.server_max_model_len == 600
    est = sizing.ledger(_Tokenizer(2.0, status=404), "m", 1024)
    assert not est.measured and est.tokens == 1024 and "NOT measured: /tokenize HTTP 404" in est.note
    assert est.prompt == prompts.ledger_prompt(1024)


# --- the prefix cache's block, as a hybrid model on vLLM 0.29 keeps it (run41) -------------------------
HYBRID_029 = ("--max-model-len", "2048", "--block-size", "256",
              "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}')


def _hits(url: str) -> float:
    import requests

    return metrics.parse(requests.get(url + "/metrics", timeout=10).text).total("vllm:prefix_cache_hits")


def test_stand_in_hybrid_cache_hits_whole_mamba_blocks_less_the_drafters(capsys):
    # the stand-in is faithful to run41: a 1,086-token prompt hit 512 tokens, a 1,020-token one none
    import requests

    with StandIn(*HYBRID_029, env={"STANDIN_MAMBA_BLOCK_SIZE": "512"}) as s:
        for words, want in ((543, 512), (510, 0)):  # ~1,086 and ~1,020 tokens (two stand-in tokens a word)
            prompt = " ".join(f"w{i}" for i in range(words))
            n = requests.post(s.url + "/tokenize", json={"model": "qwen3.8-flash-next", "prompt": prompt}).json()["count"]
            h0 = _hits(s.url)
            for _ in range(2):
                requests.post(s.url + "/v1/completions", json={"model": "qwen3.8-flash-next", "prompt": prompt,
                                                               "max_tokens": 1}).raise_for_status()
            assert _hits(s.url) - h0 == checks.reachable_hit(n, 512) == want, (words, n)


def test_prefix_cache_sizes_its_prompt_to_a_hybrid_cache_block(capsys):
    # prefill's 1,024-token goal reaches no 512-token block after the drafter's: the check sends its own
    with StandIn(*HYBRID_029, env={"STANDIN_MAMBA_BLOCK_SIZE": "512"}) as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefill", "--only", "prefix_cache", "--only", "determinism")
    by = {c["name"]: c for c in report["checks"]}
    pc = by["prefix_cache"]
    assert rc == 0 and pc["status"] == "pass", pc
    assert pc["data"]["cache_block"] == 512 and pc["data"]["resized"] is True
    assert pc["data"]["prompt_tokens"] >= 1537  # three whole blocks past the computed last token
    assert pc["data"]["hits_after"] - pc["data"]["hits_before"] >= 1024
    assert "cannot show a hit in 512-token cache blocks" in pc["detail"]
    assert by["prefill"]["data"]["prompt_tokens"] <= 1024  # at most the goal (the nonce's tokens vary)
    assert checks.reachable_hit(by["prefill"]["data"]["prompt_tokens"], 512) == 0
    assert by["determinism"]["status"] == "pass"  # its cold-vs-hit pair is the resized prompt's


def test_prefix_cache_on_a_plain_cache_keeps_prefills_prompt(capsys):
    with StandIn("--max-model-len", "2048", "--block-size", "256") as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefill", "--only", "prefix_cache")
    pc = {c["name"]: c for c in report["checks"]}["prefix_cache"]
    assert rc == 0 and pc["status"] == "pass" and "resized" not in pc["data"] and pc["data"]["cache_block"] == 256


def test_prefix_cache_skips_when_no_prompt_that_fits_can_show_a_hit(capsys):
    with StandIn("--max-model-len", "1024", "--block-size", "256", env={"STANDIN_MAMBA_BLOCK_SIZE": "512"}) as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefix_cache")
    pc = {c["name"]: c for c in report["checks"]}["prefix_cache"]
    assert pc["status"] == "skip" and "blocks of 512 tokens" in pc["detail"] and "max_model_len is 1,024" in pc["detail"]


def test_prefill_is_timed_after_an_untimed_warm_up_sharing_no_block(capsys):
    with StandIn("--max-model-len", "4096", "--block-size", "16") as s:
        rc, report = flash_test(capsys, s.url, "--only", "prefill")
        hits = _hits(s.url)
    pf = {c["name"]: c for c in report["checks"]}["prefill"]
    assert rc == 0 and pf["status"] == "pass" and pf["data"]["warm_up_seconds"] > 0
    assert "untimed warm-up" in pf["detail"]
    assert hits == 0  # the warm-up's nonce goes first: the timed prompt is still cold


def test_cache_block_reads_the_larger_block_and_ignores_an_unused_mamba_one():
    def snap(**labels):
        body = "vllm:cache_config_info{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "} 1.0\n"
        return metrics.parse("# TYPE vllm:cache_config_info gauge\n" + body)

    assert checks.cache_block(snap(block_size="8", mamba_block_size="512", mamba_cache_mode="align")) == 512
    assert checks.cache_block(snap(block_size="256", mamba_block_size="None")) == 256
    assert checks.cache_block(snap(block_size="16", mamba_block_size="512", mamba_cache_mode="none")) == 16
    assert checks.cache_block(snap(enable_prefix_caching="True")) is None and checks.cache_block(None) is None
    assert checks.reachable_hit(1086, 512) == 512 and checks.reachable_hit(1020, 512) == 0
    goal = checks.hit_prompt_tokens(512, 0.5)
    assert goal == 1792 and checks.reachable_hit(int(0.95 * goal), 512) >= 0.5 * goal
