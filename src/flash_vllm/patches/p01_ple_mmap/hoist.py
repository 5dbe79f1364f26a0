"""Patch 1, hoisted mode (`VLLM_PLE_MMAP_MODE=hoisted`): gather the PLE rows before the forward.

The eager mode (patch 1's default) gathers inside the forward as an eager break, so a FULL CUDA
graph would replay a constant and the run spec forces PIECEWISE. The hoisted mode moves the
gather into the model runner's input preparation (`Qwen4ExpModelState.prepare_inputs`, called by
the V2 runner right before the forward, after the attention metadata), so the forward only reads
the persistent per-layer buffers and uniform decode batches may be captured FULL:

1. `prepare_inputs` runs as upstream (query_start_loc padded to the graph's request count,
   ngram_context from the request states).
2. For every PLE layer served by patch 1, the ids come from the layer's own `compute_ngram_ids`
   on exactly the tensors the forward will receive (`input_batch.input_ids`, padded, and the two
   just prepared): the same function and the same arguments as the eager path, so the same ids.
   They cover every token of the step: decode tokens, MTP draft positions (the runner wrote them
   into input_ids already), prefill chunks, padding.
3. One device-to-host copy of all layers' ids. On 0.33 the decode tokens exist only on the device
   when the step is prepared (async scheduling: the sampler and the drafter wrote them), so this
   copy waits for the previous step's GPU work: one wait per step, before the forward, instead of
   one per PLE layer in the middle of it (counted as the step's `gpu-wait` in patch 1's stats
   line and counters; the fills themselves get host ids and wait for nothing). The host gather then fills the layer's buffer through
   the layer's own guarded gather (`_gather_into`, the engine's Stager: pinned slot + H2D on the
   current stream, ordered before the graph replay).
4. The storage's forward returns `buffer[:n]`: a view, capturable in any graph mode.

Dummy batches (profile run, DP padding steps, warm-up) carry request ids the request states do
not know; they are not gathered (their outputs are discarded; the buffer is zeroed once at
allocation so a dummy forward never reads uninitialised memory).

Checks that the buffer was filled for this step's ids:
- always, in any forward that runs in Python outside a capture (eager steps, the profile run):
  the number of tokens staged equals the forward's (host integers, no sync);
- `VLLM_PLE_MMAP_HOIST_CHECK=1` (debug): those forwards also compare the ids on the device with
  the ids the hook gathered for (one sync per layer and step);
- FULL and PIECEWISE replays run no Python: they trust the hook, which runs for every real step
  (the binding is checked at startup: `check()` anchors the runner's call sites).

Bases: the one place is `BASES` (0.30-0.33: the V2 runner's `Qwen4ExpModelState` and patch 1's
storage flavour). Elsewhere (0.29) the mode is refused by preflight and falls back to eager in the
plugin (with a warning).
"""

from __future__ import annotations

import logging
import time

from flash_common import releases

from ...registry import Context, expect_installed, expect_source, install

MODE_ENV = "VLLM_PLE_MMAP_MODE"
CHECK_ENV = "VLLM_PLE_MMAP_HOIST_CHECK"
MODES = ("eager", "hoisted")
DEFAULT_MODE = "eager"
# Bases whose model runner the hook is written (and checked, in the vllm tier) against: the
# catalogue's `ple_hoisted` (0.30+ share the V2 runner's call sites and patch 1's "storage" flavour).
BASES = releases.where("ple_hoisted", True)
NOT_PORTED = {b: ("patch 1's splitting-op flavour: the lookup is a torch.compile splitting op "
                  "(vllm::flash_ple_mmap_lookup); a hoisted variant of that op is not written")
              for b in releases.where("ple_storage", "splitting-op")}
STATE_MOD = "vllm.models.qwen4_exp.nvidia.model_state"
PREPARE = (STATE_MOD, "Qwen4ExpModelState.prepare_inputs")
# CUDA-graph capture builds its inputs here, not through prepare_inputs (cudagraph_utils'
# `model_state.prepare_dummy_inputs`), and runs an eager warm-up forward on them
PREPARE_DUMMY = (STATE_MOD, "Qwen4ExpModelState.prepare_dummy_inputs")
RUNNER = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model")
DUMMY = ("vllm.v1.worker.gpu.input_batch", "InputBatch.make_dummy")
TARGETS = (PREPARE, PREPARE_DUMMY, RUNNER, DUMMY)
NUMBER = 1
log = logging.getLogger("vllm.flash")

