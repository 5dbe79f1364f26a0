"""PURE: PARALLEL (how one deployment spreads over 2 to 4 boxes, one GPU each) → a typed Layout,
checked against the model's head counts before anything runs (issue 35; docs/MULTINODE.md).

    tpN     tensor parallel over N boxes (--tensor-parallel-size N --nnodes N ...)
    tpNep   the same plus --enable-expert-parallel (the 4-Spark anchor: tp4ep)
    ppN     pipeline parallel over N boxes (--pipeline-parallel-size N --nnodes N ...)
    tp2pp2  tensor 2 x pipeline 2 on four boxes
    dpN     N data-parallel replicas behind the head's one API (--data-parallel-size N ...)
    pd      one prefill box and one decode box behind flash's P/D router; pdN: 1 prefill + N-1 decode

The tensor-parallel rules are vLLM 0.33's for qwen4_exp (the same in 0.29-0.32), read from the
wheel: `nvidia/qsa.py` ("QSA attention heads must be divisible by TP size", and with fewer KV heads
than ranks "TP size must be divisible by replicated QSA KV heads"), and the GDN state shape
(`MambaStateShapeCalculator.gated_delta_net_state_shape`: `divide()` of the key heads, the value
heads and the conv dimension by the TP size). The numbers are the checkpoint's geometry
(geometry.py); an accepted layout is one every rule holds for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError
from .geometry import REAL, Geometry

MIN_BOXES, MAX_BOXES = 2, 4
# each kind as PARALLEL spells it (messages that name the layouts a setting applies to)
KIND_FORMS = {"tp": "tpN", "pp": "ppN", "tppp": "tp2pp2", "dp": "dpN", "pd": "pd/pdN"}
_FORM = re.compile(r"(?:(tp)(\d+)(ep)?|(pp)(\d+)|(tp)(\d+)pp(\d+)|(dp)(\d+)|(pd)(\d*))")


@dataclass(frozen=True)
class Layout:
    name: str  # as PARALLEL writes it
    kind: str  # tp | pp | tppp | dp | pd
    boxes: int
    tp: int = 1
    pp: int = 1
    ep: bool = False

    @property
    def rendezvous(self) -> bool:
        """One model over the boxes: vLLM's --nnodes launch, torch's store on MASTER_PORT."""
        return self.kind in ("tp", "pp", "tppp")

    @property
    def nccl(self) -> bool:
        """The ranks talk over NCCL/gloo (pd's boxes move KV over NIXL instead)."""
        return self.kind != "pd"

    @property
    def replicas(self) -> int:
        """Whole copies of the model (each box's pool is the one-box plan): dp and pd."""
        return self.boxes if self.kind in ("dp", "pd") else 1

    def roles(self) -> list[str]:
        if self.kind == "pd":
            return ["prefill"] + ["decode"] * (self.boxes - 1)
        return ["head"] + ["worker"] * (self.boxes - 1)


def tp_problems(n: int, g: Geometry = REAL) -> list[str]:
    """Why vLLM refuses tensor parallel size n for this geometry (empty: it does not)."""
    out = []
    if g.num_attention_heads % n:
        out.append(f"its {g.num_attention_heads} QSA attention heads do not divide by {n}")
    kv = g.num_key_value_heads
    if kv >= n and kv % n:
        out.append(f"its {kv} QSA KV heads do not divide by {n}")
    elif kv < n and n % kv:
        out.append(f"{n} is not a multiple of its {kv} QSA KV heads, which are replicated above {kv} ranks "
                   "(vLLM: 'TP size must be divisible by replicated QSA KV heads')")
    for what, value in (("GDN key heads", g.linear_num_key_heads), ("GDN value heads", g.linear_num_value_heads)):
        if value % n:
            out.append(f"its {value:,} {what} do not divide by {n}")
    if g.gdn_conv_dim % n:
        out.append(f"its GDN conv dimension {g.gdn_conv_dim:,} does not divide by {n}")
    return out


def _boxes_ok(text: str, n: int) -> None:
    if n == 1:
        raise ConfigError(f"PARALLEL={text} is one box", hint="PARALLEL=none serves on one box")
    if not MIN_BOXES <= n <= MAX_BOXES:
        raise ConfigError(f"PARALLEL={text} spans {n} boxes; flash renders {MIN_BOXES} to {MAX_BOXES} boxes",
                          hint=f"PARALLEL accepts none | {' | '.join(ACCEPTED)}")


def parse(text: str, g: Geometry = REAL) -> Layout:
    """PARALLEL → Layout; a value vLLM would refuse for this model, or flash does not render, is a
    ConfigError (exit 2) naming it, saying why, and listing what is accepted."""
    m = _FORM.fullmatch(text or "")
    accepted = f"PARALLEL accepts none | {' | '.join(ACCEPTED)}"
    if not m:
        raise ConfigError(f"PARALLEL={text!r} is not a layout", hint=accepted)
    groups = m.groups()
    if groups[0]:  # tpN[ep]
        n = int(groups[1])
        _boxes_ok(text, n)
        why = tp_problems(n, g)
        if why:
            raise ConfigError(f"PARALLEL={text}: vLLM refuses tensor parallel size {n} for this model: "
                              + "; ".join(why), hint=f"{accepted}; for three boxes: pp3, dp3 or pd3")
        return Layout(text, "tp", n, tp=n, ep=bool(groups[2]))
    if groups[3]:  # ppN
        n = int(groups[4])
        _boxes_ok(text, n)
        if n > g.num_hidden_layers:
            raise ConfigError(f"PARALLEL={text}: {n} pipeline stages for {g.num_hidden_layers} layers", hint=accepted)
        return Layout(text, "pp", n, pp=n)
    if groups[5]:  # tpTppP
        t, p = int(groups[6]), int(groups[7])
        if t < 2 or p < 2:
            raise ConfigError(f"PARALLEL={text}: both sizes must be at least 2", hint=f"{accepted} (tp2pp2: four boxes)")
        _boxes_ok(text, t * p)
        why = tp_problems(t, g)
        if why:
            raise ConfigError(f"PARALLEL={text}: vLLM refuses tensor parallel size {t} for this model: "
                              + "; ".join(why), hint=accepted)
        return Layout(text, "tppp", t * p, tp=t, pp=p)
    if groups[8]:  # dpN
        n = int(groups[9])
        _boxes_ok(text, n)
        return Layout(text, "dp", n)
    n = int(groups[11]) if groups[11] else 2  # pd = pd with two boxes
    if groups[11] == "2":
        raise ConfigError("PARALLEL=pd2 is written pd (one prefill box, one decode box)", hint=accepted)
    _boxes_ok(text, n)
    return Layout(text, "pd", n)


def accepted(g: Geometry = REAL) -> tuple[str, ...]:
    """Every layout flash renders for this geometry, by kind, then boxes."""
    names = [f"tp{n}{ep}" for n in range(MIN_BOXES, MAX_BOXES + 1) if not tp_problems(n, g) for ep in ("", "ep")]
    names += [f"tp{t}pp{p}" for t in range(2, MAX_BOXES + 1) for p in range(2, MAX_BOXES + 1)
              if t * p <= MAX_BOXES and not tp_problems(t, g)]
    names += [f"pp{n}" for n in range(MIN_BOXES, MAX_BOXES + 1) if n <= g.num_hidden_layers]
    names += [f"dp{n}" for n in range(MIN_BOXES, MAX_BOXES + 1)]
    names += ["pd"] + [f"pd{n}" for n in range(3, MAX_BOXES + 1)]
    return tuple(names)


ACCEPTED = accepted()


def check(text: str) -> None:
    """The settings table's check for PARALLEL: why a value is refused (the head-count rules)."""
    if text != "none":
        parse(text)


def of(settings) -> Layout | None:
    """The Layout of resolved settings; None for one box."""
    return None if settings["PARALLEL"] == "none" else parse(settings["PARALLEL"])
