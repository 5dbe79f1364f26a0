"""The greedy probe: a fixed prompt set run with temperature 0 → one JSON file per label, and a
byte-exact diff of two such files (the gate behind any change that must not move an argmax).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Callable

from ..errors import FlashError, UsageError
from . import prompts as P
from .client import Client

LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def probe_dir(env: dict | None = None) -> Path:
    from ..state import state_dir

    return state_dir(env) / "probes"


def run(client: Client, model: str, label: str, max_tokens: int = 400, logprobs: int = 3,
        on_item: Callable[[int, dict], None] | None = None) -> dict:
    results = []
    for i, prompt in enumerate(P.PROBE_PROMPTS):
        reply = client.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "logprobs": logprobs})
        if not reply.ok:
            raise FlashError(f"probe prompt {i + 1}: {reply.why()}", hint="is the server up? flash test")
        choice = reply.body["choices"][0]
        tops = (choice.get("logprobs") or {}).get("top_logprobs") or [None]
        n = int((reply.body.get("usage") or {}).get("completion_tokens") or 0)
        item = {"prompt": prompt, "text": choice.get("text") or "", "tokens": n, "finish_reason": choice.get("finish_reason"),
                "seconds": round(reply.seconds, 3), "tok_s": round(n / reply.seconds, 2) if reply.seconds else None,
                "first_logprobs": tops[0]}
        results.append(item)
        if on_item:
            on_item(i, item)
    return {"label": label, "url": client.url, "model": model, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prompts_version": P.PROMPTS_VERSION, "max_tokens": max_tokens, "results": results}


def write(doc: dict, path: Path) -> Path:
    """Atomic: a tmp sibling renamed into place (a probe interrupted half-way leaves no file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def locate(ref: str, directory: Path | None = None) -> Path:
    """A label (→ <state>/probes/<label>.json) or a path to a probe file."""
    p = Path(ref)
    if p.suffix == ".json" or os.sep in ref:
        if not p.is_file():
            raise UsageError(f"probe file {ref!r} not found")
        return p
    if not LABEL_RE.fullmatch(ref):
        raise UsageError(f"bad probe label {ref!r}", hint="letters, digits, . _ - (or a path to a .json file)")
    p = (directory or probe_dir()) / f"{ref}.json"
    if not p.is_file():
        raise UsageError(f"no probe labelled {ref!r} (looked for {p})", hint=f"run one: flash probe {ref}")
    return p


def load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(doc.get("results"), list)
        return doc
    except (OSError, ValueError, AssertionError):
        raise UsageError(f"{path} is not a probe file (flash probe writes them)") from None


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character (or the shorter length), None when identical."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def diff(a: dict, b: dict, logprob_tol: float = 1e-4) -> tuple[bool, list[str]]:
    """→ (identical, report lines). Text must be byte-identical; first-token top logprobs must
    agree within `logprob_tol` (the MTP graft was gated at 4 decimals)."""
    lines: list[str] = []
    same = True
    if a.get("prompts_version") != b.get("prompts_version"):
        return False, [f"prompt sets differ (version {a.get('prompts_version')} vs {b.get('prompts_version')}): not comparable"]
    if a.get("max_tokens") != b.get("max_tokens"):
        lines.append(f"note: max_tokens {a.get('max_tokens')} vs {b.get('max_tokens')}: texts compared up to the shorter")
    for i, (ra, rb) in enumerate(zip(a["results"], b["results"]), 1):
        ta, tb = ra["text"], rb["text"]
        if a.get("max_tokens") != b.get("max_tokens"):
            k = min(len(ta), len(tb))
            ta, tb = ta[:k], tb[:k]
        at = first_difference(ta, tb)
        head = f"[{i}] {ra['prompt'][:48]!r}"
        if at is not None:
            same = False
            ba, bb = ta[:at].encode(), tb[:at].encode()
            lines.append(f"{head}: DIFFERS at char {at} (byte {len(ba)}), after {ta[max(0, at - 40):at]!r}")
            lines.append(f"      {a['label']}: {ta[at:at + 60]!r}")
            lines.append(f"      {b['label']}: {tb[at:at + 60]!r}")
            return False, lines  # the first difference is the verdict; later ones follow from it
        la, lb = ra.get("first_logprobs"), rb.get("first_logprobs")
        if la and lb:
            if set(la) != set(lb):
                same = False
                lines.append(f"{head}: identical text, but first-token top tokens differ: {sorted(la)} vs {sorted(lb)}")
                continue
            delta = max(abs(la[k] - lb[k]) for k in la)
            if delta > logprob_tol:
                same = False
                lines.append(f"{head}: identical text ({ra['tokens']} tok), first-token logprobs differ by {delta:.2g} (> {logprob_tol:g})")
                continue
            lines.append(f"{head}: identical ({len(ta)} chars, {ra['tokens']} tok), first-token logprobs within {delta:.1g}")
        else:
            lines.append(f"{head}: identical ({len(ta)} chars, {ra['tokens']} tok)")
    if len(a["results"]) != len(b["results"]):
        same = False
        lines.append(f"result counts differ: {len(a['results'])} vs {len(b['results'])}")
    return same, lines
