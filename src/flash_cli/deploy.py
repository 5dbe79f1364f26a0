"""A multi-node deployment through each box's Docker Engine: start, find, wait, stop, remove.

The plan is multinode.py's (pure); this module only talks to engines. Every box's engine is
reached before anything starts (an unreachable box changes nothing); containers are found by
their labels (org.flash.name + org.flash.node: 0 .. N-1, or `router` for a pd layout's P/D router on
box 0),
and the boxes of a running deployment come from the head's own labels (org.flash.nodes) when
NODES is not given again.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import api, engine, running, state
from .errors import ContainerDied, ContainerMissing, DockerUnavailable, NotReady
from .output import say
from .spec import LABEL

if TYPE_CHECKING:  # pragma: no cover
    from docker import DockerClient
    from docker.models.containers import Container

    from .multinode import Deployment


def connect(url: str, box: str, index: int, timeout: int = 300) -> "DockerClient":
    """One box's engine: "" = this machine's (DOCKER_HOST or the default socket), else the URL
    (ssh:// goes through the ssh binary, as `docker -H ssh://` does)."""
    if not url:
        try:
            return engine.connect(timeout)
        except DockerUnavailable as exc:
            raise DockerUnavailable(f"box {index} ({box}): {exc}", hint=exc.hint) from None
    import docker
    from docker.errors import DockerException

    try:
        client = docker.DockerClient(base_url=url, timeout=timeout, use_ssh_client=url.startswith("ssh://"))
        client.ping()
        return client
    except (DockerException, OSError) as exc:
        raise DockerUnavailable(
            f"box {index} ({box}) is unreachable: its Docker Engine at {url} does not answer "
            f"({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__})",
            hint="check the box is up, dockerd runs there and `docker -H URL info` works from here "
                 "(ssh: key-based login, your user in its docker group); nothing was changed") from None


def same_machine(url: str) -> bool:
    return url == "" or url.startswith("unix://") or url.split("://", 1)[-1].split(":")[0] in ("127.0.0.1", "localhost")


ROUTER = "router"  # org.flash.node of a pd layout's P/D router (on box 0)
CLOSE_S = engine.CLOCK_SKEW_S  # exits stamped closer than doctor lets two boxes' clocks differ are not ordered


def has_router(parallel: str | None) -> bool:
    """A pd layout (pd, pd3, pd4) has the P/D router on box 0."""
    from . import layout
    from .errors import ConfigError

    try:
        return bool(parallel) and parallel != "none" and layout.parse(parallel).kind == "pd"
    except ConfigError:  # a label another flash version wrote: no router then
        return False


@dataclass
class Box:
    index: int  # the box (0 = head); the router runs on box 0
    box: str
    url: str
    client: "DockerClient"
    container: "Container | None"
    node: str = ""  # org.flash.node: str(index), or "router"

    def __post_init__(self) -> None:
        self.node = self.node or str(self.index)

    @property
    def is_router(self) -> bool:
        return self.node == ROUTER

    @property
    def label(self) -> str:
        if self.is_router:
            return f"router on {self.box}"
        role = self.container.labels.get(f"{LABEL}.role", "?") if self.container is not None else "?"
        return f"node {self.index} ({role}) on {self.box}"


def find_node(client: "DockerClient", name: str, index: int | str) -> "Container | None":
    found = client.containers.list(all=True, filters={"label": [f"{LABEL}.name={name}", f"{LABEL}.node={index}"]})
    return found[0] if found else None


def engines_of(settings) -> list[str] | None:
    """The deployment's boxes: NODES when given, else the local head container's label."""
    from . import nodes

    if settings["NODES"]:
        return [b.written for b in nodes.parse(settings["NODES"])]
    try:
        client = engine.connect(timeout=30)
    except DockerUnavailable:
        return None
    head = find_node(client, settings["NAME"], 0)
    if head is None or not head.labels.get(f"{LABEL}.nodes"):
        return None
    return [b.written for b in nodes.parse(head.labels[f"{LABEL}.nodes"])]


def locate(settings) -> list[Box] | None:
    """Every box of the deployment NAME (None when NAME is a one-box server or nothing at all)."""
    from .multinode import engine_url

    boxes = engines_of(settings)
    if not boxes:
        return None
    out = []
    for i, box in enumerate(boxes):
        url = engine_url(box)
        client = connect(url, box, i)
        out.append(Box(i, box, url, client, find_node(client, settings["NAME"], i)))
    router = find_node(out[0].client, settings["NAME"], ROUTER)
    if router is not None or (out[0].container is not None and has_router(out[0].container.labels.get(f"{LABEL}.parallel"))):
        out.append(Box(0, out[0].box, out[0].url, out[0].client, router, ROUTER))
    if all(b.container is None for b in out):
        raise ContainerMissing(f"no flash deployment named {settings['NAME']!r} on {', '.join(boxes)}",
                               hint="start one: flash serve tp2|dp2|pd|… NODES=… NODE_ADDRS=…")
    return out


def endpoint_url(b: Box) -> str | None:
    """Where this box's API can be probed from here; None = only its container healthcheck can."""
    if b.container is None or b.container.labels.get(f"{LABEL}.role") == "worker":
        return None
    ep = running.endpoint(b.container)
    bind = b.container.labels.get(f"{LABEL}.bind", "127.0.0.1")
    if same_machine(b.url):
        return ep.url
    if bind in ("127.0.0.1", "::1"):
        return None
    host = bind if bind not in ("0.0.0.0", "::") else b.container.labels.get(f"{LABEL}.node-addrs", "").split(",")[b.index]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{b.container.labels.get(f'{LABEL}.port')}"


def healthy(b: Box, st: engine.State) -> bool:
    url = endpoint_url(b)
    if url is not None:
        return api.get(f"{url}/health", timeout=3).status == 200
    return st.health == "healthy"


def first_down(states: list[tuple[Box, engine.State]], up: tuple[str, ...] = ("running", "created", "restarting")
               ) -> tuple[Box, engine.State, list[Box]] | None:
    """The box that went down first (the cause: a lost rank takes the head down a moment later, and
    the head is listed first), and the others down; None when every box is up."""
    down = [(b, st) for b, st in states if st.status not in up]
    if not down:
        return None
    # by the engines' FinishedAt, as times (Docker trims trailing zeros, so the text does not sort);
    # the boxes' clocks are compared as they are (doctor checks they agree); never ended: last
    def ended(x):
        t = engine.epoch(x[1].finished_at)
        return (t is None, t or 0.0)

    # exits a moment apart are not ordered by the stamps: each engine stamps its own box's exit when
    # it reaps it, and under load the rank that was lost can be stamped after the head it took down.
    # Within CLOSE_S of the first, a box killed by a signal or the OOM killer (exit code above 128)
    # is the cause before one that exited on its own (a peer reacting to the loss)
    t0 = ended(min(down, key=ended))
    close = [x for x in down if ended(x)[0] == t0[0] and ended(x)[1] - t0[1] <= CLOSE_S]
    b, st = min(close, key=lambda x: (not killed(x[1]), ended(x)))
    return b, st, [o for o, _ in down if o is not b]


def killed(st: engine.State) -> bool:
    """Ended from outside: SIGKILL (docker kill, the OOM killer), SIGSEGV, ... (exit code 128 + signal)."""
    return st.oom_killed or (st.exit_code or 0) > 128


def settled_down(boxes: list[Box], up: tuple[str, ...] = ("running", "created", "restarting"), *,
                 quiet_s: float = 2.0, limit_s: float = 8.0, poll_s: float = 0.25,
                 read=None, clock=time.monotonic, sleep=time.sleep) -> tuple[Box, engine.State, list[Box]] | None:
    """first_down once the set of boxes down has held still for quiet_s (at most limit_s): a lost
    rank takes the head down within milliseconds, and the two engines (two boxes) record their
    exits independently, so one read can see the head exited while the worker's engine still says
    running. Naming the head then sends the user to the wrong box's logs."""
    read = read or (lambda b: engine.state(b.container))
    states = [(b, read(b)) for b in boxes]
    if first_down(states, up) is None:
        return None
    start = changed = clock()
    seen = {b.node for b, st in states if st.status not in up}
    while clock() - changed < quiet_s and clock() - start < limit_s:
        sleep(poll_s)
        states = [(b, read(b)) for b in boxes]
        now = {b.node for b, st in states if st.status not in up}
        if now != seen:
            seen, changed = now, clock()
    return first_down(states, up)


def died(b: Box, st: engine.State, n: int = 25, also: list[Box] = ()) -> ContainerDied:
    lines = engine.tail(b.container, n)
    print(f"--- {b.label}: last {len(lines)} log lines ---", file=sys.stderr)
    print("\n".join(lines), file=sys.stderr)
    oom = ", OOM-killed" if st.oom_killed else ""
    after = f"; after it: {', '.join(o.label for o in also)} went down too" if also else ""
    return ContainerDied(f"{b.label}: container {b.container.name} is {st.status} (exit code {st.exit_code}{oom}); "
                         f"its last log lines are above{after}",
                         hint=f"flash logs --node {b.node} for more; the deployment cannot come up without every box")


# -- serve -----------------------------------------------------------------------------------
def serve(dep: "Deployment", s, *, force: bool, start_check: float, kv_label: str) -> int:
    from . import preflight

    boxes = [Box(n.index, n.box, n.engine, connect(n.engine, n.box, n.index), None) for n in dep.nodes]
    if dep.router is not None:  # on box 0, through the same engine
        boxes.append(Box(0, boxes[0].box, boxes[0].url, boxes[0].client, None, ROUTER))
    for b, n in zip(boxes, dep.containers()):  # the image on every box, before anything changes
        for p in preflight.image(s, n.spec.image, engine.image_labels(b.client, n.spec.image)):
            raise p.error(f"box {b.index} ({b.box}): {p.message}", hint=p.hint)
        b.container = find_node(b.client, s["NAME"], b.node)
    # a one-box server of that NAME on any box is replaced (after every check passed, below)
    one_box = [(b, c) for b in boxes for c in engine.find_all(b.client, s["NAME"]) if f"{LABEL}.node" not in c.labels]
    held = [b for b in boxes if b.container is not None and engine.state(b.container).status == "running"]
    same = all(b.container is not None and b.container.labels.get(f"{LABEL}.settings") == n.spec.labels[f"{LABEL}.settings"]
               and b.container.labels.get(f"{LABEL}.nodes") == s["NODES"] for b, n in zip(boxes, dep.containers()))
    if len(held) == len(boxes) and same and not force:
        print(f"{s['NAME']} already runs this deployment on {s['NODES']} (settings "
              f"{dep.head.spec.labels[f'{LABEL}.settings']}); nothing to do (--force replaces it)")
        return 0
    if same_machine(boxes[0].url):
        head_held = any(b.index == 0 for b in held) or any(  # ours: replaced below
            b.index == 0 and engine.state(c).status == "running" for b, c in one_box)
        for p in preflight.port(s, held_by_us=head_held):
            p.raise_()
    if dep.router is not None:  # pd: the servers' own ports (PD_PORT+r) on the boxes of this machine
        for b, n in zip(boxes, dep.nodes):
            port = int(n.spec.labels[f"{LABEL}.port"])
            if not same_machine(b.url) or b in held:
                continue
            try:
                free = preflight.port_free(n.addr, port)
            except OSError:  # the address is not this machine's: that box's engine is local by socket only
                continue
            if not free:
                from .errors import PortInUse

                raise PortInUse(f"port {n.addr}:{port} (the {n.role} server's: PD_PORT{f'+{n.index}' if n.index else ''}) is "
                                "already in use by another program; nothing was started",
                                hint=f"pick another: PD_PORT={s['PD_PORT'] + len(dep.nodes)}")
    front = boxes[-1] if dep.router is not None else boxes[0]  # where users' requests come in
    if front.container is not None and front in held and s["DRAIN_TIMEOUT"] > 0 and endpoint_url(front):
        left, _ = running.drain(running.Endpoint(endpoint_url(front), running.endpoint(front.container).key, ""),
                        s["DRAIN_TIMEOUT"])
        if left:
            say(f"  ! {left:.0f} request(s) still running after {s['DRAIN_TIMEOUT']} s; replacing anyway")
    for b, c in one_box:
        say(f"  · replacing the one-box server on box {b.index}: {engine.describe(c)}")
        c.remove(force=True)
    for b in boxes:
        if b.container is not None:
            say(f"  · replacing {b.label}: {engine.describe(b.container)}")
            b.container.remove(force=True)
            b.container = None
    head = dep.head
    if head.spec.needs_api_key and same_machine(boxes[0].url):
        path, created = state.ensure_api_key(s["NAME"])
        say(f"  · API key {'generated' if created else 'kept'}: {path} (mode 0600)")
    elif head.spec.needs_api_key:
        say("  ! the head is remote: its API key file must exist there (run flash serve on the head, or copy "
            f"{state.api_key_path(s['NAME'])} to it)")
    # Head first: it owns the rendezvous / handshake socket the headless ranks connect to; the
    # router last (its /health needs every server).
    for b, n in zip(boxes, dep.containers()):
        if not b.is_router:
            n.spec.labels[f"{LABEL}.kv-plan"] = kv_label
        b.container = engine.create_and_start(b.client, n.spec)
        say(f"  · started {b.label}: {b.container.name} ({b.container.short_id})")
    deadline = time.monotonic() + start_check
    while True:
        # restarting counts as down here: a box that crashed in its first seconds (its restart policy)
        down = settled_down(boxes, up=("created", "running"))
        if down is not None:
            err = died(*down)
            remove_all(boxes)
            raise ContainerDied(f"{err} during start; every box's container was removed", hint=err.hint)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    print(f">> {s['NAME']} starting on {len(dep.nodes)} boxes ({dep.parallel}"
          + (", P/D router on box 0" if dep.router is not None else "") + "): "
          + ", ".join(f"{u}/v1" for u in dep.api_urls()))
    say("   next: flash wait (watches every box), then flash test")
    return 0


def remove_all(boxes: list[Box]) -> None:
    for b in boxes:
        if b.container is not None:
            try:
                b.container.remove(force=True)
            except Exception:  # noqa: BLE001 - best effort while reporting the real failure
                pass


# -- wait / status / stop / start / rm / logs -------------------------------------------------
def wait(boxes: list[Box], timeout: float, interval: float) -> int:
    missing = [b for b in boxes if b.container is None]
    if missing:
        what = "the router" if missing[0].is_router else f"node {missing[0].index}"
        raise ContainerMissing(f"{what} on {missing[0].box}: no container of this deployment there",
                               hint="flash serve … again (it starts every box)")
    start = time.monotonic()
    api_boxes = [b for b in boxes if b.container.labels.get(f"{LABEL}.role") != "worker"]
    while True:
        states = [(b, engine.state(b.container)) for b in boxes]  # every box first: a dead rank never recovers
        if first_down(states) is not None and (down := settled_down(boxes)) is not None:
            raise died(*down)
        if all(st.status == "running" for _, st in states) and all(healthy(b, st) for b, st in states if b in api_boxes):
            break
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise NotReady(f"the deployment is still not up after {elapsed:.0f} s", hint="flash logs --node N")
        time.sleep(interval)
    print(f"ready after {time.monotonic() - start:.0f} s: {len({b.box for b in boxes})} boxes")
    router = [b for b in boxes if b.is_router]
    for b in router or api_boxes:  # pd: the router is the one endpoint; the servers behind it are internal
        url = endpoint_url(b)
        print(f"  {b.label}: API {url + '/v1' if url else '(healthy, probed inside the box)'}")
    return 0


def status(boxes: list[Box]) -> list[dict]:
    out = []
    for b in boxes:
        row: dict = {"node": ROUTER if b.is_router else b.index, "box": b.box, "engine": b.url or "local"}
        if b.container is None:
            out.append({**row, "state": "absent"})
            continue
        st = engine.state(b.container)
        labels = b.container.labels
        row.update(name=b.container.name, role=labels.get(f"{LABEL}.role"), parallel=labels.get(f"{LABEL}.parallel"),
                   state=st.status, exit_code=None if st.status == "running" else st.exit_code, health=st.health,
                   image=labels.get(f"{LABEL}.image"), image_id=b.container.attrs.get("Image", ""),
                   settings_hash=labels.get(f"{LABEL}.settings"))
        url = endpoint_url(b)
        if url and st.status == "running":
            row["url"] = f"{url}/v1"
            row["api"] = "up" if api.get(f"{url}/health", timeout=2).status == 200 else "loading"
        if st.status != "running":
            row["last_lines"] = engine.tail(b.container, 5)
        out.append(row)
    return out


def stop(boxes: list[Box], drain_timeout: float, dry_run: bool) -> int:
    """The router first (drained: no new requests reach the servers), then the API box(es)
    (drained, bounded), then the headless ranks."""
    order = sorted((b for b in boxes if b.container is not None),
                   key=lambda b: (not b.is_router, b.container.labels.get(f"{LABEL}.role") == "worker"))
    for b in order:
        st = engine.state(b.container)
        if st.status != "running":
            print(f"{b.label}: {b.container.name} is {st.status}; nothing to stop")
            continue
        if dry_run:
            print(f"would stop {b.label}: {engine.describe(b.container)}")
            continue
        url = endpoint_url(b)
        if url and drain_timeout > 0:
            left, waited = running.drain(running.Endpoint(url, running.endpoint(b.container).key, ""), drain_timeout)
            if left:
                say(f"  ! {left:.0f} request(s) still running after {waited:.0f} s; stopping anyway")
        b.container.stop(timeout=30)
        print(f"{b.label}: {b.container.name} stopped")
    return 0


def start(boxes: list[Box], dry_run: bool) -> int:
    for b in boxes:  # head first, the router last, as at serve
        if b.container is None:
            raise ContainerMissing(f"{'the router' if b.is_router else f'node {b.index}'} on {b.box}: no container of "
                                   "this deployment there", hint="flash serve … again (it starts every box)")
        if dry_run:
            print(f"would start {b.label}: {engine.describe(b.container)}")
            continue
        if engine.state(b.container).status != "running":
            b.container.start()
        print(f"{b.label}: {b.container.name} starting")
    if not dry_run:
        say("next: flash wait")
    return 0


def rm(boxes: list[Box], dry_run: bool) -> int:
    verb = "would remove" if dry_run else "removed"
    for b in boxes:
        if b.container is None:
            print(f"{b.label}: nothing there")
            continue
        st = engine.state(b.container)
        what = engine.describe(b.container)
        if not dry_run:
            b.container.remove(force=True)
        print(f"{b.label}: {verb} container {what}, which was {st.status}")
    return 0


def logs(boxes: list[Box], node: str, lines: int, follow: bool) -> int:
    from .errors import UsageError

    found = [b for b in boxes if b.node == node]
    if not found:
        raise UsageError(f"--node {node} is not a box of this deployment",
                         hint="--node " + " | ".join(b.node for b in boxes))
    b = found[0]
    if b.container is None:
        raise ContainerMissing(f"{b.label}: no container of this deployment there")
    if not follow:
        print("\n".join(engine.tail(b.container, lines)))
        return 0
    for chunk in engine.follow(b.container, lines):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0
