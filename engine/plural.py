"""A count and its noun in the words kvguard's messages use: "1 sequence", "2 sequences".

Apart from every other engine module so that the engine, the rules and the daemon all import
it without a cycle."""

from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """`n` and `noun`, plural but for one: an action's detail reads "evicted 1 sequence"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
