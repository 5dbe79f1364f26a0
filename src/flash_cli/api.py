"""Small HTTP client for the server's own routes (/health, /v1/models, /metrics).

Standard library only: `flash status` and `flash wait` poll these, and must start fast.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class Reply:
    status: int  # 0 = no connection (refused, reset, timeout)
    body: bytes = b""
    error: str = ""

    def json(self):
        return json.loads(self.body)


def get(url: str, key: str | None = None, timeout: float = 3.0) -> Reply:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read() or b"", str(exc))
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return Reply(0, b"", str(getattr(exc, "reason", exc)))


def _samples(text: str, wanted: set[str]):
    """(name, labels text, value) of each sample line of the wanted series. Sample lines are
    `name{labels} value [timestamp]`; label values may hold spaces and braces, so the value is
    taken after the last closing brace."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        name = line[:brace] if 0 <= brace < space or (brace >= 0 and space < 0) else line[:space]
        if name not in wanted:
            continue
        close = line.rfind("}") if brace >= 0 else -1
        rest = line[close + 1:] if brace >= 0 else line[space:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        yield name, line[brace + 1:close] if brace >= 0 else "", value


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum every sample of the named series (labels folded).

    A line reader, not prometheus_client's parser: importing that package costs ~170 ms, which
    `flash status` cannot afford. The unit tier checks this against prometheus_client on the
    stand-in server's real exposition.
    """
    out: dict[str, float] = {}
    for name, _, value in _samples(text, set(names)):
        out[name] = out.get(name, 0.0) + value
    return out


def metric_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """One series summed per value of one label (the others folded), e.g. vLLM's accepted draft
    tokens per `position`; samples without the label are left out."""
    pattern = re.compile(r'(?:^|,)\s*' + re.escape(label) + r'="((?:[^"\\]|\\.)*)"')
    out: dict[str, float] = {}
    for _, labels, value in _samples(text, {name}):
        m = pattern.search(labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out
