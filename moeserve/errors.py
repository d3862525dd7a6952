"""Errors a user can act on.

Every error raised at a boundary where bad input comes in (a checkpoint file, a setting, a request) is a
`MoeserveError`: its message is one line that names the culprit (file, tensor, setting) and says what to do.
The CLI prints `error: <message>` and exits non-zero without a traceback (``--debug`` shows it).
"""

from __future__ import annotations


class MoeserveError(Exception):
    """Base class: a problem the user can fix. ``str(err)`` is a single actionable line."""


class ConfigError(MoeserveError):
    """An unknown or invalid setting (keyword, CLI flag, MOESERVE_* environment variable)."""


class CheckpointError(MoeserveError):
    """A model folder or file that cannot be read as the config says it should be."""


class UnsupportedModelError(MoeserveError):
    """An architecture or quantization scheme moeserve does not implement."""


class RequestError(MoeserveError):
    """A generation request that cannot be served as asked (too long for the context, bad parameter)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ExpertLoadError(MoeserveError):
    """Reading an expert from a slower tier failed; the store stays consistent and the next call may succeed."""


class CorruptUnitError(ExpertLoadError):
    """An expert unit read from a slower tier differs from the bytes first read (or holds NaN): the file changed or
    is corrupt. The unit is marked bad; requests that need it fail with this error until the engine restarts."""
