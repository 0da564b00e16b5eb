"""Typed failures of the client. Each names what was wrong, with the numbers."""

from __future__ import annotations


class TidalpoolError(Exception):
    """Base of every tidalpool error."""


class AttachError(TidalpoolError):
    """The daemon could not be reached or refused the session."""


class SessionClosed(TidalpoolError):
    """The session is over (closed, evicted, or the daemon shut down)."""


class LeaseExceeded(TidalpoolError, MemoryError):
    """An allocation does not fit in what is free in the session's lease."""


class InvalidBlock(TidalpoolError, ValueError):
    """A block that is not live in this session was freed or used."""


class NotHostMemory(TidalpoolError, TypeError):
    """A NumPy view of the device lease was asked for where the lease is GPU memory (cuda)."""
