"""PURE: a recipe → the systemd unit that runs it at boot, and the systemctl steps (issue 16).

The unit's main process is `flash service run [PROFILE] [K=V…]`: it starts the container
(`flash serve`'s code path, with Docker's own restart policy off so only systemd restarts it),
then follows it. A container that dies with a non-zero code makes `run` exit non-zero, and
systemd restarts it (Restart=on-failure); `run` itself waits an exponentially growing delay
before each retry (BACKOFF_BASE_S × 2^(failures-1), at most BACKOFF_MAX_S; a boot that reached
/health resets the count), because systemd 252 (Debian 12, DGX OS 7) has no RestartSteps=.
Stopping the unit runs `flash stop` (ExecStop): it drains running requests for at most
DRAIN_TIMEOUT seconds, then stops the container; `run` sees a clean exit and exits 0.

Nothing here touches the file system or systemd: `commands/service.py` executes the plan.
"""

from __future__ import annotations

import os
import re
import shlex
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from .profiles import REPO

BACKOFF_BASE_S = 10
BACKOFF_MAX_S = 600
RESTART_SEC = 10
STOP_MARGIN_S = 90  # on top of DRAIN_TIMEOUT: Docker's stop grace (30 s) and the CLI itself
FOLLOW_INTERVAL_S = 5.0
SCOPES = ("system", "user")


def backoff_delay(failures: int) -> int:
    """Seconds `flash service run` waits before starting after `failures` failed runs in a row."""
    if failures <= 0:
        return 0
    return min(BACKOFF_BASE_S * 2 ** (failures - 1), BACKOFF_MAX_S)


def unit_name(name: str) -> str:
    return f"flash-{name}.service"


