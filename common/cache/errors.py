"""The one error the cache pools raise when a caller breaks their contract."""

from __future__ import annotations


class PoolInvariantError(AssertionError):
    """A pool's contract was broken: double free, page out of range, unlock below zero, leak.

    Always a bug in the caller (never a user error), so it subclasses AssertionError;
    it is raised explicitly, so `python -O` does not strip the check.
    """
