"""Exceptions. Every error commlib raises about communication derives from CommError;
bad arguments raise ValueError/TypeError before anything is sent."""


class CommError(RuntimeError):
    """A communication failed or the ranks disagreed about what to communicate."""


class CommTimeoutError(CommError, TimeoutError):
    """An operation did not complete within its timeout."""


class CollectiveMismatchError(CommError):
    """The ranks called different collectives, or the same one with different arguments
    (count, dtype, op, root, algorithm, splits). Raised on every rank, naming what differs."""
