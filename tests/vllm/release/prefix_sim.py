"""vLLM's own scheduler, on CPU, asked which prompts hit the prefix cache at the real model's shape.

Prefix-cache hits on this hybrid model are decided by the scheduler and the KV cache manager
(pure Python), not by the GPU: in "align" mode a Mamba state exists only where a prefill chunk
ended on a block boundary, and the manager keeps or drops those states by
`prefix_cache_retention_interval`. So the release's real `Scheduler` (the class `EngineCore`
picks, async included) is built here over the real 48-layer KV layout (the per-layer specs of
check_plan_kv.py, MTP layers marked `is_draft` as the worker marks them, then the engine core's own
`get_kv_cache_configs` → `generate_scheduler_kv_cache_config` → block-size steps), requests are
sent one after another and the model's output is faked (one sampled token per decode step: every
draft rejected). What comes back is vLLM's own count of prefix-cache hit tokens per request.

What this cannot show: that the GPU writes the right state into the blocks the scheduler names
(the gpu-e2e tier's prefix_hit scenarios), or what a hit saves in time (lab/bench_latency.py).

Used by check_prefix_hits.py; by hand, inside a release venv (tools/check_vllm_release.py):
  CUDA_VISIBLE_DEVICES= python tests/vllm/release/prefix_sim.py --model SNAPSHOT [--flash] [--mtp 2]
      [--kv-dtype auto] [--batched-tokens 8192] [--retention 0|N|none] [--keep-block]
      [--prefixes 1024,…] [--tails 32,2000] [--long N | --beside N [--alone]] [--json]
  the gpu-e2e tier's tiny shape instead of the real one (its prefix_retain scenario):
      ... --own-geometry --block-floor 256 --triton-gdn --max-model-len 4096 --batched-tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

PREFIXES = (1024, 2048, 4096, 8192, 16384)
TAILS = (32, 2000)  # a question after a shared document; a user's own document after a shared system prompt
MAX_MODEL_LEN = 262_144
POOL_BYTES = 40 * 1024**3  # ~1,000 blocks of 1,600 tokens: no eviction in these scenarios


@dataclass(frozen=True)
class Settings:
    """The serve settings that decide hits (what `flash serve` renders for them)."""

    mtp: int = 2                      # --speculative-config num_speculative_tokens (MTP)
    kv_dtype: str = "auto"            # --kv-cache-dtype
    batched_tokens: int = 8192        # --max-num-batched-tokens
    retention: int | None = 0         # --prefix-cache-retention-interval (None: dense)
    long_prefill: int = 0             # --long-prefill-token-threshold
    block_drop: bool = True           # MTP_BLOCK_DROP: False = speculative-config disable_eagle_block_drop
    # the shape: the real model's, or (own_geometry) the snapshot's config, e.g. the gpu-e2e tier's tiny
    # model with its --block-size floor and Triton's GDN prefill (no prefill checkpoints)
    own_geometry: bool = False
    block_floor: int | None = None    # --block-size
    flashinfer_gdn: bool = True       # False: --gdn-prefill-backend triton
    max_model_len: int = MAX_MODEL_LEN

    def label(self) -> str:
        ret = "dense" if self.retention is None else self.retention
        return f"mtp{self.mtp}-{self.kv_dtype}-b{self.batched_tokens}-ret{ret}" + ("" if self.block_drop else "-keepblock")


@dataclass
class Sent:
    """One request as the scheduler saw it."""

    prompt: int
    hit_tokens: int       # vLLM's prefix-cache hits for it (KVCacheManager's stats at admission)
    chunks: list[int] = field(default_factory=list)  # prefill tokens per step
    peak_blocks: int = 0  # pool blocks out of the free queue while it ran (what concurrency pays)
    cached_blocks: int = 0  # blocks of the pool holding a cache entry once it finished (evictable)


@contextmanager
def _as_on_cuda():
    """Build configs as a CUDA machine would. ModelConfig inspects the architecture, which loads
    vLLM's general plugins, and ours would try to patch Triton kernels on CPU: the check registers
    the plugin itself (patch 4 is a scheduler patch). Where Triton is missing, vLLM <= 0.32 falls
    back to the V1 model runner, which changes the hash lookahead and so the hits: the CUDA image
    has Triton, so the decision is taken as there."""
    import vllm.config.vllm as vllm_module

    old = os.environ.get("VLLM_PLUGINS")
    old_triton = getattr(vllm_module, "HAS_TRITON", None)
    os.environ["VLLM_PLUGINS"] = "flash-prefix-sim-none"
    if old_triton is not None:
        vllm_module.HAS_TRITON = True
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = old
        if old_triton is not None:
            vllm_module.HAS_TRITON = old_triton


class Sim:
    """One scheduler over the real layout; `send` runs a request to completion."""

    def __init__(self, model: str | Path, settings: Settings, *, seed: int = 0):
        with _as_on_cuda():
            self._build(model, settings, seed)

    def _build(self, model, settings: Settings, seed: int) -> None:
        import torch
        import vllm.v1.kv_cache_interface as iface
        from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                                 SpeculativeConfig, VllmConfig)
        from vllm.v1.core import kv_cache_utils as ku
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.structured_output import StructuredOutputManager

        from check_plan_kv import release_base, release_planning, vllm_specs
        from flash_cli.geometry import REAL, from_config
        from flash_cli.plan.kvcache import layout

        self.settings = s = settings
        self.rng = random.Random(seed)
        self._n = 0
        geom = from_config(Path(model) / "config.json") if s.own_geometry else REAL
        ours = layout(geom, base=release_base(), mtp=s.mtp, kv_dtype=s.kv_dtype, prefix_cache=True,
                      max_model_len=s.max_model_len, flashinfer_gdn=s.flashinfer_gdn, user_block_size=s.block_floor)
        self.block_size = ours.block_size
        cache = CacheConfig(block_size=ours.block_size, enable_prefix_caching=True, cache_dtype=s.kv_dtype,
                            prefix_cache_retention_interval=s.retention)
        sched = SchedulerConfig(max_num_batched_tokens=s.batched_tokens, max_num_seqs=8, max_model_len=s.max_model_len,
                                enable_chunked_prefill=True, long_prefill_token_threshold=s.long_prefill,
                                is_encoder_decoder=False)
        mc = ModelConfig(model=str(model), max_model_len=s.max_model_len, dtype="bfloat16")
        keep = {} if s.block_drop else {"disable_eagle_block_drop": True}  # 0.30+ (flash refuses it on 0.29)
        spec = (SpeculativeConfig(method="mtp", num_speculative_tokens=s.mtp, target_model_config=mc,
                                  target_parallel_config=ParallelConfig(), **keep) if s.mtp else None)
        vc = VllmConfig(model_config=mc, cache_config=cache, scheduler_config=sched, speculative_config=spec,
                        parallel_config=ParallelConfig(), device_config=DeviceConfig(device="cpu"))
        # What the CUDA platform leaves and the CPU one changes: the hybrid manager on, the block
        # size from _align_hybrid_block_size (check_plan_kv proves ours equals it), the QSA layout.
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        vc.cache_config.block_size = ours.block_size
        if hasattr(vc.cache_config, "mamba_block_size"):  # _align_hybrid_block_size sets both
            vc.cache_config.mamba_block_size = ours.block_size
        vc.cache_config.kv_cache_layout = "BLNHC"
        self.mamba_cache_mode = getattr(vc.cache_config, "mamba_cache_mode", None)
        self.v2_runner = bool(getattr(vc, "use_v2_model_runner", False))
        register_all_kvcache_specs(vc)
        specs = vllm_specs(ours, torch, iface, ours.checkpoints, geom)
        if "is_draft" in {f.name for f in fields(iface.KVCacheSpec)}:  # 0.33: the worker marks the drafter's
            specs = {name: (replace(sp, is_draft=True) if name.startswith("mtp.") else sp) for name, sp in specs.items()}
        planning = release_planning()
        if hasattr(planning, "get_global_kv_cache_groups"):
            groups = planning.get_global_kv_cache_groups(vc, [specs])
            configs = planning.get_kv_cache_configs(vc, [specs], [POOL_BYTES], groups)
        else:
            configs = planning.get_kv_cache_configs(vc, [specs], [POOL_BYTES])
        kvc = ku.generate_scheduler_kv_cache_config(configs)
        vc.cache_config.num_gpu_blocks = kvc.num_blocks
        # EngineCore._initialize_kv_caches: the smallest block of the groups that take part in
        # prefix caching (0.30+); 0.29 takes every group, so the QSA ring's 8 tokens (patch 4's case).
        # Which of the two this release does is read from that method's own source.
        import inspect

        from vllm.v1.engine.core import EngineCore

        sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
        method = EngineCore._initialize_kv_caches  # the release's, under patch 4's logging wrapper
        if "prefix_cacheable" in inspect.getsource(getattr(method, "__flash_original__", method)):
            sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups if g.kv_cache_spec.prefix_cacheable] or sizes
        vc.cache_config.block_size = min(sizes)
        self.cache_block_size = vc.cache_config.block_size
        self.num_blocks = kvc.num_blocks
        if hasattr(ku, "resolve_kv_cache_block_sizes"):
            block, hash_block = ku.resolve_kv_cache_block_sizes(kvc, vc)
        else:
            block = hash_block = ours.block_size
        self.hash_block_size = hash_block
        self.hasher = self._hasher(vc, hash_block)
        cls = vc.scheduler_config.get_scheduler_cls()
        self.scheduler_cls = cls.__name__
        from vllm.v1.core.sched.scheduler import Scheduler  # AsyncScheduler passes *args/**kwargs to it

        kwargs = dict(hash_block_size=hash_block) if "hash_block_size" in inspect.signature(Scheduler.__init__).parameters else {}
        self.scheduler = cls(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                             block_size=block, log_stats=True, **kwargs)

    @staticmethod
    def _hasher(vc, hash_block: int):
        from vllm.v1.core import kv_cache_utils as ku

        try:
            from vllm.utils.hashing import get_hash_fn_by_name
        except ImportError:
            from vllm.utils import get_hash_fn_by_name
        fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        ku.init_none_hash(fn)
        lookahead = getattr(vc, "num_hash_lookahead_tokens", 0)
        if lookahead:
            return ku.get_request_block_hasher(hash_block, fn, lookahead)
        return ku.get_request_block_hasher(hash_block, fn)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 150_000) for _ in range(n)]

    def _ran(self, out) -> None:
        """The model's answer to a scheduled step, faked: one sampled token for each request past its
        prompt (every draft rejected), nothing for a prefill chunk; the scheduler takes it in."""
        from vllm.v1.outputs import ModelRunnerOutput

        s = self.scheduler
        reqs = list(out.num_scheduled_tokens)
        sampled = [[] if s.requests[r].num_computed_tokens < s.requests[r].num_prompt_tokens
                   else [self.rng.randrange(1000, 150_000)] for r in reqs]
        s.update_from_output(out, ModelRunnerOutput(req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)},
                                                    sampled_token_ids=sampled))

    def send(self, prompt: list[int], max_tokens: int = 4) -> Sent:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._n += 1
        rid = f"req-{self._n}"
        s = self.scheduler
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                              None, block_hasher=self.hasher))
        sent = Sent(prompt=len(prompt), hit_tokens=-1)
        pool = s.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        for _ in range(10_000):
            out = s.schedule()
            sent.peak_blocks = max(sent.peak_blocks, free - pool.get_num_free_blocks())
            if rid in out.num_scheduled_tokens and sent.hit_tokens < 0:
                stats = s.kv_cache_manager.make_prefix_cache_stats()
                sent.hit_tokens = stats.hits if stats is not None else 0
            if rid in out.num_scheduled_tokens:
                req, n = s.requests[rid], out.num_scheduled_tokens[rid]
                # the scheduler advanced num_computed_tokens when it scheduled (async and sync alike)
                if req.num_computed_tokens - n < req.num_prompt_tokens:
                    sent.chunks.append(min(n, req.num_prompt_tokens - (req.num_computed_tokens - n)))
            self._ran(out)
            if not s.has_unfinished_requests():
                # the two counts must meet: what hit was not prefilled (else this reads vLLM wrong)
                if sent.hit_tokens + sum(sent.chunks) != sent.prompt:
                    raise AssertionError(f"{rid}: {sent.hit_tokens} hit + {sent.chunks} prefilled != {sent.prompt}")
                sent.cached_blocks = sum(1 for b in pool.blocks if b.block_hash is not None)
                return sent
        raise RuntimeError(f"{rid} did not finish in 10,000 steps")

    def beside(self, stream_prompt: int, long_prompt: int, warm_steps: int = 4) -> dict:
        """One stream decoding while a fresh `long_prompt`-token prompt arrives and prefills (issue 33
        item 2's ITL question, the scheduler's half): per step from the long prompt's arrival to its
        first sampled token, the stream's scheduled tokens (0: no token that step, a stall) and the
        long prompt's chunk. `stream_prompt` 0: the long prompt alone (what one user's prefill gets).
        What a step costs on the GPU is not here (lab/bench_latency.py)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        s = self.scheduler
        self._n += 1
        stream, long = f"stream-{self._n}", f"long-{self._n}"
        params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
        if stream_prompt:
            s.add_request(Request(stream, self.ids(stream_prompt), params, None, block_hasher=self.hasher))
        else:
            warm_steps = 0
        stream_tokens: list[int] = []  # per step from the long prompt's arrival
        chunks: list[int] = []
        for step in range(10_000):
            if step == warm_steps:  # the stream is decoding: the long prompt arrives
                s.add_request(Request(long, self.ids(long_prompt), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                      None, block_hasher=self.hasher))
            out = s.schedule()
            if step >= warm_steps:
                stream_tokens.append(out.num_scheduled_tokens.get(stream, 0))
                chunks.append(out.num_scheduled_tokens.get(long, 0))
            lr = s.requests.get(long)
            done = lr is not None and lr.num_computed_tokens >= lr.num_prompt_tokens  # its last chunk scheduled
            self._ran(out)
            if done:
                break
        else:
            raise RuntimeError(f"{long} did not finish its prefill in 10,000 steps")
        s.finish_requests([r for r in (stream, long) if r in s.requests], RequestStatus.FINISHED_ABORTED)
        chunks = [c for c in chunks if c]
        if sum(chunks) != long_prompt:  # every prompt token prefilled once (a fresh prompt: no hits)
            raise AssertionError(f"{long}: chunks {chunks} sum to {sum(chunks)}, not {long_prompt}")
        return {"stream_prompt": stream_prompt, "long_prompt": long_prompt, "steps": len(stream_tokens),
                "stalls": stream_tokens.count(0) if stream_prompt else None, "chunks": chunks,
                "stream_tokens": stream_tokens}


