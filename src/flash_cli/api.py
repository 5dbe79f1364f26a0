"""Small HTTP client for the server's own routes (/health, /v1/models, /metrics).

Standard library only: `flash status` and `flash wait` poll these, and must start fast.
"""

from __future__ import annotations

import json
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


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum every sample of the named series (labels folded).

    A line reader, not prometheus_client's parser: importing that package costs ~170 ms, which
    `flash status` cannot afford. Sample lines are `name{labels} value [timestamp]`; label
    values may hold spaces, so the value is taken after the closing brace. The unit tier checks
    this against prometheus_client on the stand-in server's real exposition.
    """
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        name = line[:brace] if 0 <= brace < space or (brace >= 0 and space < 0) else line[:space]
        if name not in wanted:
            continue
        rest = line[line.rfind("}") + 1:] if brace >= 0 else line[space:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out
