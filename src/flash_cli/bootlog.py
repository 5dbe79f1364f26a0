"""What the boot log says, read without Docker or the planner (pure functions of log lines).

Two field lessons live here (issue 16):
- **silent context fallback**: a YaRN override that does not take leaves the server at the
  native 262,144 tokens while the recipe asked for more; the only trace is vLLM's
  "Using max model len N" line. `context_verdict` compares it with the recipe.
- **boot hangs**: a boot that prints nothing new for a long time in a known phase. `phase_of`
  names the phase from the last marker line, `BootWatch` notices the silence, `REMEDIES` says
  what is known to help.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .spec import NATIVE_CTX

MAX_LEN = re.compile(r"Using max model len (\d+)")


def expected_context(settings) -> int:
    """The max_model_len a recipe asks for: CTX, or at most the native length without YaRN
    (above it, without YaRN, vLLM refuses the boot: doctor says so)."""
    ctx = int(settings["CTX"])
    return ctx if settings["YARN"] else min(ctx, NATIVE_CTX)


def logged_contexts(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for ln in lines if (m := MAX_LEN.search(ln))]


def context_mismatch_hint(expected: int, got: int) -> str:
    if got == NATIVE_CTX and expected > NATIVE_CTX:
        return ("the YaRN override did not take: the server fell back to the native 262,144 tokens "
                "(check --hf-overrides in `flash serve --dry-run` and the boot log's 'Using max model len' lines)")
    return "the server does not run the recipe's CTX/YARN: serve it again with the intended recipe"


def context_verdict(expected: int, lines: list[str]) -> tuple[str, str] | None:
    """(level, text) from the boot log, level ok | fail | warn; None before vLLM logged its length.
    Every "Using max model len" line counts (vLLM logs one per model config: the served model's
    first, the draft's after it): the served one differing fails, and so does any line at the
    native 262,144 when the recipe asks for more, the fallback's signature; other differences
    (a draft's own length) only warn."""
    seen = logged_contexts(lines)
    if not seen:
        return None
    bad = sorted({v for v in seen if v != expected})
    if not bad:
        return "ok", f"context: max model len {expected:,} as the recipe asks"
    said = ", ".join(f"{v:,}" for v in seen)
    if seen[0] != expected or (expected > NATIVE_CTX and NATIVE_CTX in bad):
        got = NATIVE_CTX if NATIVE_CTX in bad else seen[0]
        return "fail", (f"context: the boot log says max model len {said}, the recipe asks for {expected:,} "
                        f"({context_mismatch_hint(expected, got)})")
    return "warn", (f"context: max model len {seen[0]:,} as the recipe asks, but another 'Using max model len' "
                    f"line says {', '.join(f'{v:,}' for v in bad)} (the draft model's config?)")


def verdict_for_labels(labels: dict, lines: list[str]) -> tuple[str, str] | None:
    """`context_verdict` for a container: the recipe from its `org.flash.recipe` label (None
    without one: nothing to compare with)."""
    from .running import recipe_settings

    s = recipe_settings(labels)
    return None if s is None else context_verdict(expected_context(s), lines)


# --- boot phases and stalls ------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    name: str
    marker: re.Pattern
    remedy: str


PHASES: tuple[Phase, ...] = (
    Phase("weights", re.compile(r"Starting to load model|Loading model from scratch|Loading safetensors|"
                                r"Loading weights|PLE mmap"),
          "reading the checkpoint: a slow or contended disk, or its pages evicted under memory pressure "
          "(flash status shows /proc/pressure/memory); check `iostat -x 5` and free memory, stop other programs"),
    Phase("compile", re.compile(r"Model loading took|Starting torch\.compile|Dynamo bytecode transform|"
                                r"Compiling a graph|Compile and warming up"),
          "torch.compile runs on the CPU and can be quiet for minutes on a first boot (COMPILE_CACHE keeps "
          "the result for the next one); if the CPU is idle, the compile is stuck: flash rm, remove the "
          "flash-compile-* volumes, flash serve again"),
    Phase("KV allocation", re.compile(r"torch\.compile takes|Memory profiling|Available KV cache memory|"
                                      r"KV cache size:|allocate_kv_cache|Initializing KV cache"),
          "a first boot on v0.31 hung in allocate_kv_cache until PyTorch's allocator was told to use "
          "expandable segments: flash rm, then flash serve … CONTAINER_ENV='PYTORCH_ALLOC_CONF=expandable_segments:True'; "
          "also check memory pressure (flash status) and lower GPU_MEM"),
    Phase("graph capture", re.compile(r"Capturing CUDA graph|CUDA graph capture"),
          "capturing CUDA graphs for every batch size; if it never ends, lower the capture sizes "
          "(COMPILE_FLAGS='-cc.cudagraph_mode=PIECEWISE -cc.max_cudagraph_capture_size=16') or confirm "
          "without graphs (COMPILE_FLAGS='-cc.cudagraph_mode=NONE')"),
)
# After these the engine is up and the API server starts: no longer a known hang phase.
PAST_BOOT = re.compile(r"Graph capturing finished|init engine .* took|Starting vLLM API server|"
                       r"Application startup complete")


def phase_of(lines: list[str]) -> Phase | None:
    """The phase the last marker line puts the boot in (None: before weights, or past the boot)."""
    for ln in reversed(lines):
        if PAST_BOOT.search(ln):
            return None
        for ph in reversed(PHASES):
            if ph.marker.search(ln):
                return ph
    return None


@dataclass
class Stall:
    phase: Phase
    silent_s: float
    last_line: str

    def message(self) -> str:
        return (f"the boot has printed nothing new for {self.silent_s:.0f} s in phase '{self.phase.name}' "
                f"(last line: {self.last_line.strip()[:120]!r})")


@dataclass
class BootWatch:
    """Feed it the log tail at each poll; it reports a stall once per silent stretch."""

    threshold_s: float
    _tail: list[str] = field(default_factory=list)
    _changed_at: float | None = None
    _reported: bool = False

    def feed(self, lines: list[str], now: float) -> Stall | None:
        if lines != self._tail or self._changed_at is None:
            self._tail, self._changed_at, self._reported = list(lines), now, False
            return None
        if self.threshold_s <= 0 or self._reported:
            return None
        silent = now - self._changed_at
        ph = phase_of(lines)
        if silent < self.threshold_s or ph is None:
            return None
        self._reported = True
        return Stall(ph, silent, lines[-1] if lines else "")

    def current(self, now: float) -> Stall | None:
        """The stall right now regardless of reporting (for the timeout message)."""
        ph = phase_of(self._tail)
        if ph is None or self._changed_at is None:
            return None
        return Stall(ph, now - self._changed_at, self._tail[-1] if self._tail else "")
