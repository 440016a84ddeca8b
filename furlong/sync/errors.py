"""Errors raised while applying a weight update; each leaves the receiver's tensors unchanged."""

from __future__ import annotations


class SyncError(RuntimeError):
    """Base class: a weight update could not be applied."""


class CorruptUpdate(SyncError):
    """The payload is truncated, damaged or malformed (bad magic, digest, zstd frame, length)."""


class ChecksumMismatch(SyncError):
    """A tensor rebuilt from the update does not hash to the checksum the sender recorded.

    The payload itself was intact, so the receiver's base differed from the sender's `prev`.
    """


class BaseVersionMismatch(SyncError):
    """The delta was made against a different version than the one the receiver holds."""


class StaleUpdate(BaseVersionMismatch):
    """The update is not newer than what the receiver holds (e.g. the same update re-applied)."""


class IncompatibleBase(SyncError):
    """The receiver's tensors do not fit the update (missing name, shape, dtype, layout, device)."""
