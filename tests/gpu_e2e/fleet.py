"""The gpu-e2e tier: real `vllm serve` boots of the tiny model with our plugin, several at once on one GPU.

Every server's argv and environment come from the RunSpec `flash serve` renders for the default
profile (src/flash_cli/spec.py, through commands/serve.plan) on the fleet's base (BASE=, fleet_base:
FLASH_E2E_BASE, else the base of the vLLM the device env imports, else in a dry run the catalogue's
CURRENT); a scenario that cannot run on that base (no hoisted PLE mode, a patch the plugin does not
apply there) boots nothing and is reported N/A with its reason: the tiny model's sizes are substituted
through settings (TINY_WORDS: CTX, SEQS, GPU_MEM, ports, EXTRA for --block-size/--gdn-prefill-backend,
CONTAINER_ENV for the FlashInfer sampler), never by editing the argv. The container is then mapped
onto plain processes: bind-mount targets are replaced by their host sources (the HF cache), the
entrypoint's `python3` by this Python, `vllm` by `python -m vllm.entrypoints.cli.main`. Harness
additions (printed apart in the dry run): PYTHONPATH (a dist-info that declares our
`vllm.general_plugins` entry point + src/), a per-server VLLM_CACHE_ROOT (a patch changes the
traced code, so servers must not share a compile cache; the plugin's compile-cache key,
flash_vllm/compile_key.py, already separates patch states, so this is belt and braces; only its
`modelinfos` directory, vLLM's cache of per-class facts, is one for all: share_modelinfos), one Triton
kernel cache for all (TRITON_CACHE_MANAGER, harness_site/flash_e2e_triton_cache.py: ~/.triton/cache,
which 0.29 would otherwise move under each server's compile cache), and for the broken-patch boot the
breaker's sitecustomize.

    python tests/gpu_e2e/fleet.py run  [-k EXPR]   # boots, scenarios, results under $FLASH_E2E_OUT
    python tests/gpu_e2e/fleet.py plan [-k EXPR]   # the dry run: every server's argv + env, the scenario plan
    FLASH_E2E_DRY=1 makes `run` a `plan`.

Environment: FLASH_E2E_VLLM_ENV (the device payload's env.sh, sourced for every server), FLASH_E2E_BASE
(the base to render, e.g. v0.29: a plan for another base; in a real run it must match the installed vLLM), FLASH_E2E_OUT
(results; default a new tmp dir), FLASH_E2E_WORK (fixtures, caches; default a tmp dir),
FLASH_E2E_EXTRA (more `vllm serve` words for every server, appended to EXTRA, e.g.
--language-model-only if the vision tower gets in the way), FLASH_E2E_GPU_MEM (a server's share for vLLM's
startup free-memory check, default 0.05), FLASH_E2E_KV_MEM (the fixed KV pool, KV_CACHE_MEM, of every server
that does not boot alone, default 1G: vLLM then skips its memory profiling, so servers booting side by side
cannot starve each other's KV pool; `off` profiles every one), FLASH_E2E_SOLO_GPU_MEM (GPU_MEM of a server
that boots alone for a kv_plan scenario, default 0.12: a profiled pool, compared with the plan; 14 servers
of ~5 GiB beside three solo ones of 16.8 GiB fit the H200's 139.8 GiB; a solo boot that wrote Triton
autotune results is booted again and the second one measured: boot_solos, COLD_NOTE),
FLASH_E2E_PORT (first port, 18400),
FLASH_E2E_BOOT_TIMEOUT (s per boot wave, 420), FLASH_E2E_BOOT_WAVE (at most this many servers boot at once, 4:
vLLM sizes its KV pool from the whole GPU's use at profiling time, so many concurrent boots starve the
later ones), FLASH_E2E_PARALLEL (scenario groups at a time; default all: each scenario of a group waits for its own servers' boots), FLASH_E2E_DEADLINE (s after start when unfinished scenarios are
cut, servers stopped and results packed; 540, inside a 10-minute device call), FLASH_E2E_TEST_ARGS (how `flash test` declares the checks a random
model cannot pass; default TEST_NA_ARGS), FLASH_E2E_COMMIT (the commit, when .git is absent).
Results: at most 8 flat files: results.json (with the base and the vLLM version), summary.txt (its first
line names the base), logs.tar.gz (every server's full log and each scenario's artefacts).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "src", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from flash_common import releases  # noqa: E402 - stdlib only; the catalogue of bases
from flash_common.provenance import tree_commit  # noqa: E402 - stdlib only

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triggers  # noqa: E402 - stdlib only; what guard_p3/guard_p13 send (CPU-proven in tests/vllm)

NEUTRAL = (1, 3, 4, 5, 8, 13)   # output-neutral patches: greedy output must not change
ALL_PATCHES = tuple(range(1, 14))
# Checks a random model cannot pass, declared not applicable (visibly: `flash test --untrained`
# reports them as "n/a: untrained checkpoint" and the result JSON lists them).
TEST_NA = ("coherence", "tool_call")
TEST_NA_ARGS = ("--untrained",)
# The tiny model's sizes, as settings (the H200 traps: block size 256 for the QSA ring of 32;
# no FlashInfer cubins offline: triton GDN prefill, no FlashInfer sampler).
TINY_WORDS = ("YARN=0", "CTX=2048", "SEQS=4", "BATCHED_TOKENS=2048", "NETWORK=host", "BIND=127.0.0.1",
              "API_KEY=off", "COMPILE_CACHE=", "TEST_PREFILL_TOKENS=1024", "TEST_TIMEOUT=120")
TINY_EXTRA = "--block-size 256 --gdn-prefill-backend triton"
TINY_CONTAINER_ENV = ("VLLM_USE_FLASHINFER_SAMPLER=0",)
# Patch 1's forward anchor moved to an equivalent spelling (same code, other source): the plugin must
# refuse. Keyed by the catalogue's `ple_storage` (patch 1's flavour): on 0.30+ its check reads
# Qwen4ExpNGramEmbedding.forward in ngram_embedding.py; 0.29 has no such module, and its flavour
# (p01_ple_mmap.v029.check) reads the same line of Qwen4ExpNGramEmbedding.forward in ple_layer.py.
# Each occurs once in its module (tests/vllm/test_gpu_e2e_breaker.py proves the refusal per release).
_MOVED = {"old": "embedding(ngram_ids).flatten(-2)", "new": "embedding(ngram_ids).flatten(start_dim=-2)",
          "patch": 1, "name": "ple-mmap"}
BREAKS = {"storage": {"module": "vllm.models.qwen4_exp.nvidia.ngram_embedding", **_MOVED},
          "splitting-op": {"module": "vllm.models.qwen4_exp.nvidia.ple_layer", **_MOVED}}
PROBE_TOKENS = 48
PREFIX_LOGPROB_TOL = 1e-4  # as `flash probe --diff`
PREFIX_HIT_BLOCKS = 4   # the prefix-hit prompt: this many full KV blocks (vLLM caches whole blocks only)
BOOT_STAGGER_S = 2.0    # between launches inside a boot wave
POLL_S = 2.0            # health polling period while a wave boots
HARNESS_SITE = ROOT / "tests" / "gpu_e2e" / "harness_site"  # modules the servers import (not the fleet)
TRITON_CACHE_MANAGER = "flash_e2e_triton_cache:SharedFileCacheManager"
INJECT_SITE = ROOT / "tests" / "gpu_e2e" / "inject"  # test-only fault injection (Server.inject), never shipped


# --- servers -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Server:
    name: str
    fixture: str                      # a | b | c | d (tests/fakes/tiny_model.py)
    words: tuple[str, ...] = ()       # extra settings K=V
    container_env: tuple[str, ...] = ()  # env beyond the patch switches below
    disable: tuple[int, ...] = ()     # patches off: FLASH_DISABLE_PATCHES (patch 1 also VLLM_PLE_MMAP=0)
    expect: str = "healthy"           # healthy | refuse
    breaks: bool = False
    # a neutral-probe server: a patch the base needs on (kept_on: patch 1 where stock cannot load the
    # fp8 PLE table, patch 4 where it corrects stock's Mamba block; both 0.29) stays on in it, so the
    # baseline boots and is right, and the others still differ from it in one patch
    baseline: bool = False
    force_off: tuple[int, ...] = ()   # ...except these, kept off even there (fix_p4's stock side)
    inject: str = ""                  # a test-only fault injection its processes load (inject/sitecustomize.py)


KV_OOS_WORDS = ("CTX=8192", "SEQS=8", "BATCHED_TOKENS=4096")
# kv_plan_oos missed by +2.89% at KV_OOS_WORDS (run46): vLLM's peak activation was 0.40 GiB there
# against 0.13 at the fitted CTX=2048 SEQS=4 BATCHED_TOKENS=2048. These two move one term each away
# from a-oos (the prefill chunk down to the fitted 2,048 at SEQS=4, and up to 8,192), so the peak's
# dependence on BATCHED_TOKENS and on CTX is read off vLLM's own breakdown line. That boot was cold
# (its profile autotuned: COLD_NOTE), as every kv_plan first boot with the higher peak was; boot_solos
# now measures a warm second boot when the first one autotuned.
KV_SHAPES = {"2k": ("CTX=8192", "SEQS=4", "BATCHED_TOKENS=2048"), "8k": ("CTX=8192", "SEQS=8", "BATCHED_TOKENS=8192")}
USAGE = re.compile(r"Actual usage is ([\d.]+) GiB for consumed memory \(weights \+ non-torch\), ([\d.]+) GiB for peak "
                   r"activation, and ([\d.]+) GiB for CUDAGraph memory")
HX_CHUNK = 512  # --max-num-batched-tokens of the hoisted-mode servers
# Past the QSA budget (issue 33): the fixture keeps the real indexer_budget (2,048 tokens = 512 blocks
# of 4), so at CTX=2048 the top-k selects every block and patches 5/8 never change a thing. These
# servers take CTX=8192 and prompts of 3,000-7,600 tokens: every decode step selects 512 of up to
# 1,900 blocks, the case where stock's kernel was seen to answer differently on a second try.
QB_CTX = 8192
# PREFIX_RETAIN (docs/PREFIX-CACHE.md): three prompts share PR_PREFIX tokens, each then PR_TAIL of its
# own (past a 256-token block), prefilled in PR_CHUNK-token steps. vLLM's own scheduler on CPU
# (tests/vllm/release/check_prefix_hits.py) says: under retention 0 the second misses and the third
# hits at the junction; dense keeps every chunk end, so the second hits too.
PR_PREFIX, PR_TAIL, PR_CHUNK, PR_TOKENS = 1024, 600, 512, 24
QB_PROMPTS = (3000, 4500, 6000, 7600)
QB_TOKENS = 24
QB_TRIES = 3


def _graphs(mode: str) -> str:
    return "COMPILE_FLAGS=--compilation-config " + shlex.quote(json.dumps({"cudagraph_mode": mode}, separators=(",", ":")))


def _all_but(keep: int | None, among: tuple[int, ...] = ALL_PATCHES) -> tuple[int, ...]:
    return tuple(n for n in among if n != keep)


def _servers() -> dict[str, Server]:
    out = {f"{x}-default": Server(f"{x}-default", x) for x in "abcd"}
    # (d) the QAD layout's NVFP4 PLE table: patch 1's codec (d-default) vs vLLM's own NVFP4 table
    # lookup (patch 1 off), both in the default recipe's FULL_AND_PIECEWISE graphs
    out["d-stock"] = Server("d-stock", "d", words=(_graphs("FULL_AND_PIECEWISE"),), container_env=("VLLM_PLE_MMAP=0",))
    # kv_plan out of sample (issue 33): the overhead constant was fitted on the default pools and
    # checked on identical ones; this server moves every term the plan derives (context: top-k
    # buffers; sequences; the prefill chunk: activations) away from the fitted configuration
    out["a-oos"] = Server("a-oos", "a", words=KV_OOS_WORDS)
    for tag, words in KV_SHAPES.items():
        out[f"a-shape-{tag}"] = Server(f"a-shape-{tag}", "a", words=words)
    # greedy neutrality: the output-neutral patches all off vs exactly one on, same graph mode (the
    # default's: FULL_AND_PIECEWISE with the hoisted gather where the base serves it, else PIECEWISE).
    # The others stay at the recipe's default: with patch 2 (Mamba block size)
    # off the tiny model's state blocks do not fit a small memory share (measured on the H200).
    out["probe-off"] = Server("probe-off", "a", words=("EXACT_TOPK=0", "DET_TOPK=0"), disable=NEUTRAL, baseline=True)
    for n in NEUTRAL:
        gate = {5: ("EXACT_TOPK=1", "DET_TOPK=0"), 8: ("EXACT_TOPK=0", "DET_TOPK=1")}.get(n, ("EXACT_TOPK=0", "DET_TOPK=0"))
        out[f"probe-p{n}"] = Server(f"probe-p{n}", "a", words=gate, disable=_all_but(n, NEUTRAL), baseline=True)
    # patch 8's repair mode (the stock kernel, then the certified rewrite): the default since run44
    out["probe-p8r"] = Server("probe-p8r", "a", words=("EXACT_TOPK=0", "DET_TOPK=repair"), disable=_all_but(8, NEUTRAL),
                              baseline=True)
    # where patch 4 corrects stock (fix_p4): the baseline without it, and the baseline with prefix
    # caching off (no Mamba alignment nor seeding: the reference the correction must reproduce)
    out["fix-no4"] = Server("fix-no4", "a", words=("EXACT_TOPK=0", "DET_TOPK=0"), disable=NEUTRAL,
                            baseline=True, force_off=(4,))
    out["fix-nopc"] = Server("fix-nopc", "a", words=("EXACT_TOPK=0", "DET_TOPK=0", "PREFIX_CACHE=0"),
                             disable=NEUTRAL, baseline=True)
    out["broken-p1"] = Server("broken-p1", "a", expect="refuse", breaks=True)
    # patch 1's hoisted mode (issue 12): greedy token ids against the eager gather in one graph mode
    # (PIECEWISE), and against stock vLLM in FULL_AND_PIECEWISE; with MTP=2 (the recipe's) and
    # without; a 4,096-token context and 512-token prefill chunks so the 3,000-token case is chunked
    for mtp in (2, 0):
        tag = "hx" if mtp else "hx0"
        common = ("CTX=4096", f"BATCHED_TOKENS={HX_CHUNK}", f"MTP={mtp}")
        out[f"{tag}-eager-pw"] = Server(f"{tag}-eager-pw", "a", words=common + ("PLE_MODE=eager",))
        out[f"{tag}-hoist-pw"] = Server(f"{tag}-hoist-pw", "a", words=common + ("PLE_MODE=hoisted", _graphs("PIECEWISE")))
        if mtp:
            out[f"{tag}-stock-full"] = Server(f"{tag}-stock-full", "a", words=common + (_graphs("FULL_AND_PIECEWISE"),),
                                              container_env=("VLLM_PLE_MMAP=0",))
            out[f"{tag}-hoist-full"] = Server(f"{tag}-hoist-full", "a", words=common + ("PLE_MODE=hoisted",))
    # past the QSA budget: the recipe (DET_TOPK=repair), the exact reference (DET_TOPK=1: patch 5's
    # torch.topk over the row) and the neutral-off baseline (stock's top-k kernel)
    qb = (f"CTX={QB_CTX}", "BATCHED_TOKENS=2048")
    out["qb-default"] = Server("qb-default", "a", words=qb)
    pr = ("CTX=4096", f"BATCHED_TOKENS={PR_CHUNK}")
    out["pr-0"] = Server("pr-0", "a", words=pr)
    out["pr-dense"] = Server("pr-dense", "a", words=pr + ("PREFIX_RETAIN=dense",))
    out["qb-exact"] = Server("qb-exact", "a", words=qb + ("EXACT_TOPK=0", "DET_TOPK=1"))
    out["qb-off"] = Server("qb-off", "a", words=qb + ("EXACT_TOPK=0", "DET_TOPK=0"), disable=NEUTRAL, baseline=True)
    # diagnosis of patch 1's ids (VLLM_PLE_MMAP_DEBUG) and the stock device-table class on the same ids
    out["diag-p1"] = Server("diag-p1", "a", container_env=("VLLM_PLE_MMAP_DEBUG=1",))
    out["diag-stockdev"] = Server("diag-stockdev", "a", words=(
        "EXACT_TOPK=0", "DET_TOPK=0", f"EXTRA={TINY_EXTRA} --engram-config '{{\"cpu_offload\":false}}'"),
        disable=ALL_PATCHES)
    # patch 3's trigger (issue 33): the default recipe (MTP + prefix caching: align mode, the fused state
    # copies) with the test-only injection that hands one fused copy an out-of-range block id; the
    # same without patch 3 shows what stock does with it (recorded)
    out["guard-p3"] = Server("guard-p3", "a", inject=triggers.INJECT_KIND)
    out["guard-p3-stock"] = Server("guard-p3-stock", "a", disable=(3,), inject=triggers.INJECT_KIND)
    return out


SERVERS = _servers()


@dataclass(frozen=True)
class Scenario:
    name: str
    servers: tuple[str, ...]
    doc: str
    run: Callable = field(compare=False, repr=False)
    solo: bool = False  # its servers must boot alone (memory profiling sees the whole GPU's usage)
    # base -> why the scenario cannot run there (None: it applies); an n/a scenario boots nothing
    # and is reported with its reason, never as passed
    na: Callable[[str], str | None] = field(default=lambda base: None, compare=False, repr=False)


def breaker(base: str) -> dict | None:
    """The moved anchor for `base` (by patch 1's flavour there), None where none is known."""
    return BREAKS.get(releases.cap(base, "ple_storage"))


def _na_hoisted(base: str) -> str | None:
    return None if releases.has(base, "ple_hoisted") else f"PLE_MODE=hoisted is not served on {base}"


def _na_patch(n: int) -> Callable[[str], str | None]:
    """N/a where the plugin's own registry does not apply patch n on the base (the banner's
    `applied [...]` comes from the same expected_status; the registry imports no vLLM)."""
    def na(base: str) -> str | None:
        from flash_vllm.registry import by_number

        p = by_number(n)
        status = p.expected_status(base)
        return None if status == "applies" else f"patch {n} ({p.name}) is {status} on {base}: the plugin applies no code"
    return na


def _na_stock_ple(base: str) -> str | None:
    return None if releases.has(base, "ple_fp8_modelopt") else (
        f"stock vLLM on {base} cannot load the checkpoints' fp8 PLE table (its fp8 method is gated on Fp8Config: "
        "a bf16 table without weight_scale), so there is no patch-1-off server to compare with")


def _na_neutral(n: int) -> Callable[[str], str | None]:
    """N/a where the plugin does not apply patch n, or where the neutral baseline keeps it on."""
    return lambda base: _na_patch(n)(base) or kept_on(base).get(n)


def _na_stock_side(base: str) -> str | None:
    """N/a for a comparison of patch 1 against stock vLLM's own PLE table."""
    return _na_patch(1)(base) or _na_stock_ple(base)


def kept_on(base: str) -> dict[int, str]:
    """Output-neutral patches a neutral baseline keeps on on `base`, and why (see Server.baseline)."""
    out = {}
    if why := _na_stock_ple(base):
        out[1] = why
    if not releases.has(base, "block_size_prefix_groups"):
        out[4] = (f"patch 4 is not output-neutral on {base}: stock evaluates Mamba state and prefill alignment at "
                  "the QSA ring's block (cache_config.block_size 8, not the Mamba block 512), patch 4 corrects it "
                  "(run41), so the neutral baseline keeps it on; fix_p4 shows the correction")
    return out


def container_env(server: Server, base: str) -> tuple[str, ...]:
    """The server's container env on `base`: its patch switches, less the kept_on(base) patches where a
    baseline needs them on (see Server), then its other env."""
    keep = {n for n in kept_on(base) if n not in server.force_off} if server.baseline else set()
    off = [n for n in server.disable if n not in keep]
    switches = (f"FLASH_DISABLE_PATCHES={','.join(map(str, off))}",) if server.disable else ()
    return switches + (("VLLM_PLE_MMAP=0",) if 1 in off else ()) + server.container_env


def _na_broken(base: str) -> str | None:
    return _na_patch(1)(base) or (None if breaker(base) else f"no breaker anchor for patch 1's flavour on {base}")


def _na_diag(base: str) -> str | None:
    # diag-stockdev's --engram-config cpu_offload=false switches 0.30+'s storage class to the device
    # one; 0.29 has neither the flag (the boot would stop on an unknown argument) nor the class
    return _na_patch(1)(base) or (None if releases.cap(base, "ple_storage") == "storage" else
                                  f"--engram-config (stock PLE storage classes) does not exist on {base}")


def _na_qad(base: str) -> str | None:
    """The QAD layout's NVFP4 PLE table has a serving path only where vLLM has an NVFP4 table method
    (checkpoint/known.py; patch 1 decodes on top of it): elsewhere flash serve refuses it."""
    from flash_cli.checkpoint import known

    first = known.LAYOUTS["qad"].stock_table_from
    return None if first is None or base in releases.upstream_from(first) else (
        f"vLLM on {base} has no NVFP4 PLE table method (from {first} on): no serving path for the QAD layout")


def not_applicable(chosen: list[Scenario], base: str) -> dict[str, str]:
    """Scenario name -> why it cannot run on `base`, for the chosen ones that cannot."""
    return {s.name: why for s in chosen if (why := s.na(base))}


def applicable(chosen: list[Scenario], base: str) -> list[Scenario]:
    na = not_applicable(chosen, base)
    return [s for s in chosen if s.name not in na]


def _scenarios() -> dict[str, Scenario]:
    sc: list[Scenario] = []
    for x in "abc":
        sc.append(Scenario(f"boot_{x}", (f"{x}-default",), f"({x}) reaches /health with the default recipe, "
                           "the plugin banner lists patch 1", lambda ctx, x=x: check_boot(ctx, f"{x}-default")))
        sc.append(Scenario(f"flash_test_{x}", (f"{x}-default",), f"`flash test --url` on ({x}); "
                           f"{', '.join(TEST_NA)} declared n/a", lambda ctx, x=x: check_flash_test(ctx, f"{x}-default")))
        sc.append(Scenario(f"kv_plan_{x}", (f"{x}-default",), f"({x}) KV pool in the boot log vs "
                           "`flash plan` (h200 on an H200, else detected) within 2%", lambda ctx, x=x: check_kv_plan(ctx, f"{x}-default"),
                           solo=True))
    sc.append(Scenario("boot_d", ("d-default",), "(d) the QAD export (MXFP8 side layers, NVFP4 PLE table) reaches "
                       "/health with the default recipe; the plugin banner lists patch 1 and patch 1 opened the "
                       "table as NVFP4 (its codec)", lambda ctx: check_boot_nvfp4(ctx, "d-default"), na=_na_qad))
    sc.append(Scenario("flash_test_d", ("d-default",), f"`flash test --url` on (d); {', '.join(TEST_NA)} declared n/a",
                       lambda ctx: check_flash_test(ctx, "d-default"), na=_na_qad))
    sc.append(Scenario("ple_nvfp4_d", ("d-stock", "d-default"), "greedy probe on (d): patch 1's NVFP4 codec (the table "
                       "read from disk, decoded by flash_vllm.ple.nvfp4) vs vLLM's own NVFP4 table (patch 1 off): "
                       "byte-identical", lambda ctx: check_probe(ctx, "d-stock", "d-default"), na=_na_qad))
    sc.append(Scenario("kv_plan_oos", ("a-oos",), f"(a) with {' '.join(KV_OOS_WORDS)} (a configuration the "
                       "overhead was never fitted on): KV pool vs `flash plan` (h200 on an H200, else detected) within 2%",
                       lambda ctx: check_kv_plan(ctx, "a-oos"), solo=True))
    for tag, words in KV_SHAPES.items():
        sc.append(Scenario(f"kv_plan_shape_{tag}", (f"a-shape-{tag}",), f"(a) with {' '.join(words)}: the same check; "
                           "with kv_plan_oos, vLLM's peak activation at three prefill chunks and two contexts (the "
                           "breakdown line, recorded beside the plan's terms)",
                           lambda ctx, tag=tag: check_kv_plan(ctx, f"a-shape-{tag}"), solo=True))
    for n in NEUTRAL:
        sc.append(Scenario(f"probe_p{n}", ("probe-off", f"probe-p{n}"), f"greedy probe, patch {n} back on vs the neutral-off baseline "
                           "(1,3,4,5,8,13 off; kept_on(base) stay on: 1 where stock cannot load the PLE table, 4 where "
                           "it corrects stock): byte-identical",
                           lambda ctx, n=n: check_probe(ctx, "probe-off", f"probe-p{n}"),
                           na=_na_neutral(n)))
    sc.append(Scenario("probe_p8_repair", ("probe-off", "probe-p8r"), "greedy probe, patch 8 back on in its "
                       "repair mode (DET_TOPK=repair: the stock kernel, then the sliced Triton rewrite) vs the "
                       "neutral-off baseline: byte-identical", lambda ctx: check_probe(ctx, "probe-off", "probe-p8r"),
                       na=_na_neutral(8)))
    sc.append(Scenario("fix_p4", ("probe-off", "fix-nopc", "fix-no4"), "where patch 4 corrects stock (0.29): greedy "
                       "probe with it (the neutral baseline) equals prefix caching off (no Mamba alignment nor seed); "
                       "stock's (patch 4 off) is recorded against the same reference",
                       lambda ctx: check_fix(ctx, "probe-off", "fix-nopc", "fix-no4"),
                       na=lambda base: _na_patch(4)(base) or (None if 4 in kept_on(base) else
                                                              f"patch 4 is output-neutral on {base}: probe_p4 covers it")))
    sc.append(Scenario("prefix_hit_a", ("a-default",), f"a greedy prompt of {PREFIX_HIT_BLOCKS} KV blocks (sized with the "
                       "server's /tokenize) twice: hits registered, the hit run equals the cold one",
                       lambda ctx: check_prefix_hit(ctx, "a-default")))
    sc.append(Scenario("prefix_hit_off", ("probe-off",), "the same with the output-neutral patches off (is a difference ours?; kept_on(base) "
                       "stay on)",
                       lambda ctx: check_prefix_hit(ctx, "probe-off")))
    sc.append(Scenario("ple_memory", ("probe-p1", "probe-off"), "GPU memory and pinned host bytes (smaps: "
                       "cudaHostAlloc memory) with/without patch 1, asserted by the table's bytes (the two differ "
                       "in patch 1 only); vllm:ple_mmap_* counters move",
                       lambda ctx: check_ple_memory(ctx, "probe-p1", "probe-off"),
                       na=_na_stock_side))
    sc.append(Scenario("ple_memory_p1", ("a-default",), "where ple_memory is n/a for want of a stock side: the patch-1 "
                       "side alone (the table opened from disk, vllm:ple_mmap_* move; the device and pinning only where "
                       "the release logs its PLE init line, 0.30+)",
                       lambda ctx: check_ple_memory(ctx, "a-default", None),
                       na=lambda base: _na_patch(1)(base) or (None if _na_stock_ple(base) else
                                                              f"ple_memory covers it on {base}, against stock")))
    for tag, (a, b), what in (("pw", ("hx-eager-pw", "hx-hoist-pw"), "eager vs hoisted gather, both PIECEWISE, MTP=2"),
                              ("pw_nomtp", ("hx0-eager-pw", "hx0-hoist-pw"), "eager vs hoisted gather, both PIECEWISE, MTP=0"),
                              ("full", ("hx-stock-full", "hx-hoist-full"),
                               "stock vLLM (patch 1 off) vs hoisted, both FULL_AND_PIECEWISE, MTP=2")):
        sc.append(Scenario(f"hoist_exact_{tag}", (a, b), f"greedy token ids (lab/bench_decode.py greedy: EOS inside, "
                           f"a 3,000-token prompt in {HX_CHUNK}-token chunks, the same again as a prefix hit, a shared "
                           f"prefix), {what}: identical", lambda ctx, a=a, b=b: check_greedy_pair(ctx, a, b),
                           na=_na_hoisted))
    sc.append(Scenario("qsa_past_budget", ("qb-default", "qb-exact", "qb-off"), f"prompts of "
                       f"{', '.join(f'{n:,}' for n in QB_PROMPTS)} tokens at CTX={QB_CTX:,} (past the fixture's QSA "
                       f"budget), {QB_TRIES} tries each: the recipe's greedy ids equal the exact reference "
                       "(DET_TOPK=1) and themselves try to try; the neutral-off baseline's try-to-try "
                       "difference rate is recorded, not asserted", lambda ctx: check_qsa_past_budget(ctx),
                       na=lambda base: _na_patch(8)(base)))
    sc.append(Scenario("prefix_retain", ("pr-0", "pr-dense"), f"three prompts sharing {PR_PREFIX:,} tokens, then "
                       f"{PR_TAIL} of their own, in {PR_CHUNK}-token chunks: with PREFIX_RETAIN=dense the second "
                       "hits at least one chunk end; under vLLM's default (0) it misses and the third hits; "
                       "greedy ids identical between the two servers (hit or not)",
                       lambda ctx: check_prefix_retain(ctx, "pr-0", "pr-dense")))
    sc.append(Scenario("diag_ple_ids", ("diag-p1", "diag-stockdev"), "patch 1 with VLLM_PLE_MMAP_DEBUG and "
                       "stock vLLM with the PLE table on the GPU: records the id checks and how each boot ended",
                       lambda ctx: check_diag(ctx, ("diag-p1", "diag-stockdev")), na=_na_diag))
    sc.append(Scenario("guard_p3", ("guard-p3", "guard-p3-stock"), "patch 3's trigger: the test-only injection "
                       "(tests/gpu_e2e/inject) hands one fused Mamba state copy an out-of-range block id at the "
                       "first decode step crossing a Mamba block; the server logs 'mamba state-copy guard: N "
                       "out-of-range' (N >= 1), keeps /health and answers; the stock server's fate with the same "
                       "injection is recorded", lambda ctx: check_guard_p3(ctx, "guard-p3", "guard-p3-stock"),
                       na=_na_patch(3)))
    sc.append(Scenario("guard_p13", ("probe-p13", "probe-off"), "patch 13's trigger: a reply forced (structured "
                       "outputs, a Lark grammar) to a quoted `<tool_call>` and a fenced example call, the markers "
                       "as their special tokens, tools on: with patch 13 the content is the whole text and no tool "
                       "call; without it (the neutral-off baseline) what stock returns is recorded",
                       lambda ctx: check_guard_p13(ctx, "probe-p13", "probe-off"), na=_na_neutral(13)))
    sc.append(Scenario("broken_patch_p1", ("broken-p1",), "patch 1's anchor moved (BREAKS, by the base's patch 1 "
                       "flavour): the boot refuses, naming the patch", lambda ctx: check_broken(ctx, "broken-p1"),
                       na=_na_broken))
    return {s.name: s for s in sc}


SCENARIOS = _scenarios()


def select(expr: str | None) -> list[Scenario]:
    """Scenarios whose name matches a pytest-style -k expression (and/or/not/parentheses, substrings)."""
    if not expr:
        return list(SCENARIOS.values())
    tokens = re.findall(r"\(|\)|[^\s()]+", expr)
    out = []
    for s in SCENARIOS.values():
        py = []
        for t in tokens:
            py.append(t if t in ("(", ")", "and", "or", "not") else repr(t in s.name))
        try:
            hit = eval(" ".join(py), {"__builtins__": {}}, {})  # noqa: S307 - only True/False/and/or/not
        except SyntaxError:
            raise SystemExit(f"gpu-e2e: bad -k expression {expr!r}") from None
        if hit:
            out.append(s)
    return out


# --- rendering from the RunSpec --------------------------------------------------------------------

@dataclass
class Context:
    work: Path
    out: Path
    python: str
    base_env: dict[str, str]
    snaps: dict[str, Path]
    port0: int = 18400
    gpu_mem: float = 0.05
    kv_mem: str | None = "1G"
    solo_gpu_mem: float = 0.12
    dry: bool = False
    base: str = releases.CURRENT  # the catalogue base every server renders (BASE=); fleet_base()
    vllm: str | None = None        # the device env's vLLM version (None in a dry run)
    procs: dict = field(default_factory=dict)
    ready: dict = field(default_factory=dict)  # server → threading.Event, set once its boot settled
    cold: dict = field(default_factory=dict)   # solo server → its first boot's record when that was cold
    artefacts: list[Path] = field(default_factory=list)

    @property
    def cache(self) -> Path:
        return self.work / "hf"


def draft_vocab(ctx: Context) -> Path:
    """Patch 10's id list for the tiny vocabulary (the shipped one is for 248,320 ids)."""
    import numpy as np

    from fakes import tiny_model

    path = ctx.work / "draft-vocab.npy"
    if not path.exists() and not ctx.dry:
        ids = sorted(set(range(1024)) | set(tiny_model.added_tokens().values()))
        np.save(path, np.asarray(ids, dtype=np.int64))
    return path


def words_for(ctx: Context, server: Server, index: int, solo: bool = False) -> list[str]:
    """The settings of one server. A server booting alone (kv_plan) keeps vLLM's profiled pool at
    FLASH_E2E_SOLO_GPU_MEM; the others get a fixed pool (KV_CACHE_MEM), which skips the profiling that
    side-by-side boots disturb (H200 run30: a-nople 1.21 GiB of KV vs a-default 8.95 GiB at one share)."""
    from fakes import tiny_model

    fx = tiny_model.recipe_for(server.fixture, ctx.snaps) if ctx.snaps else {
        "MODEL": {"a": "nvidia/Qwen3.8-Flash-Next-NVFP4", "b": "nvidia/Qwen3.8-Flash-Next-NVFP4",
                  "c": "RadixArk/Qwen3.8-Flash-Next-NVFP4", "d": "local-inference-lab/Qwen3.8-Flash-Next-NVFP4"}[server.fixture],
        "MODE": {"a": "nvfp4", "b": "hybrid", "c": "hybrid-mtp", "d": "nvfp4"}[server.fixture]}
    words = list(TINY_WORDS) + [f"BASE={ctx.base}"] + [f"{k}={v}" for k, v in fx.items()]
    words += [f"HF_CACHE={ctx.cache}", f"PORT={ctx.port0 + index}", f"NAME=e2e-{server.name}",
              f"GPU_MEM={(ctx.solo_gpu_mem if solo else ctx.gpu_mem):.2f}", f"DRAFT_VOCAB={draft_vocab(ctx)}",
              f"EXTRA={TINY_EXTRA} {os.environ.get('FLASH_E2E_EXTRA', '')}".rstrip(),
              "CONTAINER_ENV=" + " ".join(TINY_CONTAINER_ENV + container_env(server, ctx.base))]
    if not solo and ctx.kv_mem:
        words.append(f"KV_CACHE_MEM={ctx.kv_mem}")
    return words + list(server.words)


def _translate(value: str, binds: list[tuple[str, str]]) -> str:
    for target, source in binds:
        if value == target or value.startswith(target + "/"):
            return source + value[len(target):]
        value = value.replace("=" + target + "/", "=" + source + "/")
    return value


def render(ctx: Context, server: Server, index: int, solo: bool = False) -> dict:
    """RunSpec (what `flash serve` would run in a container) → one plain process."""
    from flash_cli import preflight, recipe
    from flash_cli.commands import serve

    words = words_for(ctx, server, index, solo)
    r = recipe.load(["default", *words], env={})
    snap = r.snapshot()
    spec = serve.plan(r, snap.name if snap else "<SNAPSHOT>")
    binds = sorted(((m.target, m.source) for m in spec.mounts if m.kind == "bind"), key=lambda t: -len(t[0]))
    unmapped = [m for m in spec.mounts if m.kind != "bind"]
    cmd = [_translate(a, binds) for a in spec.command]
    if cmd[0] != "vllm":
        raise ValueError(f"RunSpec command does not start with vllm: {cmd[:3]}")
    entry = list(spec.entrypoint)
    if entry[:3] != ["python3", "-m", "flash_vllm.launch"]:
        raise ValueError(f"unexpected RunSpec entrypoint {entry}")
    argv = [ctx.python, "-m", "flash_vllm.launch", ctx.python, "-m", "vllm.entrypoints.cli.main", *cmd[1:]]
    spec_env = {k: _translate(v, binds) for k, v in spec.env.items()}
    harness = {
        "PYTHONPATH": os.pathsep.join([*([str(ROOT / "tests" / "gpu_e2e" / "breaker")] if server.breaks else []),
                                       *([str(INJECT_SITE)] if server.inject else []),
                                       str(ctx.work / "plugin-site"), str(ROOT / "src"), str(HARNESS_SITE)]
                                      + ([ctx.base_env["PYTHONPATH"]] if ctx.base_env.get("PYTHONPATH") else [])),
        "VLLM_CACHE_ROOT": str(ctx.work / "vllm-cache" / server.name),
        # one Triton kernel cache for all servers, whatever TRITON_CACHE_DIR vLLM sets (0.29 moves it
        # under each server's compile cache): harness_site/flash_e2e_triton_cache.py
        "TRITON_CACHE_MANAGER": TRITON_CACHE_MANAGER,
    }
    if server.inject:
        harness.update({triggers.INJECT_ENV: server.inject, "FLASH_E2E_INJECT_BLOCK_ID": str(triggers.BAD_BLOCK_ID)})
    if server.breaks:
        brk = breaker(ctx.base)
        if brk is None:
            raise ValueError(f"server {server.name}: no breaker anchor for {ctx.base} (BREAKS)")
        harness.update({"FLASH_E2E_BREAK": json.dumps({k: brk[k] for k in ("module", "old", "new")}),
                        "FLASH_E2E_BREAK_DIR": str(ctx.work / "broken-src")})
    port = r.settings["PORT"]
    return {"server": server.name, "fixture": server.fixture, "expect": server.expect, "solo": solo,
            "words": words, "argv": argv, "spec_env": spec_env, "harness_env": harness,
            "url": f"http://127.0.0.1:{port}", "port": port, "model": r.settings["SERVED_MODEL_NAME"],
            "unmapped_mounts": [f"{m.kind}:{m.target}" for m in unmapped],
            "preflight": [str(p) for p in preflight.recipe(spec)], "warnings": list(spec.warnings)}


def plugin_site(ctx: Context) -> Path:
    """A dist-info declaring our vllm.general_plugins entry point (vLLM finds plugins only that way)."""
    from flash_cli import __version__

    site = ctx.work / "plugin-site"
    info = site / f"flash_recipe-{__version__}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-recipe\nVersion: {__version__}\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nflash = flash_vllm:register\n")
    (info / "top_level.txt").write_text("flash_cli\nflash_vllm\n")
    return site


