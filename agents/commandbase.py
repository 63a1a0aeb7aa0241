"""The base of every command (agents/commands.py has them all): a frozen dataclass naming its
``OP``, read from a raw line's fields at the agent's door; a request is bound to its reply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from agents import protocol as P
from agents.fields import CommandFields as _Read

R = TypeVar("R", bound=P.Reply)


@dataclass(frozen=True)
class Command:
    OP: ClassVar[str] = ""

    @classmethod
    def read(cls, f: _Read) -> Command:
        return cls()


@dataclass(frozen=True)
class Request(Command, Generic[R]):
    """A command that is answered: by ``REPLY``, or by ``Failed``."""

    REPLY: ClassVar[type[P.Reply]] = P.Reply
