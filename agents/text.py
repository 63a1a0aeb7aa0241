"""Worker output as lines of text: bytes decoded leniently, lines too long to keep whole cut
into pieces of protocol.MAX_LINE characters."""

from __future__ import annotations

from agents import protocol as P


def text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").rstrip("\r")


def cut(lines: list[str]) -> list[str]:
    """Lines longer than MAX_LINE characters, cut into pieces."""
    out: list[str] = []
    for line in lines:
        while len(line) > P.MAX_LINE:
            out.append(line[:P.MAX_LINE])
            line = line[P.MAX_LINE:]
        out.append(line)
    return out
