"""The one error the ``modelpool`` command reports without a traceback."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1 (2 for usage)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status
