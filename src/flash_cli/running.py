"""The running server as seen from the host: its container (by label) and its API address."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import api, state
from .output import say
from .spec import LABEL

if TYPE_CHECKING:  # pragma: no cover
    from docker.models.containers import Container


@dataclass
class Endpoint:
    url: str  # http://host:port
    key: str | None
    model: str


def endpoint(container: "Container") -> Endpoint:
    """Address from the container's own labels, never from re-supplied flags."""
    labels = container.labels
    bind = labels.get(f"{LABEL}.bind", "127.0.0.1")
    host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    host = f"[{host}]" if ":" in host else host
    # the key file is the deployment's (NAME), shared by every container of it (pd: NAME-router too)
    key = state.read_api_key(labels.get(f"{LABEL}.name") or container.name) \
        if labels.get(f"{LABEL}.api-key") == "required" else None
    return Endpoint(f"http://{host}:{labels.get(f'{LABEL}.port', '18300')}", key,
                    labels.get(f"{LABEL}.served-model-name", ""))


def recipe_settings(labels: dict):
    """The settings the container was started with, from its `org.flash.recipe` label (the
    overrides of the table's defaults); None for a container without one or with a bad one."""
    import json

    from .errors import FlashError
    from .settings import resolve

    raw = labels.get(f"{LABEL}.recipe")
    if not raw:
        return None
    try:
        return resolve(overrides=json.loads(raw))
    except (ValueError, TypeError, FlashError):
        return None


def in_flight(ep: Endpoint) -> float | None:
    reply = api.get(f"{ep.url}/metrics", timeout=3)
    if reply.status != 200:
        return None
    sums = api.metric_sums(reply.body.decode("utf-8", "replace"), ("vllm:num_requests_running",))
    return sums.get("vllm:num_requests_running", 0.0)


def drain(ep: Endpoint, timeout: float, interval: float = 1.0) -> tuple[float | None, float]:
    """Wait until no request runs (or the bound passes); returns (still running, seconds waited)."""
    start = time.monotonic()
    n = in_flight(ep)
    announced = False
    while n and time.monotonic() - start < timeout:
        if not announced:
            say(f"  · waiting for {n:.0f} running request(s) to finish (at most {timeout:.0f} s)")
            announced = True
        time.sleep(interval)
        n = in_flight(ep)
    return n, time.monotonic() - start