_WARNED: set[str] = set()
ACTIVE = False  # set by apply() in the serving process: storages built afterwards hoist
CHECK = False


def mode_of(env) -> str:
    """The requested mode; a bad value names what is accepted."""
    raw = (env.get(MODE_ENV) or "").strip().lower()
    if not raw:
        return DEFAULT_MODE
    if raw not in MODES:
        raise ValueError(f"{MODE_ENV}={env.get(MODE_ENV)!r} is not one of {', '.join(MODES)}")
    return raw


def serves(base: str) -> bool:
    """Whether `base` (a compat base name, "v0.33") has the hoisted mode."""
    return base in BASES


def check(ctx: Context) -> None:
    """The runner still calls the hook where the design needs it (run on the bases in BASES)."""
    expect_source(*PREPARE, "super().prepare_inputs(input_batch, req_states)",
                  "query_start_loc=query_start_loc",
                  "ngram_context=self._prepare_ngram_context(input_batch, req_states)")
    # The forward gets exactly input_batch.input_ids and these model inputs, and runs after them.
    expect_source(*RUNNER, "input_ids = input_batch.input_ids", '"input_ids": input_ids',
                  "**self.model_state.prepare_inputs(input_batch, self.req_states)",
                  "self.cudagraph_manager.run_fullgraph(batch_desc)")
    # Dummy batches are told apart by request ids the request states never registered.
    expect_source(*DUMMY, 'req_ids = [f"req_{i}_{random_uuid()}"')
    # Capture's own dummy inputs (the model state's method, called by the graph manager).
    expect_source(*PREPARE_DUMMY, "super().prepare_dummy_inputs(num_reqs, num_tokens)",
                  "ngram_context=ngram_context")
    expect_source("vllm.v1.worker.gpu.cudagraph_utils", "ModelCudaGraphManager.capture",
                  "model_state.prepare_dummy_inputs(num_reqs, num_tokens)")
    expect_source("vllm.v1.worker.gpu.states", "RequestState.__init__", "self.req_id_to_index")
    expect_source("vllm.models.qwen4_exp.nvidia.ngram_embedding", "Qwen4ExpNGramEmbedding.forward",
                  "self.compute_ngram_ids(", "input_ids, query_start_loc, ngram_context")


def apply(ctx: Context) -> None:
    global ACTIVE, CHECK
    install(NUMBER, *PREPARE, make_prepare_inputs)
    install(NUMBER, *PREPARE_DUMMY, make_prepare_dummy_inputs)
    from ...ple import config_from_env

    CHECK = config_from_env(ctx.env).hoist_check
    ACTIVE = True


def verify(ctx: Context) -> None:
    expect_installed(NUMBER, *PREPARE)
    expect_installed(NUMBER, *PREPARE_DUMMY)


def wanted(ctx: Context) -> bool:
    """Hoisted requested and served here; requested but not served: warn, stay eager."""
    if mode_of(ctx.env) != "hoisted":
        return False
    if not serves(ctx.base.name):
        if ctx.base.name in _WARNED:
            return False
        _WARNED.add(ctx.base.name)
        log.warning("flash_vllm patch 1: %s=hoisted is not available on %s (%s); gathering eagerly "
                    "(serve with cudagraph_mode PIECEWISE)", MODE_ENV, ctx.base.name,
                    NOT_PORTED.get(ctx.base.name, "not ported"))
        return False
    return True


# --- runtime --------------------------------------------------------------------------------------

def _capturing() -> bool:
    from .guard import _in_breakable_capture, _is_capturing
    import torch

    return _is_capturing(torch) or _in_breakable_capture()


