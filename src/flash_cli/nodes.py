"""PURE: NODES (the boxes of a multi-node deployment, head first) → one Docker Engine URL per box.

Accepted forms, comma separated:
  localhost | local            this machine's engine (DOCKER_HOST or the default socket)
  host, user@host, host:port   ssh:// to that box (docker-py's ssh transport, paramiko)
  ssh://[user@]host[:port]     the same, written as an engine URL
  tcp://host:port              a plain TCP engine (no TLS: `flash doctor` warns; ssh is the safe way)
  unix:///absolute/path        a local socket (a second engine on this machine)

Everything else is refused here, before any engine is dialled, with the entry and the accepted
forms named: docker-py would otherwise raise a bare ValueError (`h:1:2`), dial an http:// URL in
plaintext, or hand a host that starts with `-` to ssh as an option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

ACCEPTED = ("localhost, host, user@host, host:port, ssh://[user@]host[:port], tcp://host:port or unix:///path, "
            "comma separated, head first")
LOCAL = ("localhost", "local")
# A DNS name, an ssh-config alias or an IPv4 address; never a leading '-' (ssh would read an option).
_HOST = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}")
# docker-py's aliases for tcp://: one spelling (Docker's own, as in DOCKER_HOST), and flash sets up no
# TLS client certificates for https://. A remote box is reached over ssh.
_REFUSED_SCHEMES = {"http": "docker-py's plaintext alias of tcp:// (write tcp://host:port, or better a host for ssh)",
                    "https": "which needs TLS client certificates flash does not configure (write a host for ssh)"}


@dataclass(frozen=True)
class Box:
    written: str  # as in NODES
    url: str  # Docker Engine URL; "" = this machine's engine
    scheme: str  # local | ssh | tcp | unix

    @property
    def plaintext(self) -> bool:
        """The engine API crosses the network unencrypted and unauthenticated (tcp:// without TLS)."""
        return self.scheme == "tcp"


class _BadEntry(ConfigError):
    """One NODES entry refused; `parse` names the whole value around it when there are several."""

    def __init__(self, word: str, why: str):
        super().__init__(f"NODES entry {word!r} {why}", hint=f"NODES accepts {ACCEPTED}")
        self.word, self.why = word, why


def _port(word: str, text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise _BadEntry(word, f"has the port {text!r}, which is not a number")
    port = int(text)
    if not 1 <= port <= 65535:
        raise _BadEntry(word, f"has the port {port}, outside 1-65535")
    return port


def _host_port(word: str, rest: str, *, user_ok: bool, port_required: bool) -> tuple[str, str, int | None]:
    """`[user@]host[:port]` → (user, host, port), each part checked."""
    user = ""
    if "@" in rest:
        if not user_ok:
            raise _BadEntry(word, "names a user, which only ssh:// takes")
        user, _, rest = rest.rpartition("@")
        if not user:
            raise _BadEntry(word, "has an empty user before '@'")
        if not _USER.fullmatch(user):
            raise _BadEntry(word, f"has the user {user!r}: letters, digits, '_', '.', '-' (not first) only")
    if rest.count(":") > 1:
        raise _BadEntry(word, "has more than one ':' (host:port takes one; an IPv6 box needs a host name or an "
                              "ssh config alias)")
    host, colon, port_text = rest.partition(":")
    if not host:
        raise _BadEntry(word, "has an empty host")
    if not _HOST.fullmatch(host):
        raise _BadEntry(word, f"has the host {host!r}: letters, digits, '_', '.', '-' (not first) only")
    if colon and not port_text:
        raise _BadEntry(word, "has an empty port after ':'")
    port = _port(word, port_text) if colon else None
    if port is None and port_required:
        raise _BadEntry(word, "needs a port (tcp://host:port)")
    return user, host, port


def parse_one(word: str) -> Box:
    if word in LOCAL:
        return Box(word, "", "local")
    if "://" in word:
        scheme, _, rest = word.partition("://")
        if scheme in _REFUSED_SCHEMES:
            raise _BadEntry(word, f"uses {scheme}://, {_REFUSED_SCHEMES[scheme]}")
        if scheme == "unix":
            if not rest.startswith("/") or rest.rstrip("/") == "":
                raise _BadEntry(word, "needs an absolute socket path (unix:///run/docker.sock)")
            return Box(word, word, "unix")
        if scheme not in ("ssh", "tcp"):
            raise _BadEntry(word, f"has an unknown scheme {scheme!r}")
        if "/" in rest:
            raise _BadEntry(word, f"has a path after the host ({rest[rest.index('/'):]!r}); {scheme}:// takes none")
        user, host, port = _host_port(word, rest, user_ok=scheme == "ssh", port_required=scheme == "tcp")
    else:
        if "/" in word:
            raise _BadEntry(word, "is neither a host nor an engine URL (a '/' without a scheme)")
        scheme = "ssh"
        user, host, port = _host_port(word, word, user_ok=True, port_required=False)
    url = f"{scheme}://{user + '@' if user else ''}{host}{f':{port}' if port is not None else ''}"
    return Box(word, url, scheme)


def parse(text: str | None) -> list[Box]:
    """NODES → boxes. Empty entries and a box named twice are refused; `localhost` twice is the one
    exception: two ranks sharing this machine's GPUs (NODE_GPUS=0,1, docs/MULTINODE.md)."""
    if text is None or text.strip() == "":
        return []
    words = text.split(",")
    out: list[Box] = []
    seen: dict[str, str] = {}
    for i, raw in enumerate(words):
        word = raw.strip()
        if not word:
            raise ConfigError(f"NODES={text!r} has an empty entry (position {i + 1})", hint=f"NODES accepts {ACCEPTED}")
        try:
            box = parse_one(word)
        except _BadEntry as exc:
            if len(words) == 1:
                raise
            # name the whole value as well: the user typed it, not the entry alone
            raise ConfigError(f"NODES={text!r}: entry {exc.word!r} {exc.why}", hint=exc.hint) from None
        if box.scheme != "local" and box.url in seen:
            raise ConfigError(f"NODES={text!r} names the same box twice ({seen[box.url]!r} and {word!r})",
                              hint="one entry per box, head first; two ranks on one machine: "
                                   "NODES=localhost,localhost with NODE_GPUS=0,1 there")
        seen[box.url] = word
        out.append(box)
    return out


def check(text: str) -> None:
    """The settings table's check for NODES (every command refuses a malformed value before it runs)."""
    parse(text)