def shared_prefix(sim: Sim, prefix: int, tail: int, requests: int = 3) -> list[Sent]:
    """`requests` prompts, one after another: the same `prefix` tokens, then `tail` tokens of their own."""
    shared = sim.ids(prefix)
    return [sim.send(shared + sim.ids(tail)) for _ in range(requests)]


def table(model: str | Path, settings: Settings, prefixes=PREFIXES, tails=TAILS, requests: int = 3) -> dict:
    sim = Sim(model, settings)
    rows = []
    for tail in tails:
        for prefix in prefixes:
            sent = shared_prefix(sim, prefix, tail, requests)
            rows.append({"prefix": prefix, "tail": tail, "hits": [r.hit_tokens for r in sent],
                         "chunks": [r.chunks for r in sent]})
    return {"settings": settings.__dict__ | {"label": settings.label()}, "vllm": _version(), "block_size": sim.block_size,
            "hash_block_size": sim.hash_block_size, "cache_block_size": sim.cache_block_size, "num_blocks": sim.num_blocks, "scheduler": sim.scheduler_cls,
            "mamba_cache_mode": sim.mamba_cache_mode, "v2_runner": sim.v2_runner, "rows": rows}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # a source tree on PYTHONPATH has no dist-info
        from vllm.version import __version__

        return __version__


