"""Host-side state: `$XDG_STATE_HOME/flash` (API keys, the request-logging config)."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from pathlib import Path


def state_dir(env: dict | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".local", "state")
    return Path(base) / "flash"


def api_key_path(name: str) -> Path:
    return state_dir() / f"api-key.{name}"


def ensure_api_key(name: str) -> tuple[Path, bool]:
    """The key for NAME, generated once (mode 0600); returns (path, created).

    Any number of processes may call this at once (two `serve`s, a deployment's boxes started in
    parallel): each writes a candidate key into its own temp file, then publishes it with link(),
    which fails when the name exists, so exactly one candidate becomes the key and it is never seen
    half-written. Everyone then re-reads the file and returns what is there."""
    path = api_key_path(name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if _key_text(path):
        os.chmod(path, 0o600)
        return path, False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    created = False
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(f"sk-flash-{secrets.token_urlsafe(32)}\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # the exclusive create: EEXIST when another process won
            created = True
        except FileExistsError:
            if not _key_text(path):  # an empty file left by something else: replace it (no key to keep)
                os.replace(tmp, path)
                created = True
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    os.chmod(path, 0o600)
    return path, created


def _key_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def write_private(path: Path, text: str) -> None:
    """A unique temp file in the same folder (mkstemp: mode 0600, O_EXCL), then rename over
    `path`: two concurrent writers never share a temp file, a reader sees old or new, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_api_key(name: str) -> str | None:
    path = api_key_path(name)
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


# DEBUG on vLLM's request logger only: a global DEBUG broke drafter graph capture upstream.
LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"vllm": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                            "datefmt": "%m-%d %H:%M:%S"}},
    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "stream": "ext://sys.stdout"}},
    "loggers": {
        "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
        "vllm.entrypoints.logger": {"handlers": ["vllm"], "level": "DEBUG", "propagate": False},
    },
}


def ensure_logging_config() -> Path:
    path = state_dir() / "logging.json"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, json.dumps(LOGGING_CONFIG, indent=2))
    os.chmod(path, 0o644)  # read by the container's user through a bind mount
    return path
