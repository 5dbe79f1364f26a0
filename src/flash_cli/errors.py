"""Typed errors. Each maps to an exit code and a one-line hint in exactly one place (main)."""

from __future__ import annotations


class FlashError(Exception):
    """Base class: `str(err)` is the one-line message, `hint` what to do next."""

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
    exit_code = 3


class ImageMissing(FlashError):
    exit_code = 4


class WeightsMissing(FlashError):
    exit_code = 5


class ContainerMissing(FlashError):
    exit_code = 6


class ContainerDied(FlashError):
    exit_code = 7


class NotReady(FlashError):
    exit_code = 8


class PortInUse(FlashError):
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


class MemoryLow(FlashError):
    """Not enough available memory for what the plan says the recipe claims (the memory guard)."""

    exit_code = 12
