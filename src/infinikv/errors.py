"""Errors a user can cause. The CLI prints their one-line message and exits non-zero."""


class InfinikvError(Exception):
    """Base class: a problem with the user's input or environment, explained in one line."""

    exit_code = 2


class ModelError(InfinikvError):
    """Unknown model, missing file, failed download, checksum mismatch."""


class InputError(InfinikvError):
    """Bad prompt, bad numbers, prompt longer than the context."""


class PolicyError(InfinikvError):
    """Unknown policy or knob, or a knob value out of range (``knob``: the knob rejected, when one is)."""

    def __init__(self, message: str, knob: str | None = None):
        super().__init__(message)
        self.knob = knob


class DataError(InfinikvError):
    """A corpus could not be fetched or failed its checksum."""


class CacheError(InfinikvError):
    """The cache folder cannot be created, read or written (permissions, disk full)."""