def _retention(text: str) -> int | None:
    if text in ("none", "dense", "None"):
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--retention {text!r}: a token count >= 0, or none (dense)")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a qwen4_exp snapshot directory (its config; weights unused)")
    p.add_argument("--mtp", type=int, default=2)
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--batched-tokens", type=int, default=8192)
    p.add_argument("--retention", type=_retention, default=0, help="0 (vLLM's default), N tokens, or none (dense)")
    p.add_argument("--long-prefill", type=int, default=0)
    p.add_argument("--keep-block", action="store_true", help="MTP_BLOCK_DROP=0 (disable_eagle_block_drop, 0.30+)")
    p.add_argument("--own-geometry", action="store_true", help="the snapshot's config's shape, not the real model's")
    p.add_argument("--block-floor", type=int, help="--block-size (the user's floor and alignment)")
    p.add_argument("--triton-gdn", action="store_true", help="--gdn-prefill-backend triton (no prefill checkpoints)")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--prefixes", default=",".join(map(str, PREFIXES)))
    p.add_argument("--tails", default=",".join(map(str, TAILS)))
    p.add_argument("--long", type=int, default=0, help="instead: one fresh prompt of this many tokens; the pool "
                   "blocks it holds while running and those left cached")
    p.add_argument("--beside", type=int, default=0, help="instead: a stream decoding while a fresh prompt of this "
                   "many tokens prefills; per step the stream's tokens and the prompt's chunk")
    p.add_argument("--alone", action="store_true", help="with --beside: no stream, the prompt alone")
    p.add_argument("--flash", action="store_true", help="register flash_vllm first (patch 4 is a scheduler patch): "
                   "the recipe rather than stock vLLM")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.flash:
        from flash_vllm import plugin

        plugin.register(env={})
    settings = Settings(a.mtp, a.kv_dtype, a.batched_tokens, a.retention, a.long_prefill, not a.keep_block,
                        a.own_geometry, a.block_floor, not a.triton_gdn, a.max_model_len)
    if a.long:
        sim = Sim(a.model, settings)
        sent = sim.send(sim.ids(a.long))
        got = {"settings": settings.__dict__ | {"label": settings.label()}, "vllm": _version(), "prompt": sent.prompt,
               "num_blocks": sim.num_blocks, "peak_blocks": sent.peak_blocks, "cached_blocks": sent.cached_blocks}
        print(json.dumps(got) if a.json else f"{settings.label()}: a {sent.prompt:,}-token prompt held "
              f"{sent.peak_blocks} of {sim.num_blocks} blocks while running, left {sent.cached_blocks} cached")
        return 0
    if a.beside:
        sim = Sim(a.model, settings)
        got = {"settings": settings.__dict__ | {"label": settings.label()}, "vllm": _version(),
               "block_size": sim.block_size, **sim.beside(0 if a.alone else 64, a.beside)}
        print(json.dumps(got) if a.json else f"{settings.label()}: a {a.beside:,}-token prefill "
              f"{'alone' if a.alone else 'beside a decoding stream'}: {got['steps']} steps, stream stalls "
              f"{got['stalls']}, chunks {got['chunks']}")
        return 0
    got = table(a.model, settings, [int(x) for x in a.prefixes.split(",")], [int(x) for x in a.tails.split(",")])
    if a.json:
        print(json.dumps(got))
        return 0
    print(f"{settings.label()}: block {got['block_size']} tokens, {got['scheduler']}, v2 runner {got['v2_runner']}")
    for row in got["rows"]:
        print(f"  prefix {row['prefix']:>6}  tail {row['tail']:>5}  hit tokens per request {row['hits']}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_plan_kv, as pytest's rootdir does
    raise SystemExit(main())