class Slot:
    """The hoisted state of one patched storage: what the hook staged into its buffer."""

    def __init__(self):
        self.staged_n = None  # tokens of the last real step staged; None after a dummy step
        self.staged_ids = None  # device copy of the ids gathered for (debug check only)
        self.steps = 0
        self.dummies = 0

    def fill(self, emb, ids_host, ids_dev) -> None:
        """Gather the rows of `ids_host` (n, heads) into the storage's buffer, before the forward."""
        n = ids_host.shape[0]
        view = emb._flash_buffer(n, ids_host.shape[1:], ids_dev.device)[:n]
        emb._gather_into(ids_host, view)
        self.staged_n = n
        self.staged_ids = ids_dev.clone() if CHECK else None
        self.steps += 1

    def skip(self) -> None:
        self.staged_n = None
        self.staged_ids = None
        self.dummies += 1

    def read(self, emb, ngram_ids):
        """The forward's part: the buffer's first n rows (a view; nothing gathered here)."""
        n = ngram_ids.shape[0]
        out = emb._flash_buffer(n, ngram_ids.shape[1:], ngram_ids.device)
        capturing = _capturing()
        if not capturing and getattr(emb, "_flash_stager", 0) is None:
            # Open the table at the first eager forward (the profile run), as the eager mode does:
            # a missing or wrong table fails the boot, not the first request.
            emb.stager(ngram_ids.device)
        if self.staged_n is not None and not capturing:
            if self.staged_n != n:
                raise RuntimeError(f"VLLM_PLE_MMAP hoisted: the forward reads {n} PLE rows but the "
                                   f"runner's hook staged {self.staged_n} for this step")
            if self.staged_ids is not None:
                import torch

                if not torch.equal(self.staged_ids, ngram_ids):
                    raise RuntimeError("VLLM_PLE_MMAP hoisted: the forward's n-gram ids differ from "
                                       "the ids the runner's hook gathered for")
        return out[:n]


class Hoister:
    """Per model state: the PLE layers served by patch 1 (found once) and the per-step staging."""

    def __init__(self, model):
        self.layers = []
        for m in model.modules():
            emb = getattr(m, "ngram_embedding", None)
            if hasattr(m, "compute_ngram_ids") and getattr(emb, "_flash_hoist", None) is not None:
                self.layers.append(m)
        self.step = 0

    def dummy(self) -> None:
        """A forward on dummy inputs follows: nothing to gather, nothing to check."""
        for m in self.layers:
            m.ngram_embedding._flash_hoist.skip()

    def stage(self, input_batch, req_states, inputs) -> None:
        known = req_states.req_id_to_index
        if not input_batch.req_ids or not all(r in known for r in input_batch.req_ids):
            self.dummy()
            return
        import torch

        input_ids = input_batch.input_ids
        qsl, ctx = inputs["query_start_loc"], inputs["ngram_context"]
        dev = [m.compute_ngram_ids(input_ids, qsl, ctx) for m in self.layers]
        # One copy, one wait for all layers (the ids depend on the previous step's sampled tokens).
        t0 = time.perf_counter()
        host = (dev[0].unsqueeze(0) if len(dev) == 1 else torch.stack(dev)).to("cpu").numpy()
        wait_s = time.perf_counter() - t0
        for i, m in enumerate(self.layers):
            m.ngram_embedding._flash_hoist.fill(m.ngram_embedding, host[i], dev[i])
        # The fills got host ids (no wait of their own): the step's one wait goes into the same
        # counters as the eager mode's per-lookup waits (`gpu-wait` in the stats line, and
        # vllm:ple_mmap_gpu_wait_seconds / _op_seconds), once per step.
        stats = getattr(getattr(self.layers[0].ngram_embedding, "_flash_stager", None), "stats", None)
        if stats is not None:
            stats.record(op_s=wait_s, gpu_wait_s=wait_s)
        self.step += 1


def hoister(state):
    h = state.__dict__.get("_flash_hoister")
    if h is None:
        h = state.__dict__["_flash_hoister"] = Hoister(state.model)
    return h


def make_prepare_inputs(orig):
    from ...registry import wraps

    @wraps(orig)
    def prepare_inputs(self, input_batch, req_states):
        inputs = orig(self, input_batch, req_states)
        if self.uses_ngram_embedding:
            h = hoister(self)
            if h.layers:
                h.stage(input_batch, req_states, inputs)
        return inputs

    return prepare_inputs


def make_prepare_dummy_inputs(orig):
    """Capture's warm-up forward runs eagerly on these inputs after whatever step was staged last
    (H200, real-shape boot: "the forward reads 32 PLE rows but the runner's hook staged 1"):
    mark the step a dummy, as the runner's own dummy batches are."""
    from ...registry import wraps

    @wraps(orig)
    def prepare_dummy_inputs(self, num_reqs, num_tokens):
        inputs = orig(self, num_reqs, num_tokens)
        if self.uses_ngram_embedding:
            h = hoister(self)
            if h.layers:
                h.dummy()
        return inputs

    return prepare_dummy_inputs


def slot_for_new_storage():
    """A Slot when the hoisted mode is on in this process (the storage's __init__ asks)."""
    return Slot() if ACTIVE else None