# --- processes -------------------------------------------------------------------------------------

@dataclass
class Proc:
    spec: dict
    popen: subprocess.Popen
    log: Path
    started: float
    healthy_at: float | None = None
    exited: int | None = None
    ended_at: float | None = None


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=3) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def share_modelinfos(ctx: Context, cache_root: Path) -> None:
    """One `modelinfos` directory for every server's VLLM_CACHE_ROOT. vLLM resolves each
    architecture (the model and its MTP head) in a fresh Python subprocess unless
    VLLM_CACHE_ROOT/modelinfos holds the class's facts keyed by the model package's file hash
    (registry.py `_LazyRegisteredModel.inspect_model_cls`): ~35 s each on the device, ~70 s of every
    boot with a per-server cache root (run37). Those facts do not depend on our patches; the
    compile caches beside them stay per server."""
    shared = ctx.work / "vllm-cache" / "_modelinfos"
    shared.mkdir(parents=True, exist_ok=True)
    cache_root.mkdir(parents=True, exist_ok=True)
    link = cache_root / "modelinfos"
    if not link.is_symlink():
        if link.is_dir():
            shutil.rmtree(link)
        link.symlink_to(shared, target_is_directory=True)


def launch(ctx: Context, spec: dict) -> Proc:
    log = ctx.work / "logs" / f"{spec['server']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    share_modelinfos(ctx, Path(spec["harness_env"]["VLLM_CACHE_ROOT"]))
    env = {**ctx.base_env, **spec["spec_env"], **spec["harness_env"]}
    fh = open(log, "wb")  # noqa: SIM115 - the child owns it
    fh.write(("# " + shlex.join(spec["argv"]) + "\n").encode())
    fh.flush()
    popen = subprocess.Popen(spec["argv"], env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=str(ctx.work),
                             start_new_session=True)
    return Proc(spec, popen, log, time.monotonic())


