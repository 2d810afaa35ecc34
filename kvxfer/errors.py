"""The errors kvxfer raises.

Every error kvxfer raises on purpose is a `KvxferError`. Bad arguments are also
`ValueError`s, so callers that already catch `ValueError` keep working.
"""

__all__ = ["CorruptionError", "InvalidInputError", "KvxferError", "LayoutMismatchError",
           "SetupError", "StagingFullError", "TransferError", "UnknownRequestError"]



class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose."""


class InvalidInputError(KvxferError, ValueError):
    """An argument is out of range, of the wrong shape, or inconsistent."""


class LayoutMismatchError(InvalidInputError):
    """Caches, host blocks or a peer do not match the expected cache layout."""


class CorruptionError(KvxferError):
    """Received KV blocks do not match the fingerprints computed at the source."""


class TransferError(KvxferError):
    """A transfer between P and D failed, timed out, or its peer is gone."""


class SetupError(KvxferError, RuntimeError):
    """The machine lacks what a tool or benchmark needs (root, `ip`, etcd), or setting it up failed."""


class StagingFullError(KvxferError):
    """No free staging slots are left for a request."""


class UnknownRequestError(KvxferError, KeyError):
    """A request id (or one of its blocks) is not staged."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
