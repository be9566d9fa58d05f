"""The one error type of moet-quant: a message a user can act on.

Each message names the file, tensor or key, what was expected, what was found and what to do.
Command-line entry points print it on one line and exit non-zero, with no traceback.
"""

from __future__ import annotations


class MoetError(Exception):
    """A clear, user-facing failure (bad input, unsupported format, no disk space, ...)."""

    exit_code = 2

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class CheckpointError(MoetError):
    """A checkpoint file or tensor is missing, truncated, corrupt or inconsistent."""


class FormatError(MoetError):
    """A tensor's quantization format is unknown or its data is invalid (NaN/Inf, bad scales)."""
