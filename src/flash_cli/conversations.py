"""The request log as conversations (`flash conversations`): pure text in, text out.

vLLM logs each prompt and output when the server runs with LOG_REQUESTS=1. Requests are
threaded into conversations by their longest common prefix of ChatML turns (two identical
turns: the same conversation); each conversation gets a colour and only its new turns print.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TextIO

MAX_THREADS = 4096
COLOURS = ("36", "33", "35", "32", "34", "31", "96", "93")
DETAILS = re.compile(r"Request (\S+) details: prompt: (.*?), prompt_token_ids: ")
OUTPUT = re.compile(r"Generated response (\S+?)( \(streaming (?:delta|complete)\))?: output: (.*?), output_token_ids: .*?finish_reason: (\w+)")
STATS = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
                   r"Running: (\d+) reqs, Waiting: (\d+) reqs, GPU KV cache usage: ([\d.]+)%, Prefix cache hit rate: ([\d.]+)%")
TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>\n?|$)", re.S)


def turns(prompt: str) -> list[tuple[str, str]]:
    """ChatML prompt → [(role, content)], the trailing empty assistant header dropped."""
    out = [(m.group(1), m.group(2)) for m in TURN.finditer(prompt)]
    if out and out[-1][0] == "assistant" and not out[-1][1].strip():
        out.pop()
    return out or [("raw", prompt)]


def fingerprint(turn: tuple[str, str]) -> bytes:
    return hashlib.blake2b(f"{turn[0]}\0{turn[1]}".encode(), digest_size=8).digest()


def literal(text: str) -> str:
    try:
        value = ast.literal_eval(text)
        return value if isinstance(value, str) else str(value)
    except (ValueError, SyntaxError):
        return text.strip("'\"")


def printable(text: str) -> str:
    """ChatML markers and control characters made visible, reasoning and tool calls tagged."""
    text = re.sub(r"<think>(.*?)(</think>|$)", lambda m: f"\x00dim[reasoning: {m.group(1).strip()}]\x00", text, flags=re.S)
    text = re.sub(r"<tool_call>(.*?)(</tool_call>|$)", lambda m: f"\x00bold[tool_call: {m.group(1).strip()}]\x00", text, flags=re.S)
    text = text.replace("<|im_start|>", "⟨im_start⟩").replace("<|im_end|>", "⟨im_end⟩")
    return "".join(c if c in "\n\t\x00" or c.isprintable() else f"\\x{ord(c):02x}" for c in text)


@dataclass
class Thread:
    num: int
    prints: list[bytes] = field(default_factory=list)  # fingerprints of the turns shown so far


class Watcher:
    def __init__(self, out: TextIO, colour: bool, show_stats: bool = True):
        self.out = out
        self.colour = colour
        self.show_stats = show_stats
        self.threads: OrderedDict[int, Thread] = OrderedDict()
        self.by_request: dict[str, Thread] = {}
        self.next_num = 1
        self.requests = 0

    def paint(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.colour else text

    def styled(self, text: str, code: str) -> str:
        parts = text.split("\x00")
        out = []
        for part in parts:
            if part.startswith("dim["):
                out.append(self.paint("2", part[3:]))
            elif part.startswith("bold["):
                out.append(self.paint("1", part[4:]))
            elif part:
                out.append(self.paint(code, part))
        return "".join(out)

    def thread_for(self, prints: list[bytes]) -> tuple[Thread, int]:
        """Longest common turn prefix wins; >= 2 shared turns means the same conversation."""
        best, best_len = None, 0
        for t in self.threads.values():
            n = 0
            for a, b in zip(t.prints, prints):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = t, n
        if best is None or best_len < min(2, len(prints)):
            best, best_len = Thread(self.next_num), 0
            self.next_num += 1
        self.threads[best.num] = best
        self.threads.move_to_end(best.num)
        while len(self.threads) > MAX_THREADS:
            self.threads.popitem(last=False)
        return best, best_len

    def on_prompt(self, rid: str, prompt: str) -> None:
        self.requests += 1
        tt = turns(prompt)
        prints = [fingerprint(t) for t in tt]
        thread, known = self.thread_for(prints)
        self.by_request[rid] = thread
        code = COLOURS[(thread.num - 1) % len(COLOURS)]
        for role, content in tt[known:]:
            if role == "assistant":
                continue  # the model's own turns were printed as outputs
            shown = "<system prompt>" if role == "system" else content.strip()
            self.write(self.styled(f"[#{thread.num} {role}] {printable(shown)}", code))
        thread.prints = prints

    def on_output(self, rid: str, text: str, finish: str) -> None:
        thread = self.by_request.pop(rid, None)
        if thread is None:  # vLLM appends a choice index to some ids
            base = rid.rsplit("-", 1)[0]
            thread = self.by_request.pop(base, None)
        num = thread.num if thread else 0
        code = COLOURS[(num - 1) % len(COLOURS)] if num else "0"
        tag = f"[#{num} assistant]" if num else f"[{rid} assistant]"
        self.write(self.styled(f"{tag} {printable(text)}", code) + self.paint("2", f"  ({finish})"))

    def on_stats(self, m: re.Match) -> None:
        prompt_tps, gen_tps, running, waiting, kv, hit = m.groups()
        if not self.show_stats or (float(prompt_tps) == 0 and float(gen_tps) == 0 and running == "0" and waiting == "0"):
            return
        self.write(self.paint("2", f"   · prefill {prompt_tps} tok/s, decode {gen_tps} tok/s, running {running}, "
                                   f"waiting {waiting}, KV {kv}%, prefix hits {hit}%"))

    def feed(self, line: str) -> None:
        m = DETAILS.search(line)
        if m:
            self.on_prompt(m.group(1), literal(m.group(2)))
            return
        m = OUTPUT.search(line)
        if m:
            rid, stream, text, finish = m.groups()
            if stream and "delta" in stream:
                return  # the complete output follows
            self.on_output(rid, literal(text), finish)
            return
        m = STATS.search(line)
        if m:
            self.on_stats(m)

    def write(self, text: str) -> None:
        print(text, file=self.out, flush=True)
