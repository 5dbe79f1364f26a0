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
    """Sum every sample of the named metric families (labels folded), via prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {n.removesuffix("_total") for n in names}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in wanted:
            for sample in fam.samples:
                if sample.name in names or sample.name == fam.name:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
