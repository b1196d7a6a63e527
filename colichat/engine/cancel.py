"""A stop request as a value (Go's context.Context, trio's cancel scopes): whoever starts a piece of
work makes one Cancel and passes it down; the source of a stop (a Ctrl-C handler, a closed pipe, an
ending signal) calls set(); the work asks at its safe points (the engine: before every layer, and before
each routed expert's fill and product) and unwinds from there (Cancelled), keeping nothing it did not finish.

A leaf: it imports nothing of colichat, so the app and the engine both may use it.
"""

from __future__ import annotations


class Cancelled(Exception):
    """A pass stopped at a safe point because its Cancel was set (the cache keeps none of its rows)."""


class Cancel:
    """One stop request: set once by its source (from a signal handler too), read by the work."""

    __slots__ = ("requested",)

    def __init__(self) -> None:
        self.requested = False

    def set(self) -> None:
        self.requested = True

    def check(self) -> None:
        """At a safe point: raise Cancelled if a stop was requested."""
        if self.requested:
            raise Cancelled
