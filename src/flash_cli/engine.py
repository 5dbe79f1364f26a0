"""The Docker Engine layer (docker SDK): connect, find our containers by label, run a RunSpec.

Everything Docker-specific the commands need is here, so the commands read as plans plus a
few calls. docker-py is imported on first use (it costs ~150 ms of import time).
"""

from __future__ import annotations

import os
import re
import time
from datetime import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from .errors import ContainerMissing, DockerUnavailable, FlashError, ImageMissing
from .spec import LABEL, RunSpec

if TYPE_CHECKING:  # pragma: no cover
    from docker import DockerClient
    from docker.models.containers import Container


def connect(timeout: int = 300) -> "DockerClient":
    """A hung daemon fails after `timeout` s; an absent one at once. Creating a container copies
    its image on some storage drivers (vfs), which takes minutes on a slow disk: hence 300."""
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        return client
    except DockerException as exc:
        raise DockerUnavailable.unreachable(host(), exc) from None


def host() -> str:
    """Where docker-py connects (its from_env default when DOCKER_HOST is unset)."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


@dataclass
class State:
    """What `docker inspect` says, reduced to what the commands decide on."""

    status: str  # running | exited | created | restarting | paused | dead | absent
    exit_code: int | None = None
    oom_killed: bool = False
    health: str | None = None
    started_at: str = ""
    finished_at: str = ""  # RFC 3339 UTC as docker writes it ("0001-01-01T00:00:00Z" = never ended)


# how far two boxes' clocks may differ (doctor fails past it); exit stamps closer are not ordered
CLOCK_SKEW_S = 1.0


def epoch(text: str) -> float | None:
    """A Docker timestamp (RFC 3339 with up to nanoseconds, trailing zeros trimmed: State.FinishedAt,
    `docker info` SystemTime) → epoch seconds; None for anything else, Docker's zero time included."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", text or "")
    if not m or m.group(1).startswith("0001-"):
        return None
    tz = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + tz).timestamp() + float("0" + (m.group(2) or ".0"))


def find(client: "DockerClient", name: str) -> "Container | None":
    """Our container for NAME, by label (never by re-supplied flags)."""
    found = client.containers.list(all=True, filters={"label": f"{LABEL}.name={name}"})
    # a deployment's front first: pd's router (its one endpoint), else the head before its ranks
    found.sort(key=lambda c: (c.labels.get(f"{LABEL}.node") != "router", c.labels.get(f"{LABEL}.node", "0") != "0"))
    return found[0] if found else None


def find_all(client: "DockerClient", name: str) -> list["Container"]:
    """Every container labelled NAME on this engine (a multi-node deployment's boxes may share one)."""
    return client.containers.list(all=True, filters={"label": f"{LABEL}.name={name}"})


def require(client: "DockerClient", name: str) -> "Container":
    c = find(client, name)
    if c is None:
        raise ContainerMissing(f"no flash container named {name!r}", hint="start one: flash serve [profile]")
    return c


def state(container: "Container") -> State:
    container.reload()
    st = container.attrs.get("State", {})
    health = (st.get("Health") or {}).get("Status")
    return State(st.get("Status", "unknown"), st.get("ExitCode"), bool(st.get("OOMKilled")), health,
                 st.get("StartedAt", ""), st.get("FinishedAt", ""))


def tail(container: "Container", n: int = 25) -> list[str]:
    raw = container.logs(tail=n, stdout=True, stderr=True)
    return raw.decode("utf-8", "replace").splitlines()


def follow(container: "Container", n: int) -> Iterator[str]:
    for chunk in container.logs(stream=True, follow=True, tail=n):
        yield chunk.decode("utf-8", "replace")


def image_labels(client: "DockerClient", image: str) -> dict[str, str] | None:
    """Labels of a local image; None when it is not there (no pull is ever attempted)."""
    from docker.errors import ImageNotFound

    try:
        return client.images.get(image).labels or {}
    except ImageNotFound:
        return None


def require_image(client: "DockerClient", image: str) -> dict[str, str]:
    labels = image_labels(client, image)
    if labels is None:
        raise ImageMissing(f"image {image!r} is not built", hint="build it: flash setup (or docker build, see Dockerfile)")
    return labels


def create_and_start(client: "DockerClient", spec: RunSpec) -> "Container":
    from docker.errors import APIError

    from .render import to_kwargs

    kwargs = to_kwargs(spec)
    try:
        container = client.containers.create(**kwargs)
    except APIError as exc:
        raise FlashError(f"docker refused to create {spec.name}: {exc.explanation or exc}",
                         hint="check the image, the GPU runtime (GPUS=all needs the NVIDIA toolkit) and the port") from None
    try:
        container.start()
    except APIError as exc:
        container.remove(force=True)
        raise FlashError(f"docker could not start {spec.name}: {exc.explanation or exc} (container removed)",
                         hint="port in use or GPU runtime missing? run: flash doctor") from None
    return container


def watch_start(container: "Container", seconds: float, poll: float = 0.5) -> State:
    """The start check: a container that dies in its first seconds is caught here."""
    deadline = time.monotonic() + seconds
    st = state(container)
    while time.monotonic() < deadline and st.status in ("created", "running"):
        time.sleep(poll)
        st = state(container)
    return st


def describe(container: "Container") -> str:
    labels = container.labels
    return (f"{container.name} ({container.short_id}, image {labels.get(f'{LABEL}.image', '?')}, "
            f"profile {labels.get(f'{LABEL}.profile', '?')})")