def poll(p: Proc) -> str:
    if p.exited is None:
        rc = p.popen.poll()
        if rc is not None:
            p.exited, p.ended_at = rc, time.monotonic()
    if p.exited is not None:
        return "exited"
    if p.healthy_at is None and _health(p.spec["url"]):
        p.healthy_at = time.monotonic()
    return "healthy" if p.healthy_at else "booting"


def wait(procs: list[Proc], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = [poll(p) for p in procs]
        if all(s != "booting" for s in states):
            return
        time.sleep(POLL_S)


def _signal(p: Proc, sig: int) -> None:
    """`sig` to the process group this harness started (vLLM's engine and worker children too)."""
    try:
        os.killpg(p.popen.pid, sig)
    except ProcessLookupError:
        pass


def _reap(p: Proc, timeout: float) -> None:
    """Wait up to `timeout` for the group leader, SIGKILL the group when it is still there."""
    try:
        p.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        _signal(p, signal.SIGKILL)
        p.popen.wait(10)


def _ended(p: Proc) -> None:
    if p.exited is None:
        p.exited, p.ended_at = p.popen.returncode, time.monotonic()


def stop_all(procs: list[Proc], grace: float = 20) -> None:
    """SIGTERM to every process group this harness started, one shared grace period, then SIGKILL."""
    live = [p for p in procs if p.popen.poll() is None]
    for p in live:
        _signal(p, signal.SIGTERM)
    end = time.monotonic() + grace
    for p in live:
        _reap(p, max(0.1, end - time.monotonic()))
    for p in procs:
        _ended(p)


def stop(p: Proc, grace: float = 30) -> None:
    """SIGTERM to the process group this harness started (vLLM's engine/worker children too), then SIGKILL."""
    if p.popen.poll() is None:
        _signal(p, signal.SIGTERM)
        _reap(p, grace)
    _ended(p)


def group_gone(p: Proc, timeout: float = 30) -> bool:
    """Wait until no process of the group this harness started is left (the leader is reaped first;
    vLLM's engine core may outlive it by seconds, holding its GPU memory); SIGKILL what remains."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.killpg(p.popen.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(POLL_S)
    _signal(p, signal.SIGKILL)
    return False


def boot_wave() -> int:
    raw = os.environ.get("FLASH_E2E_BOOT_WAVE", "4")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise SystemExit(f"gpu-e2e: FLASH_E2E_BOOT_WAVE={raw!r}: want a whole number >= 1 (servers booting at once)")
    return n


def waves(specs: list[dict], size: int) -> list[list[dict]]:
    """The non-solo servers in boot waves of at most `size`, in plan order, a boot expected to refuse
    first: it ends in seconds (run41 launched broken-p1 last, and the deadline cut it while booting)."""
    rest = sorted((s for s in specs if not s["solo"]), key=lambda s: s.get("expect") != "refuse")
    return [rest[i:i + size] for i in range(0, len(rest), size)]


def boot(ctx: Context, specs: list[dict], timeout: float, deadline: float, wave_size: int | None = None,
         solos: bool = True) -> dict[str, Proc]:
    """The non-solo servers in waves of at most FLASH_E2E_BOOT_WAVE (staggered by 2 s inside a wave;
    a wave starts once every server of the previous one is healthy or dead, or its FLASH_E2E_BOOT_TIMEOUT
    ran out), then (solos=True) the solo servers one at a time (boot_solos; run_selected boots those
    first instead). vLLM sizes its KV pool
    from the whole GPU's used memory at profiling time (mem_get_info): 6-12 servers profiling at once
    at a 0.07-0.13 share each left the later ones "No available memory for the cache blocks" (H200,
    vLLM 0.33); hence fixed pools (FLASH_E2E_KV_MEM) side by side, and a profiled pool only alone.
    Each server's ctx.ready event is set once its boot settled (healthy, dead or timed out)."""
    procs = ctx.procs
    for spec in specs:
        ctx.ready.setdefault(spec["server"], threading.Event())
    size = wave_size or boot_wave()
    for i, wave in enumerate(waves(specs, size)):
        group = []
        for spec in wave:
            procs[spec["server"]] = p = launch(ctx, spec)
            p.spec["wave"] = i
            group.append(p)
            time.sleep(BOOT_STAGGER_S)
        wait(group, min(timeout, deadline - time.monotonic() - 90))
        for p in group:
            say(f"  {p.spec['server']}: {poll(p)} after {time.monotonic() - p.started:.0f}s (boot wave {i + 1})")
            ctx.ready[p.spec["server"]].set()
    if solos:
        boot_solos(ctx, specs, timeout, deadline)
    return procs


def boot_solos(ctx: Context, specs: list[dict], timeout: float, deadline: float) -> None:
    """The solo servers one at a time, alone on the GPU (run_selected boots them before the waves).
    The scenarios of a solo server already up may run meanwhile: a booted server allocates nothing new
    for a request (its graphs and pools exist), so the next solo boot's profiling sees only its own
    memory."""
    for spec in [s for s in specs if s["solo"]]:
        if time.monotonic() > deadline - 120:
            say(f"  {spec['server']}: not started (deadline)")
            ctx.ready[spec["server"]].set()
            continue
        before = autotune_results(ctx)
        p = launch(ctx, spec)
        ctx.procs[spec["server"]] = p
        wait([p], min(timeout, deadline - time.monotonic() - 90))
        say(f"  {spec['server']}: {poll(p)} after {time.monotonic() - p.started:.0f}s (alone)")
        tuned = autotune_results(ctx) - before
        if tuned and poll(p) == "healthy" and time.monotonic() < deadline - 240:
            # a cold boot: Triton autotuned in it, and its profile may hold do_bench's buffer (COLD_NOTE);
            # kept as the first boot's record, and the server booted again to be measured warm
            stop(p)
            group_gone(p)  # its engine's GPU memory freed before the next boot measures its own
            cold = p.log.with_name(f"{spec['server']}-cold.log")
            p.log.replace(cold)
            ctx.cold[spec["server"]] = {"autotune_results_written": tuned, "log": cold.name,
                                        **boot_memory(cold.read_text(errors="replace"))}
            p = launch(ctx, spec)
            ctx.procs[spec["server"]] = p
            wait([p], min(timeout, deadline - time.monotonic() - 90))
            say(f"  {spec['server']}: {poll(p)} after {time.monotonic() - p.started:.0f}s "
                f"(alone, again: the first boot wrote {tuned} Triton autotune results)")
        ctx.ready[spec["server"]].set()


# vLLM 0.33 caches Triton autotuning on disk (TRITON_CACHE_AUTOTUNING=1, vllm/env_override.py). On a
# cold cache the profile run autotunes, and Triton's do_bench allocates a 256 MiB buffer to flush the L2
# between timings (driver.get_empty_cache_for_benchmark) on top of what is live: vLLM's "peak
# activation" then carries it, and the KV pool is that much smaller on that boot only. The first boot
# of every fitted and out-of-sample kv_plan server so far took 2.5 min to profile and reported 0.13-0.27
# GiB more peak than the warm boots of the same configuration (run37-43, run46's a-oos).
COLD_NOTE = "first boot on a cold Triton autotune cache (its profile held do_bench's 256 MiB L2-flush buffer)"


def autotune_results(ctx: Context) -> int:
    """Triton autotune results on disk in the fleet's shared kernel cache (flash_e2e_triton_cache)."""
    root = Path(ctx.base_env.get("FLASH_E2E_TRITON_CACHE") or os.environ.get("FLASH_E2E_TRITON_CACHE")
                or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.rglob("*.autotune.json")) if root.is_dir() else 0


def boot_memory(text: str) -> dict:
    """What a boot log says of the KV pool and vLLM's split of the rest (None where it says nothing)."""
    from flash_cli.kvline import KV_LINE

    m, usage = KV_LINE.search(text), USAGE.search(text)
    return {"tokens": int(m.group(1).replace(",", "")) if m else None,
            "vllm_gib": dict(zip(("consumed", "peak_activation", "cudagraph"), map(float, usage.groups())))
            if usage else None}


# --- helpers the scenarios use -----------------------------------------------------------------------

def say(msg: str) -> None:
    print(msg, flush=True)


def log_text(p: Proc) -> str:
    return p.log.read_text(errors="replace") if p.log.exists() else ""


def flash(ctx: Context, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**ctx.base_env, "PYTHONPATH": os.pathsep.join([str(ROOT / "src")] + (
        [ctx.base_env["PYTHONPATH"]] if ctx.base_env.get("PYTHONPATH") else [])),
        "XDG_STATE_HOME": str(ctx.work / "state"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([ctx.python, "-m", "flash_cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


def keep(ctx: Context, name: str, text: str) -> Path:
    path = ctx.work / "artefacts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    ctx.artefacts.append(path)
    return path


def need_up(ctx: Context, name: str) -> Proc:
    p = ctx.procs.get(name)
    if p is None:  # a solo boot the deadline left out (H200 run36: the waves took the time)
        raise AssertionError(f"server {name} was never started: FLASH_E2E_DEADLINE came first")
    if poll(p) != "healthy":
        tail = "\n".join(log_text(p).splitlines()[-25:])
        raise AssertionError(f"server {name} is not healthy ({'exited ' + str(p.exited) if p.exited is not None else 'booting'}); "
                             f"log tail:\n{tail}")
    return p


def metrics(url: str) -> dict[str, float]:
    """The server's /metrics, summed per sample name (labels folded).

    Read with prometheus_client's parser (in the device image: 0.26.0), not split by hand. A counter's
    `_created` sample is a Unix time, not a count, so it is left out: run44 summed
    `vllm:prefix_cache_hits_created` into the hit count (1.8e9 "hits"), which made the greedy pairs'
    hit assertion impossible to fail.
    """
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return metric_samples(r.read().decode())


def metric_samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


PREFIX_HITS = "vllm:prefix_cache_hits_total"  # tokens served from the prefix cache (a counter)


def _chat(url: str, model: str, text: str, max_tokens: int = 16) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def gpu_memory_by_server(ctx: Context) -> dict[str, int]:
    """MiB of GPU memory per server: nvidia-smi's compute apps, mapped to our process groups."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    groups = {p.popen.pid: name for name, p in ctx.procs.items()}
    res: dict[str, int] = {}
    for line in out.splitlines():
        try:
            pid, mib = (int(x.strip()) for x in line.split(","))
            name = groups.get(os.getpgid(pid))
        except (ValueError, ProcessLookupError, PermissionError):
            continue
        if name:
            res[name] = res.get(name, 0) + mib
    return res


def pinned_kib(p: Proc) -> dict[str, int]:
    """VmPin/VmLck (kB) summed over the server's process group, from /proc."""
    tot = {"VmPin": 0, "VmLck": 0}
    for pid in _group_pids(p):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, val = line.partition(":")
                if key in tot:
                    tot[key] += int(val.split()[0])
        except (OSError, ValueError):
            continue
    return tot


def _group_pids(p: Proc) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.getpgid(int(d.name)) == p.popen.pid:
                out.append(int(d.name))
        except (ProcessLookupError, PermissionError):
            continue
    return out


# CUDA's pinned host memory (cudaHostAlloc, behind torch's pin_memory) is a MAP_SHARED|MAP_ANONYMOUS
# mapping the driver locks itself: it never shows in VmPin/VmLck (0 in every run, while vLLM logs
# pinned=True) but is resident shared-anonymous memory, which smaps names "/dev/zero (deleted)".
PINNED_MAPPING = "/dev/zero (deleted)"


def smaps_pinned_kib(text: str) -> int:
    """Rss (kB) of the shared-anonymous mappings in one /proc/PID/smaps text."""
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header line
            inside = line.rstrip().endswith(PINNED_MAPPING)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


def cuda_host_kib(p: Proc) -> int:
    """kB of CUDA pinned host memory over the server's process group (smaps_pinned_kib)."""
    total = 0
    for pid in _group_pids(p):
        try:
            total += smaps_pinned_kib(Path(f"/proc/{pid}/smaps").read_text())
        except OSError:
            continue
    return total


TABLE_BYTES = re.compile(r"PLE mmap: \d+ shards, (\d+) rows x (\d+) B")
PLE_INIT = re.compile(r"Initialized PLE embedding .*?weight_dtype=(\S+), weight_device=(\S+), pinned=(\w+)")
BANNER = re.compile(r"flash_vllm: base (\S+) \(vLLM ([^)]+)\), pid \d+, applied \[([\d,]*)\], not applied \[([^\]]*)\]")
PATCH1_TABLE = re.compile(r"flash_vllm patch 1: (PLE mmap: [^\n]*)")
MOE_BACKEND = re.compile(r"Using '([^']+)' NvFp4 MoE backend")


# --- scenarios ---------------------------------------------------------------------------------------

def check_boot(ctx: Context, name: str) -> dict:
    p = need_up(ctx, name)
    text = log_text(p)
    banners = BANNER.findall(text)
    assert banners, "no flash_vllm banner in the log: the plugin did not load (entry point / PYTHONPATH?)"
    applied = {int(n) for n in banners[0][2].split(",") if n}
    assert 1 in applied, f"patch 1 not applied: {banners[0]}"
    # the plugin resolves its base from the installed vLLM: the fleet must have rendered the same one
    assert banners[0][0] == ctx.base, f"the plugin runs base {banners[0][0]}, the fleet rendered BASE={ctx.base}"
    return {"boot_s": round(p.healthy_at - p.started, 1), "banner": banners[0], "applied": sorted(applied),
            "ple_init": PLE_INIT.findall(text), "nvfp4_moe_backend": sorted(set(MOE_BACKEND.findall(text)))}


PLE_NVFP4 = re.compile(r"flash_vllm patch 1: PLE mmap: NVFP4, (\d+) shards, (\d+) rows x (\d+) B")


def check_boot_nvfp4(ctx: Context, name: str) -> dict:
    """check_boot, and patch 1 opened the table with its NVFP4 codec (90 B rows at full size)."""
    res = check_boot(ctx, name)
    found = PLE_NVFP4.findall(log_text(need_up(ctx, name)))
    assert found, "patch 1 never opened the PLE table as NVFP4 (no 'PLE mmap: NVFP4' line in the log)"
    cfg = json.loads((ctx.snaps[ctx.procs[name].spec["fixture"]] / "config.json").read_text())["text_config"]
    head_dim = cfg["ple_embed_dim"] // (2 * cfg["heads_per_ngram"])
    assert int(found[0][2]) == head_dim // 2 + head_dim // 16, found[0]
    return {**res, "ple_nvfp4": found[0]}


def flash_test_args() -> list[str]:
    raw = os.environ.get("FLASH_E2E_TEST_ARGS")
    return shlex.split(raw) if raw is not None else list(TEST_NA_ARGS)


def check_flash_test(ctx: Context, name: str) -> dict:
    p = need_up(ctx, name)
    s = p.spec
    # the recipe words flash test needs to know what it tests (the context check compares CTX/YARN)
    words = [w for w in s["words"] if w.startswith(("TEST_", "MODEL=", "HF_CACHE=", "MODE=", "REVISION=", "CTX=", "YARN="))]
    proc = flash(ctx, "test", "--url", s["url"], "--model", s["model"], "--json", *flash_test_args(), "default", *words,
                 timeout=540)
    keep(ctx, f"flash-test-{name}.json", proc.stdout + ("\n# stderr\n" + proc.stderr if proc.stderr else ""))
    try:
        body = json.loads(proc.stdout)
    except json.JSONDecodeError:
        body = None
    assert proc.returncode == 0, f"flash test exit {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}"
    return {"declared_na": list(TEST_NA), "args": flash_test_args(), "checks": (body or {}).get("checks")}


def _probe(ctx: Context, name: str, label: str) -> Path:
    p = need_up(ctx, name)
    out = ctx.work / "artefacts" / f"probe-{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = flash(ctx, "probe", label, "--url", p.spec["url"], "--model", p.spec["model"], "--out", str(out),
                 "--max-tokens", str(PROBE_TOKENS), timeout=300)
    assert proc.returncode == 0, f"flash probe {label} exit {proc.returncode}: {proc.stderr[-1500:]}"
    ctx.artefacts.append(out)
    return out


def _diff(ctx: Context, a: Path, b: Path) -> dict:
    proc = flash(ctx, "probe", "--diff", str(a), str(b), "--json", timeout=60)
    verdict = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {"raw": proc.stdout}
    keep(ctx, f"diff-{a.stem}-{b.stem}.json", json.dumps(verdict, indent=2))
    texts_a = [r["text"] for r in json.loads(a.read_text())["results"]]
    texts_b = [r["text"] for r in json.loads(b.read_text())["results"]]
    same_bytes = [x.encode() == y.encode() for x, y in zip(texts_a, texts_b)]
    assert proc.returncode == 0 and all(same_bytes), f"probes differ: {verdict.get('lines', verdict)}"
    return {"identical": True, "prompts": len(same_bytes), "lines": verdict.get("lines", [])}


_PROBE_LOCK = threading.Lock()
_PROBES: dict[str, Path] = {}


def _shared_probe(ctx: Context, name: str) -> Path:
    """The baseline's probe, taken once and shared by every comparison with it."""
    with _PROBE_LOCK:
        if name not in _PROBES:
            _PROBES[name] = _probe(ctx, name, name)
        return _PROBES[name]


def check_probe(ctx: Context, off: str, on: str) -> dict:
    return _diff(ctx, _shared_probe(ctx, off), _probe(ctx, on, on))


def check_fix(ctx: Context, fixed: str, reference: str, stock: str) -> dict:
    """A patch that corrects stock vLLM on this base: with it, greedy output equals a server that avoids
    the bug another way (`reference`); stock's output against the same reference is recorded, not
    asserted (these five prompts may or may not meet the bug)."""
    a = _shared_probe(ctx, fixed)
    ref, st = _probe(ctx, reference, reference), _probe(ctx, stock, stock)
    texts = [[r["text"] for r in json.loads(p.read_text())["results"]] for p in (ref, st)]
    stock_differs = [i + 1 for i, (x, y) in enumerate(zip(*texts)) if x != y]
    try:
        out = _diff(ctx, ref, a)
    except AssertionError as exc:
        raise AssertionError(f"{exc} (stock differs from the reference on prompts {stock_differs})") from None
    return {**out, "stock_differs_on_prompts": stock_differs}


def _greedy(ctx: Context, name: str) -> Path:
    p = need_up(ctx, name)
    cfg = json.loads((ctx.snaps[p.spec["fixture"]] / "config.json").read_text())
    eos = (cfg.get("text_config") or cfg)["eos_token_id"]
    out = ctx.work / "artefacts" / f"greedy-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # ids below 1,024 only: the tiny vocabulary's plain tokens (the added ones sit above)
    proc = subprocess.run([ctx.python, "-m", "lab.bench_decode", "greedy", p.spec["url"], "--eos", str(eos),
                           "--vocab", "1024", "--out", str(out)], capture_output=True, text=True, timeout=400, cwd=ROOT,
                          env={**ctx.base_env, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), ctx.base_env.get("PYTHONPATH", "")])})
    keep(ctx, f"greedy-{name}.log", proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"greedy on {name}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1200:]}"
    ctx.artefacts.append(out)
    return out


def check_greedy_pair(ctx: Context, a: str, b: str) -> dict:
    """Both servers get the same requests in the same order (prefix hits alike), so any token that
    differs comes from what differs between them."""
    before = {n: metrics(ctx.procs[n].spec["url"]).get(PREFIX_HITS, 0.0) for n in (a, b)}
    with ThreadPoolExecutor(2) as pool:
        fa, fb = pool.map(lambda n: _greedy(ctx, n), (a, b))
    ca, cb = (json.loads(f.read_text())["cases"] for f in (fa, fb))
    first = None
    for x, y in zip(ca, cb):
        n = next((i for i, (t, u) in enumerate(zip(x["token_ids"], y["token_ids"])) if t != u), None)
        if n is None and len(x["token_ids"]) != len(y["token_ids"]):
            n = min(len(x["token_ids"]), len(y["token_ids"]))
        if n is not None:
            first = {"case": x["name"], "token": n, a: x["token_ids"][n:n + 4], b: y["token_ids"][n:n + 4]}
            break
    hits = {n: metrics(ctx.procs[n].spec["url"]).get(PREFIX_HITS, 0.0) - before[n] for n in (a, b)}
    res = {"cases": [c["name"] for c in ca], "tokens": sum(len(c["token_ids"]) for c in ca),
           "prefix_cache_hit_tokens": hits, "first_difference": first,
           "graph_modes": {n: ctx.procs[n].spec["argv"][ctx.procs[n].spec["argv"].index("--compilation-config") + 1]
                           for n in (a, b)}}
    assert first is None, f"greedy ids differ: {first}"
    assert all(hits.values()), f"no prefix-cache hits registered on {hits}: the hit case did not test a hit"
    return res


def check_prefix_retain(ctx: Context, default: str, dense: str) -> dict:
    """PR_PREFIX shared tokens + PR_TAIL of each prompt's own, three prompts one after another on each
    server; each prompt's hit tokens from vLLM's counter around it, and its greedy ids."""
    import random

    rng = random.Random(23)
    shared = [rng.randrange(16, 1024) for _ in range(PR_PREFIX)]
    prompts = [shared + [rng.randrange(16, 1024) for _ in range(PR_TAIL)] for _ in range(3)]
    got: dict = {}
    for name in (default, dense):
        p = need_up(ctx, name)
        url, model = p.spec["url"], p.spec["model"]
        rows = []
        for prompt in prompts:
            before = metrics(url).get(PREFIX_HITS, 0.0)
            ids = _greedy_ids(url, model, prompt, PR_TOKENS)
            rows.append({"hit_tokens": metrics(url).get(PREFIX_HITS, 0.0) - before, "ids": ids})
        got[name] = rows
    keep(ctx, "prefix-retain.json", json.dumps({"prompt_tokens": [len(x) for x in prompts], "shared": PR_PREFIX,
                                                "chunk": PR_CHUNK, "servers": got}))
    hits = {n: [r["hit_tokens"] for r in rows] for n, rows in got.items()}
    differ = [i for i, (x, y) in enumerate(zip(got[default], got[dense])) if x["ids"] != y["ids"]]
    res = {"hit_tokens": hits, "ids_differ": differ, "block_size": block_size(need_up(ctx, dense).spec)}
    assert not differ, f"greedy ids differ between {default} and {dense} on prompts {differ}: {hits}"
    assert hits[dense][1] >= PR_CHUNK, f"{dense}: the second prompt hit {hits[dense][1]:.0f} tokens, not a chunk end: {hits}"
    assert hits[default][1] == 0, f"{default}: the second prompt hit {hits[default][1]:.0f} (docs/PREFIX-CACHE.md says 0): {hits}"
    assert hits[default][2] >= PR_CHUNK, f"{default}: the third prompt hit {hits[default][2]:.0f} tokens (junction): {hits}"
    return res


def qsa_budget(ctx: Context, fixture: str) -> int:
    """The fixture's QSA budget in tokens (indexer_budget; the selection keeps budget/ratio blocks)."""
    cfg = json.loads((ctx.snaps[fixture] / "config.json").read_text())
    return int((cfg.get("text_config") or cfg)["indexer_budget"])


def qb_prompts(vocab: int = 1024, seed: int = 11) -> list[list[int]]:
    """QB_PROMPTS random token-id prompts below the tiny vocabulary's added tokens, fixed by `seed`."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(n)] for n in QB_PROMPTS]


def _greedy_ids(url: str, model: str, prompt: list[int], tokens: int) -> list[int]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        ids = json.loads(r.read())["choices"][0].get("token_ids")
    assert ids is not None, f"{url}: no token_ids in the reply (return_token_ids unsupported?)"
    return ids


def tries_differ(tries: list[list[list[int]]]) -> list[tuple[int, int]]:
    """(try, prompt) pairs whose ids differ from the first try's for that prompt."""
    return [(t, i) for t in range(1, len(tries)) for i, ids in enumerate(tries[t]) if ids != tries[0][i]]


def check_qsa_past_budget(ctx: Context) -> dict:
    names = ("qb-default", "qb-exact", "qb-off")
    procs = {n: need_up(ctx, n) for n in names}
    prompts = qb_prompts()
    budget = qsa_budget(ctx, procs["qb-default"].spec["fixture"])
    assert min(map(len, prompts)) > budget, f"prompts of {min(map(len, prompts))} tokens do not pass the budget {budget}"

    def run(name: str) -> list[list[list[int]]]:
        p = procs[name]
        return [[_greedy_ids(p.spec["url"], p.spec["model"], x, QB_TOKENS) for x in prompts] for _ in range(QB_TRIES)]

    with ThreadPoolExecutor(len(names)) as pool:
        got = dict(zip(names, pool.map(run, names)))
    keep(ctx, "qsa-past-budget.json", json.dumps({"prompt_tokens": [len(x) for x in prompts], "budget": budget, "ids": got}))
    cells = QB_TRIES * len(prompts)
    off_diff = tries_differ(got["qb-off"])
    res = {"prompt_tokens": [len(x) for x in prompts], "budget_tokens": budget, "tries": QB_TRIES,
           "default_vs_exact_differ": [i for i, (x, y) in enumerate(zip(got["qb-default"][0], got["qb-exact"][0])) if x != y],
           "default_try_differ": tries_differ(got["qb-default"]), "exact_try_differ": tries_differ(got["qb-exact"]),
           "off_try_differ": off_diff, "off_try_difference_rate": round(len(off_diff) / (cells - len(prompts)), 3),
           "off_vs_exact_differ": [i for i, (x, y) in enumerate(zip(got["qb-off"][0], got["qb-exact"][0])) if x != y]}
    assert not res["default_try_differ"], f"the recipe's greedy ids changed between tries: {res['default_try_differ']}"
    assert not res["exact_try_differ"], f"the exact reference changed between tries: {res['exact_try_differ']}"
    assert not res["default_vs_exact_differ"], f"the recipe differs from the exact reference on prompts {res['default_vs_exact_differ']}"
    return res


def block_size(spec: dict) -> int:
    """The server's KV block size: its `--block-size` (TINY_EXTRA), else vLLM's default 16."""
    argv = spec["argv"]
    return int(argv[argv.index("--block-size") + 1]) if "--block-size" in argv else 16


def check_prefix_hit(ctx: Context, name: str) -> dict:
    """A greedy prompt of PREFIX_HIT_BLOCKS full KV blocks, measured with the server's tokenizer
    (/tokenize), sent cold (a fresh nonce first) then again: the second must register prefix-cache
    hits and answer byte-identically. The probe prompts are shorter than one 256-token block, so no
    block of theirs can be cached (H200 run34: no hit)."""
    import uuid

    from flash_cli.gates import sizing
    from flash_cli.gates.client import Client

    p = need_up(ctx, name)
    url, model = p.spec["url"], p.spec["model"]
    block = block_size(p.spec)
    goal = PREFIX_HIT_BLOCKS * block + block // 4
    client = Client(url, timeout=300)
    sized = sizing.ledger(client, model, goal, nonce=uuid.uuid4().hex[:12], completion=PROBE_TOKENS)
    assert sized.tokens >= 2 * block, (f"the prefix-hit prompt has {sized.tokens} tokens ({sized.note}): fewer than "
                                       f"two {block}-token blocks, no hit to test")
    body = {"model": model, "prompt": sized.prompt, "max_tokens": PROBE_TOKENS, "temperature": 0, "logprobs": 3}
    before = metrics(url)
    runs = []
    for label in ("cold", "warm"):
        reply = client.post("/v1/completions", body)
        assert reply.ok, f"{label} request: {reply.why()}"
        choice = reply.body["choices"][0]
        lp = choice.get("logprobs") or {}
        runs.append({"label": label, "text": choice.get("text") or "", "usage": reply.body.get("usage"),
                     "first_logprobs": (lp.get("top_logprobs") or [None])[0], "tokens": lp.get("tokens") or [],
                     "top_logprobs": lp.get("top_logprobs") or [], "seconds": round(reply.seconds, 3)})
    after = metrics(url)
    hits = after.get(PREFIX_HITS, 0.0) - before.get(PREFIX_HITS, 0.0)
    divergence = first_divergence(runs[0], runs[1])
    keep(ctx, f"prefix-hit-{name}.json", json.dumps({"sizing": sized.as_data(), "note": sized.note, "block_size": block,
                                                     "prefix_cache_hit_tokens": hits, "divergence": divergence,
                                                     "runs": runs}, indent=2))
    res = {"prompt_tokens": sized.tokens, "measured": sized.measured, "block_size": block,
           "full_blocks": sized.tokens // block, "prefix_cache_hit_tokens": hits}
    from flash_cli.gates.checks import _logprob_delta

    same = runs[0]["text"].encode() == runs[1]["text"].encode()
    delta = _logprob_delta(runs[0]["first_logprobs"], runs[1]["first_logprobs"])
    assert hits > 0, f"the second request registered no prefix-cache hits ({sized.note}, block {block})"
    assert same, (f"prefix-hit answer differs from the cold one at {divergence}: "
                  f"{runs[0]['text'][:80]!r} vs {runs[1]['text'][:80]!r}")
    assert delta <= PREFIX_LOGPROB_TOL, f"prefix-hit first-token logprobs differ by {delta:.3g} (> {PREFIX_LOGPROB_TOL})"
    return {**res, "identical": True, "first_logprob_delta": delta}


def first_divergence(cold: dict, warm: dict) -> dict | None:
    """Where two greedy runs part: the token index, both tokens, and the cold run's margin there
    (top-1 minus top-2 logprob): a margin near bf16 noise says a near-tie flipped, not a wrong row."""
    a, b = cold.get("tokens") or [], warm.get("tokens") or []
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None if len(a) == len(b) else {"token": min(len(a), len(b)), "lengths": [len(a), len(b)]}
    out = {"token": i, "cold": a[i], "warm": b[i]}
    for label, run in (("cold", cold), ("warm", warm)):
        top = (run.get("top_logprobs") or [None] * (i + 1))[i] or {}
        vals = sorted(top.values(), reverse=True)
        if len(vals) >= 2:
            out[f"{label}_margin"] = round(vals[0] - vals[1], 5)
    return out


PUBLISH_WAIT_S = 5.0  # the metrics bridge's publish interval (1 s) with room for a loaded machine


def check_ple_memory(ctx: Context, on: str, off: str | None) -> dict:
    """Patch 1's table from disk, off the GPU and unpinned, its series moving; against `off` (the same
    server without patch 1) also the GPU memory and pinned bytes. `off` None: the patch-1 side alone
    (where stock cannot load the table, _na_stock_ple)."""
    p_on = need_up(ctx, on)
    p_off = need_up(ctx, off) if off else None
    m0 = metrics(p_on.spec["url"])
    _chat(p_on.spec["url"], p_on.spec["model"], "invoice ledger balance credit debit account " * 20, 16)
    # the engine publishes its record at most every FLASH_METRICS_INTERVAL_MS (1 s): a scrape right
    # after the reply can still see the previous one (run38 scraped at once and saw no movement)
    t0 = time.monotonic()
    while True:
        m1 = metrics(p_on.spec["url"])
        ple = {k: m1[k] - m0.get(k, 0.0) for k in m1 if k.startswith("vllm:ple_mmap")}
        moved = {k: v for k, v in ple.items() if v}
        if moved or time.monotonic() - t0 > PUBLISH_WAIT_S:
            break
        time.sleep(0.25)
    publish_wait_s = round(time.monotonic() - t0, 2)
    gpu = gpu_memory_by_server(ctx)
    sides = ((on, p_on),) + (((off, p_off),) if p_off else ())
    init = {n: PLE_INIT.findall(log_text(p)) for n, p in sides}
    mmap = {n: PATCH1_TABLE.findall(log_text(p)) for n, p in sides}
    kv = {n: (lambda m: m.group(0) if m else None)(re.search(r"Available KV cache memory:[^\n]*", log_text(p)))
          for n, p in sides}
    res = {"patch1_table": mmap, "kv_memory": kv, "gpu_mib": {n: gpu.get(n) for n, _ in sides},
           "pinned_kib": {n: pinned_kib(p) for n, p in sides}, "cuda_host_kib": {n: cuda_host_kib(p) for n, p in sides},
           "ple_init": init, "ple_mmap_deltas": ple, "publish_wait_s": publish_wait_s}
    init_on = init[on]
    assert mmap[on], f"{on}: no 'flash_vllm patch 1: PLE mmap' line: the table was not opened from disk"
    assert not off or not mmap[off], f"{off}: patch 1 is off but its table line is in the log"
    assert ple, "no vllm:ple_mmap_* series on /metrics"
    assert moved, f"vllm:ple_mmap_* did not move after a request: {ple}"
    for dtype, device, pinned in init_on:
        assert device != "cuda" and not device.startswith("cuda:") and pinned == "False", \
            f"patch 1 on, but the PLE table is on {device} (pinned={pinned})"
    if off:  # what patch 1 saves, in bytes: where stock keeps the table, the patched server does not
        rows, width = (int(x) for x in TABLE_BYTES.search(mmap[on][0]).groups())
        table_kib = rows * width / 1024
        res["table_kib"] = round(table_kib)
        for dtype, device, pinned in init[off]:
            if device.startswith("cuda"):
                saved = (res["gpu_mib"][off] or 0) - (res["gpu_mib"][on] or 0)
                assert saved * 1024 >= table_kib, (f"GPU memory with patch 1 ({res['gpu_mib'][on]} MiB) is not below "
                                                   f"{off}'s ({res['gpu_mib'][off]} MiB) by the table's {table_kib / 1024:.1f} MiB")
            elif pinned == "True":
                saved = res["cuda_host_kib"][off] - res["cuda_host_kib"][on]
                assert saved >= table_kib, (f"pinned host memory with patch 1 ({res['cuda_host_kib'][on]} kB) is not below "
                                            f"{off}'s ({res['cuda_host_kib'][off]} kB, pinned=True) by the table's {table_kib:.0f} kB")
    return res


def plan_hardware(gpus=None) -> list[str]:
    """`flash plan`'s hardware words for this card: the h200 preset on an H200 (its cudaMemGetInfo
    total, which nvidia-smi overstates by the driver's share); elsewhere (an H100 when no H200 is
    lent) the planner's own detection from nvidia-smi."""
    from flash_cli.plan.hardware import query_gpus

    gpus = query_gpus() if gpus is None else gpus
    return ["--hardware", "h200"] if gpus and "H200" in gpus[0][0].upper() else []


def check_kv_plan(ctx: Context, name: str) -> dict:
    p = need_up(ctx, name)
    booted = boot_memory(log_text(p))
    measured = booted["tokens"]
    assert measured is not None, "no 'GPU KV cache size: N tokens' line in the boot log"
    words = [w for w in p.spec["words"]]
    hw = plan_hardware()
    proc = flash(ctx, "plan", *hw, "--json", "default", *words, timeout=120)
    keep(ctx, f"plan-{name}.json", proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"flash plan exit {proc.returncode}: {proc.stderr[-800:]}"
    plan = json.loads(proc.stdout)
    predicted = _find(plan, "kv_cache_tokens")
    assert isinstance(predicted, int), "flash plan --json has no kv_cache_tokens"
    err = (predicted - measured) / measured
    budget = _find(plan, "budget") or {}
    res = {"measured_tokens": measured, "predicted_tokens": predicted, "error": round(err, 4),
           "hardware": " ".join(hw) or "detected (nvidia-smi)",
           "vllm_gib": booted["vllm_gib"],  # vLLM's own split of the non-KV memory, beside the plan's terms
           "plan_gib": {k: budget.get(k) for k in ("weights_gib", "activations_gib", "topk_buffers_gib",
                                                   "runtime_overhead_gib", "non_kv_gib", "kv_cache_gib")}}
    cold = ctx.cold.get(name)
    if cold:  # reported, not judged: what a user's first boot on a cold cache gets (COLD_NOTE)
        res["cold_boot"] = {**cold, "note": COLD_NOTE,
                            "error": round((predicted - cold["tokens"]) / cold["tokens"], 4) if cold["tokens"] else None}
    assert abs(err) <= 0.02, f"plan {predicted:,} vs vLLM {measured:,} tokens: {err:+.2%} (limit 2%)"
    return res


def _find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            hit = _find(v, key)
            if hit is not None:
                return hit
    return None


def check_diag(ctx: Context, names: tuple[str, ...]) -> dict:
    """What each diagnosis boot said: its state, patch 1's id checks, the first error lines."""
    out = {}
    for name in names:
        p = ctx.procs[name]
        lines = log_text(p).splitlines()
        out[name] = {"state": poll(p), "exit": p.exited,
                     "debug": [ln.split("patch 1 debug: ", 1)[1][:3000] for ln in lines if "patch 1 debug: " in ln][:8],
                     "errors": [ln[:600] for ln in lines if re.search(r"Error|error:|Traceback", ln)][:12],
                     "tail": lines[-15:] if p.exited is not None else []}
    return out


def check_broken(ctx: Context, name: str) -> dict:
    p = ctx.procs[name]
    text = log_text(p)
    brk = breaker(ctx.base)
    assert p.exited is not None and p.exited != 0, f"the broken boot did not fail (state {poll(p)})"
    want = f"flash_vllm patch {brk['patch']} ({brk['name']}) cannot apply"
    assert want in text, f"exit {p.exited} but the log does not name the patch ({want!r}); tail: {text[-1500:]}"
    assert "FLASH_E2E_BREAK applied" in text, "the breaker's sitecustomize did not run"
    return {"exit": p.exited, "refused_after_s": round((p.ended_at or time.monotonic()) - p.started, 1),
            "line": next(line for line in text.splitlines() if want in line)[:400]}


def mamba_block(url: str) -> int | None:
    """The server's Mamba block (vllm:cache_config_info's mamba_block_size label), None if it does not say."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                try:
                    return int(sample.labels.get("mamba_block_size") or 0) or None
                except ValueError:
                    return None
    return None


def _post(url: str, path: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _crossing(p: Proc, block: int, seed: int) -> dict:
    """One greedy request whose prompt ends PROMPT_SLACK tokens before a Mamba block boundary and whose
    decode runs past it: the step that crosses makes vLLM's align mode copy state between block columns
    (the fused precopy the injection targets). Random plain ids (below the tiny vocabulary's added ones),
    a fresh prompt each time."""
    import random

    rng = random.Random(seed)
    prompt = [rng.randrange(16, 1024) for _ in range(block - triggers.PROMPT_SLACK)]
    body = {"model": p.spec["model"], "prompt": prompt, "max_tokens": triggers.P3_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    return _post(p.spec["url"], "/v1/completions", body)


def _inject(p: Proc, want_guard: bool, wait_s: float = 60.0) -> dict:
    """Send crossing requests until the injection fired, then (want_guard) keep the engine busy until patch
    3's asynchronous report (every 5 s, read one launch later) shows in the log; then /health and one
    more request. Errors are recorded, not raised (the stock side is expected to die)."""
    out: dict = {"requests": 0, "errors": []}
    url = p.spec["url"]
    try:
        declared = mamba_block(url)
    except Exception as exc:  # noqa: BLE001 - recorded
        declared, out["errors"] = None, [f"metrics: {exc}"]
    # a server that does not say its Mamba block: try the candidates (0.33's 256-token KV block, 0.29's 512)
    out["mamba_block"] = declared
    # the first crossing should do; a second boundary (2 blocks) in case that step copied nothing
    for i, block in enumerate([declared, 2 * declared] if declared else [256, 512, 1024]):
        try:
            _crossing(p, block, seed=1000 + i)
            out["requests"] += 1
        except Exception as exc:  # noqa: BLE001 - the stock engine may die here
            out["errors"].append(f"crossing ({block}): {type(exc).__name__}: {exc}"[:400])
        if triggers.fired(log_text(p)):
            break
    t0 = time.monotonic()
    while want_guard and not triggers.guard_counts(log_text(p)) and time.monotonic() - t0 < wait_s:
        if poll(p) == "exited":
            break
        try:
            _post(url, "/v1/completions", {"model": p.spec["model"], "prompt": [101, 202, 303], "max_tokens": 32,
                                           "temperature": 0, "ignore_eos": True})
            out["requests"] += 1
        except Exception as exc:  # noqa: BLE001
            out["errors"].append(f"follow-up: {type(exc).__name__}: {exc}"[:400])
            time.sleep(1)
    out["guard_wait_s"] = round(time.monotonic() - t0, 1)
    out["health_after"] = _health(url)
    try:
        after = _post(url, "/v1/completions", {"model": p.spec["model"], "prompt": [5, 6, 7], "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True}, timeout=60)
        out["answered_after"] = bool(after.get("choices")) and after["choices"][0].get("finish_reason") == "length"
    except Exception as exc:  # noqa: BLE001
        out["answered_after"] = False
        out["errors"].append(f"after: {type(exc).__name__}: {exc}"[:400])
    return out


def check_guard_p3(ctx: Context, on: str, stock: str) -> dict:
    """Patch 3 met its trigger: the injected out-of-range id reached a fused copy (the injection's `fired`
    line), the guard counted it (its own log line, N >= 1), and the server lives on. The stock server
    with the same injection is recorded: its state, exit and the log lines that say how it ended."""
    p = need_up(ctx, on)
    text = log_text(p)
    refused = triggers.INJECT_REFUSED.findall(text)
    assert not refused, f"the injection refused to install: {refused}"
    assert triggers.INJECT_READY.search(text), ("no 'FLASH_E2E_MAMBA_INJECT ready' line: the fused state-copy context "
                                                "was never built (not align mode with spec decode?) or the hook did not load")
    run = _inject(p, want_guard=True)
    text = log_text(p)
    res = {"on": {**run, "ready": triggers.INJECT_READY.findall(text), "fired": triggers.fired(text),
                  "guard_counts": triggers.guard_counts(text), "state": poll(p)}}
    keep(ctx, "guard-p3.json", json.dumps(res, indent=2))
    sp = ctx.procs.get(stock)
    if sp is not None and poll(sp) == "healthy":
        srun = _inject(sp, want_guard=False)
        time.sleep(10)  # let an engine that died take the API server down with it
        stext = log_text(sp)
        res["stock"] = {**srun, "fired": triggers.fired(stext), "guard_counts": triggers.guard_counts(stext),
                        "state": poll(sp), "exit": sp.exited,
                        "death_lines": [ln[:400] for ln in stext.splitlines() if triggers.STOCK_DEATH.search(ln)][:12]}
    else:
        res["stock"] = {"state": poll(sp) if sp else "never started"}
    keep(ctx, "guard-p3.json", json.dumps(res, indent=2))
    on_res = res["on"]
    assert on_res["fired"], f"the injection never fired (no crossing precopy launch?): {on_res}"
    assert on_res["guard_counts"] and max(on_res["guard_counts"]) >= 1, \
        f"no 'mamba state-copy guard: N out-of-range' line after the injection: {on_res}"
    assert on_res["state"] == "healthy" and on_res["health_after"], f"{on} did not survive the injection: {on_res}"
    assert on_res["answered_after"], f"{on} no longer answers after the injection: {on_res}"
    return res


def check_guard_p13(ctx: Context, on: str, off: str) -> dict:
    """Patch 13 met its trigger: the reply carries `<tool_call>` (and `</tool_call>`) as their special tokens,
    quoted and inside a fence, with tools on (what stock turns into a call, tests/vllm shows it); with
    patch 13 the content is the whole text and no tool call comes out. The patch-13-off server's answer
    is recorded."""
    res: dict = {}
    for name in (on, off):
        p = need_up(ctx, name)
        ids = {t: _post(p.spec["url"], "/tokenize", {"model": p.spec["model"], "prompt": t,
                                                     "add_special_tokens": False})["tokens"] for t in triggers.SPECIAL}
        res[name] = {"special_ids": ids}
        for case in triggers.P13_CASES:
            reply = _post(p.spec["url"], "/v1/chat/completions", triggers.p13_body(p.spec["model"], case))
            choice = reply["choices"][0]
            token_ids = choice.get("token_ids")
            single = {v[0] for v in ids.values() if len(v) == 1}
            res[name][case] = {**triggers.p13_verdict(case, choice["message"]), "finish_reason": choice.get("finish_reason"),
                               "special_ids_in_output": None if token_ids is None else [i for i in token_ids if i in single]}
    keep(ctx, "guard-p13.json", json.dumps(res, indent=2))
    for case, text in triggers.P13_CASES.items():
        got = res[on][case]
        want = sum(text.count(t) for t in triggers.SPECIAL)
        # the trigger was met: the markers came as their special tokens (what stock opens a call on)
        assert got["special_ids_in_output"] is not None, f"{case}: the reply has no token_ids (return_token_ids)"
        assert len(got["special_ids_in_output"]) == want, f"{case}: special tokens {got['special_ids_in_output']}, want {want}"
        assert got["kept_as_text"], f"{case}: with patch 13 the reply was {got['content']!r} + tool calls {got['tool_calls']}"
    res["stock_cut"] = {case: not res[off][case]["kept_as_text"] for case in triggers.P13_CASES}
    return res


# --- running the scenarios ---------------------------------------------------------------------------

def scenario_groups(chosen: list[Scenario]) -> list[list[Scenario]]:
    """Scenarios that touch a common server, transitively, in one group (in selection order); the
    groups share no server. A group runs its scenarios one after another: two scenarios on one server
    at once change its batches, and the tiny random model's greedy output follows the batch
    composition (H200 run33: probe-off cold vs warm differed at prompt 4 exactly as probe-p1/p3 did;
    run34, one at a time: identical)."""
    parent = list(range(len(chosen)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, s in enumerate(chosen):
        for server in s.servers:
            if server in owner:
                parent[root(i)] = root(owner[server])
            else:
                owner[server] = i
    groups: dict[int, list[Scenario]] = {}
    for i, s in enumerate(chosen):
        groups.setdefault(root(i), []).append(s)
    return sorted(groups.values(), key=lambda g: chosen.index(g[0]))


def run_scenarios(ctx: Context, chosen: list[Scenario], deadline: float) -> dict[str, dict]:
    """Groups side by side (FLASH_E2E_PARALLEL at a time), each group's scenarios in order, until the
    deadline (a device call is cut at 10 minutes; what finished must still come back)."""
    finished: dict[str, dict] = {}
    lock = threading.Lock()

    def one(s: Scenario) -> None:
        t = time.monotonic()
        try:
            r = {"ok": True, "result": s.run(ctx)}
        except Exception as exc:  # noqa: BLE001 - every scenario reports, none stops the others
            r = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        r["s"] = round(time.monotonic() - t, 1)
        with lock:
            finished[s.name] = r
        say(f"{'PASS' if r['ok'] else 'FAIL'} {s.name} ({r['s']}s)")

    def group(g: list[Scenario]) -> None:
        for s in g:
            # each scenario waits for its own servers only (not the whole group's): probe_p1 runs
            # while probe-p13 still boots; a booting server does not touch another one's batches
            for name in s.servers:
                ev = ctx.ready.get(name)
                if ev is not None and not ev.wait(max(0.0, deadline - 45 - time.monotonic())):
                    return
            if time.monotonic() > deadline - 45:
                return
            one(s)

    groups = scenario_groups(chosen)
    raw = os.environ.get("FLASH_E2E_PARALLEL", "")
    if raw and not raw.isdigit():
        raise SystemExit(f"gpu-e2e: FLASH_E2E_PARALLEL={raw!r}: want a whole number (groups at a time), or unset for all")
    pool = ThreadPoolExecutor(max_workers=max(1, int(raw) if raw else len(groups)))
    futures = [pool.submit(group, g) for g in groups]
    futures_wait(futures, timeout=max(5.0, deadline - time.monotonic() - 45))
    pool.shutdown(wait=False, cancel_futures=True)
    with lock:
        done = dict(finished)
    return {s.name: done.get(s.name, {"ok": False, "error": "not finished before the deadline (FLASH_E2E_DEADLINE)"})
            for s in chosen}


# --- driver ------------------------------------------------------------------------------------------

def device_env() -> dict[str, str]:
    env_sh = os.environ.get("FLASH_E2E_VLLM_ENV")
    if not env_sh:
        return dict(os.environ)
    if not Path(env_sh).is_file():
        raise SystemExit(f"gpu-e2e: FLASH_E2E_VLLM_ENV={env_sh} is not a file (the device payload's env.sh)")
    out = subprocess.run(["bash", "-c", f"set -a; source {shlex.quote(env_sh)} >/dev/null; env -0"],
                         capture_output=True, check=True).stdout.decode()
    return dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)


def cuda_problem(env: dict[str, str], python: str) -> str | None:
    if not shutil.which("nvidia-smi"):
        return "nvidia-smi not found"
    code = "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    r = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return f"torch.cuda.is_available() is false in {python} ({r.stderr.strip()[-300:]})"
    return None


def vllm_version(env: dict[str, str], python: str) -> tuple[str | None, str | None]:
    """(the vLLM version importable in the device env, None) or (None, why not)."""
    r = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return None, (f"vLLM does not import in {python} (set FLASH_E2E_VLLM_ENV to the payload's env.sh): "
                      f"{r.stderr.strip()[-300:]}")
    return r.stdout.strip().splitlines()[-1].strip(), None


def fleet_base(version: str | None) -> str:
    """The base every server renders: FLASH_E2E_BASE if set, else the base of the device env's
    vLLM `version` (catalogued exactly), else (a dry run: no version) the catalogue's CURRENT. A
    FLASH_E2E_BASE that contradicts a catalogued installed version is refused: the plugin resolves
    its base from the installed vLLM, so the servers would run another base than the one rendered."""
    raw = os.environ.get("FLASH_E2E_BASE", "").strip()
    installed = None
    if version is not None:
        try:
            installed = releases.by_version(version).base
        except releases.ReleaseError as exc:
            if not raw:
                raise SystemExit(f"gpu-e2e: the device env's {exc} (FLASH_E2E_VLLM_ENV; "
                                 "or name the base with FLASH_E2E_BASE)") from None
    if not raw:
        return installed or releases.CURRENT
    try:
        base = releases.get(raw).base
    except releases.ReleaseError as exc:
        raise SystemExit(f"gpu-e2e: FLASH_E2E_BASE={raw!r}: {exc}") from None
    if installed and installed != base:
        raise SystemExit(f"gpu-e2e: FLASH_E2E_BASE={base} but the device env has vLLM {version} (base {installed}); "
                         "unset FLASH_E2E_BASE or point FLASH_E2E_VLLM_ENV at that base's payload")
    return base


def fixture_problem(env: dict[str, str], python: str) -> str | None:
    r = subprocess.run([python, "-c", "import numpy, safetensors, torch, requests, prometheus_client"], env=env,
                       capture_output=True, text=True)
    return None if r.returncode == 0 else ("the fixture writer and the flash CLI need numpy, safetensors, torch, requests, "
                                           f"prometheus_client: {r.stderr.strip()[-300:]}")


def commit() -> str:
    return tree_commit(ROOT, unknown="unknown (set FLASH_E2E_COMMIT)")


def make_context(dry: bool) -> Context:
    work = Path(os.environ.get("FLASH_E2E_WORK") or tempfile.mkdtemp(prefix="flash-e2e-work-"))
    out = Path(os.environ.get("FLASH_E2E_OUT") or tempfile.mkdtemp(prefix="flash-e2e-out-"))
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = {} if dry else device_env()
    python = os.environ.get("FLASH_E2E_PYTHON") or (shutil.which("python3", path=env.get("PATH")) if env else None) or sys.executable
    return Context(work=work, out=out, python=python, base_env=env, snaps={}, base=fleet_base(None),
                   port0=int(os.environ.get("FLASH_E2E_PORT", "18400")),
                   gpu_mem=_share("FLASH_E2E_GPU_MEM", "0.05"), solo_gpu_mem=_share("FLASH_E2E_SOLO_GPU_MEM", "0.12"),
                   kv_mem=kv_mem(), dry=dry)


def _share(name: str, default: str) -> float:
    raw = os.environ.get(name, default)
    try:
        val = float(raw)
    except ValueError:
        val = -1.0
    if not 0 < val <= 0.95:
        raise SystemExit(f"gpu-e2e: {name}={raw!r}: want a GPU memory share in (0, 0.95], e.g. {default}")
    return val


def kv_mem() -> str | None:
    """FLASH_E2E_KV_MEM: a size flash's KV_CACHE_MEM accepts, or off."""
    from flash_cli.settings import parse_size

    raw = os.environ.get("FLASH_E2E_KV_MEM", "1G").strip()
    if raw.lower() in ("", "off", "0", "none"):
        return None
    try:
        parse_size(raw)
    except ValueError as exc:
        raise SystemExit(f"gpu-e2e: FLASH_E2E_KV_MEM={raw!r}: {exc} (or off)") from None
    return raw


def plan(ctx: Context, chosen: list[Scenario]) -> list[dict]:
    """Every server of the chosen scenarios that apply on ctx.base (an n/a one boots nothing)."""
    chosen = applicable(chosen, ctx.base)
    names = [n for n in SERVERS if any(n in s.servers for s in chosen)]
    solo = {n for s in chosen if s.solo for n in s.servers}
    return [render(ctx, SERVERS[n], i, n in solo) for i, n in enumerate(names)]


def print_plan(ctx: Context, specs: list[dict], chosen: list[Scenario]) -> None:
    na = not_applicable(chosen, ctx.base)
    chosen = applicable(chosen, ctx.base)
    say(f"gpu-e2e plan on base {ctx.base} (vLLM {ctx.vllm or '?'}): {len(chosen)} scenario(s), "
        f"{len(specs)} server(s), {len(na)} n/a")
    for s in chosen:
        say(f"  scenario {s.name}: servers {', '.join(s.servers)} — {s.doc}")
    for name, why in na.items():
        say(f"  N/A {name}: {why}")
    for i, g in enumerate(scenario_groups(chosen)):
        say(f"  group {i + 1} (one scenario at a time; groups side by side): {', '.join(s.name for s in g)}")
    size = boot_wave()
    for i, w in enumerate(waves(specs, size)):
        say(f"  boot wave {i + 1} (at most {size} at once, FLASH_E2E_BOOT_WAVE): {', '.join(s['server'] for s in w)}")
    for spec in specs:
        say(f"\n== server {spec['server']} (fixture {spec['fixture']}, expect {spec['expect']}"
            f"{', boots alone' if spec['solo'] else ''}) {spec['url']}")
        say("   settings: " + shlex.join(spec["words"]))
        say("   argv: " + shlex.join(spec["argv"]))
        say("   env (from the RunSpec): " + " ".join(f"{k}={shlex.quote(v)}" for k, v in spec["spec_env"].items()))
        say("   env (harness): " + " ".join(f"{k}={shlex.quote(v)}" for k, v in spec["harness_env"].items()))
        for w in spec["preflight"] + spec["warnings"]:
            say(f"   ! {w}")
        if spec["unmapped_mounts"]:
            say(f"   (container-only mounts not mapped: {', '.join(spec['unmapped_mounts'])})")


def pack(ctx: Context, results: dict) -> None:
    """≤ 8 flat files: results.json, summary.txt, logs.tar.gz (logs + artefacts, each capped at 4 MiB)."""
    (ctx.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    verdicts = results["scenarios"]
    ran = ran_verdicts(results)
    lines = [f"gpu-e2e on base {results.get('base', '?')} (vLLM {results.get('vllm', '?')}) at commit {results['commit']} "
             f"on {results.get('device', '?')}: {sum(r['ok'] is True for r in ran)}/{len(ran)} scenarios passed, "
             f"{len(verdicts) - len(ran)} n/a"]
    for name, r in verdicts.items():
        if "na" in r:
            lines.append(f"N/A {name}: {r['na']}")
            continue
        lines.append(f"{'PASS' if r['ok'] else 'FAIL'} {name}: " + (r.get("error") or json.dumps(r.get("result"), default=str))[:600])
    for name, s in results["servers"].items():
        lines.append(f"server {name}: {s}")
    (ctx.out / "summary.txt").write_text("\n".join(lines) + "\n")
    cap = 4 << 20
    with tarfile.open(ctx.out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted((ctx.work / "logs").glob("*.log")) + ctx.artefacts:
            data = path.read_bytes() if path.exists() else b""
            if len(data) > cap:
                data = data[: cap // 4] + b"\n...[cut]...\n" + data[-(cap - cap // 4):]
            info = tarfile.TarInfo(f"gpu-e2e/{path.parent.name}/{path.name}")
            info.size = len(data)
            import io
            tar.addfile(info, io.BytesIO(data))


def run(chosen: list[Scenario], dry: bool) -> int:
    res = run_selected(chosen, dry)
    if "exit" in res:
        print(res["error"], file=sys.stderr)
        return res["exit"]
    return 0 if res.get("dry") or passed(res) else 1


def ran_verdicts(results: dict) -> list[dict]:
    """The verdicts of the scenarios that applied on the base (an n/a one carries "na", no verdict)."""
    return [r for r in results["scenarios"].values() if "na" not in r]


def passed(results: dict) -> bool:
    """Every scenario that applies on the base passed, and one at least ran: an n/a scenario is
    neither passed nor failed, and a selection that is all n/a proved nothing."""
    ran = ran_verdicts(results)
    return bool(ran) and all(r["ok"] is True for r in ran)


def run_selected(chosen: list[Scenario], dry: bool = False) -> dict:
    """The whole run → results (with "exit"/"error" when it could not start); pytest and the CLI share it."""
    ctx = make_context(dry)
    if dry:
        from fakes import tiny_model  # on CPU: the real fixtures, so the argv names real snapshots

        ctx.snaps = tiny_model.build(ctx.cache)
        plugin_site(ctx)
        print_plan(ctx, plan(ctx, chosen), chosen)
        say("\n(dry run: nothing started; FLASH_E2E_DRY unset and a GPU give the real run)")
        return {"dry": True, "scenarios": {}}
    # FLASH_E2E_CUDA_CHECK=0: a CPU rehearsal against a stand-in `vllm` (tests/unit/test_gpu_e2e_dry.py)
    problem = cuda_problem(ctx.base_env, ctx.python) if os.environ.get("FLASH_E2E_CUDA_CHECK") != "0" else None
    if problem:
        return {"exit": 3, "error": f"gpu-e2e: needs an NVIDIA GPU with CUDA and vLLM: {problem}"}
    ctx.vllm, problem = vllm_version(ctx.base_env, ctx.python)
    if problem:
        return {"exit": 3, "error": f"gpu-e2e: needs an NVIDIA GPU with CUDA and vLLM: {problem}"}
    try:
        ctx.base = fleet_base(ctx.vllm)
    except SystemExit as exc:  # a result like the other refusals: the pytest tier reports it per test
        return {"exit": 2, "error": str(exc.code)}
    na = not_applicable(chosen, ctx.base)
    problem = fixture_problem(ctx.base_env, ctx.python)
    if problem:
        return {"exit": 3, "error": f"gpu-e2e: {problem}"}
    t0 = time.monotonic()
    deadline = t0 + float(os.environ.get("FLASH_E2E_DEADLINE", "540"))
    say(f"gpu-e2e: building the tiny fixtures under {ctx.work}")
    fx = subprocess.run([ctx.python, str(ROOT / "tests" / "fakes" / "tiny_model.py"), str(ctx.cache), "--json"],
                        env={**ctx.base_env, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), ctx.base_env.get("PYTHONPATH", "")])},
                        capture_output=True, text=True)
    if fx.returncode != 0:
        return {"exit": 4, "error": f"gpu-e2e: the fixture build failed:\n{fx.stderr[-3000:]}"}
    ctx.snaps = {k: Path(v["path"]) for k, v in json.loads(fx.stdout).items()}
    plugin_site(ctx)
    specs = plan(ctx, chosen)
    print_plan(ctx, specs, chosen)
    timeout = float(os.environ.get("FLASH_E2E_BOOT_TIMEOUT", "420"))
    results: dict = {"commit": commit(), "base": ctx.base, "vllm": ctx.vllm,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "fixtures": json.loads(fx.stdout), "not_applicable": na, "scenarios": {}, "servers": {}}
    live = applicable(chosen, ctx.base)
    try:
        try:
            results["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                                "--format=csv,noheader"], capture_output=True, text=True,
                                               timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            results["device"] = f"unknown ({exc})"
        say(f"gpu-e2e: booting {len(specs)} server(s)")
        results["scenario_groups"] = [[s.name for s in g] for g in scenario_groups(live)]
        for spec in specs:
            ctx.ready.setdefault(spec["server"], threading.Event())
        # each group starts once its own servers are up, while the others still boot
        holder: dict = {}
        runner = threading.Thread(target=lambda: holder.update(v=run_scenarios(ctx, live, deadline)), daemon=True)
        runner.start()
        # Solo boots first, one at a time: a clean profiled pool each, and the first warms the JIT
        # caches every later boot shares (Triton, FlashInfer autotune, CuTeDSL: H200 run36, 8 cold
        # boots at once took > 6 min; warm ones ~80-120 s). Then the waves, with fixed pools.
        boot_solos(ctx, specs, timeout, deadline)
        boot(ctx, specs, timeout, deadline, solos=False)
        (ctx.out / "results.json").write_text(json.dumps({**results, "phase": "booted"}, indent=2, default=str))
        runner.join(max(1.0, deadline - time.monotonic()))
        ran = holder.get("v") or {s.name: {"ok": False, "error": "scenarios did not finish"} for s in live}
        # selection order; an n/a scenario is reported with its reason and ok None: not a pass
        results["scenarios"] = {s.name: ran[s.name] if s.name in ran else {"ok": None, "na": na[s.name]} for s in chosen}
    finally:
        states = {name: poll(p) for name, p in ctx.procs.items()}
        stop_all(list(ctx.procs.values()))
        for name, p in ctx.procs.items():
            state = states[name]
            results["servers"][name] = {"state_before_stop": state, "exit": p.exited, "wave": p.spec.get("wave"),
                                        "boot_s": round(p.healthy_at - p.started, 1) if p.healthy_at else None,
                                        "kv_line": (lambda m: m.group(0) if m else None)(
                                            re.search(r"GPU KV cache size:[^\n]*", log_text(p)))}
        results["wall_s"] = round(time.monotonic() - t0, 1)
        pack(ctx, results)
    ok = passed(results)
    say(f"gpu-e2e on base {ctx.base}: {'all passed' if ok else 'FAILURES'}"
        f"{f' ({len(na)} n/a)' if na else ''}; results in {ctx.out} (results.json, summary.txt, logs.tar.gz)")
    return results


def main(argv: list[str]) -> int:
    mode = argv[0] if argv and argv[0] in ("run", "plan") else "run"
    rest = argv[1:] if argv and argv[0] in ("run", "plan") else argv
    expr = None
    if rest[:1] == ["-k"] and len(rest) >= 2:
        expr = rest[1]
    elif rest:
        print("usage: fleet.py [run|plan] [-k EXPR]", file=sys.stderr)
        return 2
    chosen = select(expr)
    if not chosen:
        print(f"gpu-e2e: -k {expr!r} selects no scenario (known: {', '.join(SCENARIOS)})", file=sys.stderr)
        return 2
    dry = mode == "plan" or os.environ.get("FLASH_E2E_DRY", "") not in ("", "0")

    def _term(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through run's finally: servers stopped, results packed

    signal.signal(signal.SIGTERM, _term)
    return run(chosen, dry)


if __name__ == "__main__":
    try:
        rc = main(sys.argv[1:])
    except SystemExit as exc:  # SIGTERM (after the results were packed) or a usage exit
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)  # os._exit below would drop what Python prints for it
        rc = exc.code if isinstance(exc.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # scenario threads past the deadline must not hold the exit (results are written)