def unit_dir(scope: str, env: dict[str, str]) -> Path:
    if scope == "system":
        return Path("/etc/systemd/system")
    config = env.get("XDG_CONFIG_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".config")
    return Path(config) / "systemd" / "user"


def recipe_words(words: list[str], settings) -> list[str]:
    """The recipe as the unit will give it: the words the user typed, plus what came from the
    installer's environment (a service does not inherit a login shell), with HF_CACHE absolute
    (a system unit's `~` would be root's)."""
    from .recipe import split_words

    profile, rest, named = split_words(words)
    typed = {w.partition("=")[0] for w in rest}
    extra = [f"{k}={settings.as_env()[k]}" for k, src in sorted(settings.source.items())
             if src == "env" and k not in typed]
    hf = os.path.abspath(os.path.expanduser(settings["HF_CACHE"]))
    out = ([profile] if named else []) + [w for w in rest if not w.startswith("HF_CACHE=")] + \
        [w for w in extra if not w.startswith("HF_CACHE=")]
    return out + [f"HF_CACHE={hf}"]


# Words systemd reads as themselves when written bare: no quote, backslash, whitespace, `%`, `$`, `;`.
_BARE = re.compile(r"[A-Za-z0-9_./:=,+@-]+")


def _quoted(word: str) -> str:
    """One word as systemd reads it back exactly. Inside double quotes systemd undoes C escapes
    (`\\n`, `\\s`, `\\\\`: also inside single quotes, which is why shlex's quoting is wrong here),
    so backslashes and double quotes are escaped; `%` starts a specifier in every directive, so it
    is doubled. Control characters never get here (refuse())."""
    if _BARE.fullmatch(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def _cmd(argv: list[str]) -> str:
    """One ExecStart=/ExecStop= line: each word quoted for systemd; `$` doubled in the arguments,
    where systemd substitutes its variables (not in the executable's path, which it takes as is)."""
    return " ".join([_quoted(argv[0]), *(_quoted(a).replace("$", "$$") for a in argv[1:])])


def _env(key: str, value: str) -> str:
    """One Environment= assignment (quoted and %-escaped like an Exec word; no `$` expansion there)."""
    return _quoted(f"{key}={value}")


def refuse(what: str, value: str) -> None:
    """A control character in anything the unit carries would end the line (a newline starts a new
    directive: `EXTRA=--x\\nExecStart=…`) or mean something to systemd's parser: refused, named."""
    from .errors import ConfigError
    from .settings import bad_char, shown

    bad = bad_char(value)
    if bad is not None:
        raise ConfigError(f"flash service: {what} {shown(value)} contains the control character {bad!r}",
                          hint="a systemd unit carries one directive per line: remove it from the value")


@dataclass
class ServicePlan:
    scope: str
    unit: str  # flash-NAME.service
    path: Path
    text: str
    commands: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def render_unit(words: list[str], settings, *, scope: str, flash: str, home: str, user: str | None) -> str:
    name = settings["NAME"]
    for w in words:
        refuse("the recipe word", w)
    for what, v in (("the flash path", flash), ("HOME", home), ("the user", user or ""), ("the repository path", str(REPO))):
        refuse(what, v)
    run = [flash, "service", "run", *words]
    stop = [flash, "stop", *words]
    system = scope == "system"
    doc = "file://" + urllib.parse.quote(f"{REPO}/docs/SERVICE.md")  # a URL: spaces and `%` percent-encoded
    lines = [
        # shlex.join: a word ending in `\` would otherwise continue the comment onto the next line
        f"# Generated by `flash service install`; `flash service uninstall` removes it. Recipe: {shlex.join(words)}",
        "[Unit]",
        f"Description=flash: Qwen3.8-Flash-Next on vLLM (container {name})".replace("%", "%%"),
        f"Documentation={doc}".replace("%", "%%"),
        *(["Requires=docker.service", "After=docker.service network-online.target", "Wants=network-online.target"]
          if system else []),
        # at most 10 starts an hour; run's own backoff spaces them out further
        "StartLimitIntervalSec=3600",
        "StartLimitBurst=10",
        "",
        "[Service]",
        "Type=simple",
        *([f"User={_quoted(user)}"] if system and user else []),
        f"Environment={_env('HOME', home)}",
        "Environment=PYTHONUNBUFFERED=1",
        f"WorkingDirectory={str(REPO).replace('%', '%%')}",  # taken verbatim but for specifiers
        f"ExecStart={_cmd(run)}",
        # drains running requests (at most DRAIN_TIMEOUT s), then stops the container
        f"ExecStop={_cmd(stop)}",
        f"TimeoutStopSec={settings['DRAIN_TIMEOUT'] + STOP_MARGIN_S}",
        "KillMode=mixed",
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


def plan_install(words: list[str], settings, *, scope: str, env: dict[str, str], flash: str,
                 uid: int, user: str, start: bool = True) -> ServicePlan:
    if scope not in SCOPES:
        raise ValueError(f"scope {scope!r}")
    home = env.get("HOME") or os.path.expanduser("~")
    unit = unit_name(settings["NAME"])
    words = recipe_words(words, settings)
    text = render_unit(words, settings, scope=scope, flash=flash, home=home,
                       user=user if scope == "system" and uid != 0 else None)
    ctl = ["systemctl"] + (["--user"] if scope == "user" else [])
    cmds = [ctl + ["daemon-reload"], ctl + ["enable"] + (["--now"] if start else []) + [unit]]
    notes = []
    if scope == "user":
        notes.append(f"a user unit starts at boot only with lingering on: sudo loginctl enable-linger {user} "
                     "(it also keeps logind's RemoveIPC from deleting the server's shared memory at logout)")
    return ServicePlan(scope, unit, unit_dir(scope, env) / unit, text, cmds, notes)


def plan_uninstall(name: str, *, scope: str, env: dict[str, str]) -> ServicePlan:
    unit = unit_name(name)
    ctl = ["systemctl"] + (["--user"] if scope == "user" else [])
    # disable --now stops it first: ExecStop drains and stops the container (which is kept)
    return ServicePlan(scope, unit, unit_dir(scope, env) / unit, "",
                       [ctl + ["disable", "--now", unit], ctl + ["daemon-reload"]])
