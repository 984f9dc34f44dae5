"""dualedit's exceptions: one base class, and subclasses that are also the built-in
exception a Python caller expects (a missing folder is a ``FileNotFoundError``, a bad
argument a ``ValueError``), each carrying the library's one-line message."""

from __future__ import annotations


class Error(Exception):
    """Base class of every error dualedit raises."""


class InputError(Error, ValueError):
    """A value given by the caller (argument, request field) is invalid."""


class NotFoundError(Error, FileNotFoundError):
    """A file or folder named by the caller does not exist."""

    def __init__(self, message: str):
        # FileNotFoundError(msg) keeps msg as str(e); no errno/filename to fill in.
        Exception.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class IoError(Error, OSError):
    """A file could not be read or written."""

    def __init__(self, message: str):
        Exception.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class FileError(Error, ValueError):
    """A file was read but its content is wrong (malformed JSON, missing key, bad shape)."""


class DeviceError(Error, ValueError):
    """A device name that does not parse or is not available on this machine."""


class OutOfMemoryError(Error, MemoryError):
    """An allocation failed on a device."""


class TorchError(Error, RuntimeError):
    """Any other libtorch error."""


class InternalError(Error, RuntimeError):
    """A broken internal invariant of dualedit (a bug to report, not a bad input)."""


__all__ = [
    "Error",
    "InputError",
    "NotFoundError",
    "IoError",
    "FileError",
    "DeviceError",
    "OutOfMemoryError",
    "TorchError",
    "InternalError",
]
