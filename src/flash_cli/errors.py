"""Typed errors. Each maps to an exit code and a one-line hint in exactly one place (main).
This module is the exit-code map: docs/ARCHITECTURE.md's list is generated from it
(tools/gen_errors_doc.py; each class's first docstring line is its meaning there)."""

from __future__ import annotations

INTERRUPTED_EXIT = 130  # Ctrl-C, as a shell reports a SIGINT death (128 + 2)


class FlashError(Exception):
    """An error with no more specific class.

    `str(err)` is the one-line message, `hint` what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class UsageError(FlashError):
    """Bad command line, unknown key, bad value: exit 2 like argparse."""

    exit_code = 2


class ConfigError(UsageError):
    """A settings key or value that the table rejects."""


class DockerUnavailable(FlashError):
    """The Docker Engine cannot be reached, or failed a request (its own errors map here too)."""

    exit_code = 3

    HINT = "is dockerd running (systemctl status docker), and is your user in the docker group?"

    @classmethod
    def unreachable(cls, host: str, exc: BaseException) -> "DockerUnavailable":
        """The one message for an Engine that cannot be reached, whichever client found out:
        docker-py wraps the socket's OSError two or three levels deep (requests, urllib3), so
        name that cause instead of printing the wrappers' tuple reprs."""
        return cls(f"Docker Engine unreachable at {host}: {root_cause(exc)}", hint=cls.HINT)


def os_cause(exc: BaseException) -> OSError | None:
    """The innermost OSError with a reason (e.g. FileNotFoundError: No such file or directory),
    searching the exception's cause/context chain and the exceptions carried in its args."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return e
        todo += [a for a in e.args if isinstance(a, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def root_cause(exc: BaseException) -> str:
    """What to tell the user: the OSError's reason, else the exception's first line."""
    found = os_cause(exc)
    if found is not None:
        return found.strerror
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


class ImageMissing(FlashError):
    """The image the recipe needs is not built or pulled."""

    exit_code = 4


class WeightsMissing(FlashError):
    """The checkpoint (or the prepared variant) is not in the HF cache, or incomplete."""

    exit_code = 5


class ContainerMissing(FlashError):
    """No flash container to act on."""

    exit_code = 6


class ContainerDied(FlashError):
    """The server container exited (its exit code and last log lines are printed)."""

    exit_code = 7


class NotReady(FlashError):
    """The server did not become ready in time."""

    exit_code = 8


class PortInUse(FlashError):
    """The API port is taken by something else."""

    exit_code = 9


class CheckFailed(FlashError):
    """A gate (doctor, test, verify) found problems; details were already printed."""

    exit_code = 1


class NotAvailable(FlashError):
    """A step whose implementation has not landed yet."""

    exit_code = 10


class ContextMismatch(FlashError):
    """The server came up with another max model len than its recipe asks for (a silent fallback)."""

    exit_code = 11
