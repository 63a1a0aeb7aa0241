"""Reading the fields of one raw message from a node, each checked for its type and its
bounds: the first bad one raises ProtocolError naming it (agents/protocol.py uses these);
``encode`` and ``decode``, a message as a JSON line; and ``plain``, a message or command as
the JSON values that carry it."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
from typing import Any

MAX_COUNT = 1 << 62  # sequence numbers, attempts, sizes, steps
MAX_ITEMS = 1 << 16  # entries of one list or mapping
MAX_RANK = 1 << 24  # global ranks
MAX_ARG = 1 << 20  # one argument, path, script or variable of a command
MAX_PORT = 65535
MAX_MESSAGE = 4 * 1024 * 1024  # one JSON line (a line count is bounded by it too)
# Unix times a node may report (a heartbeat, an exit): 1970 to 2100. Readers turn them into
# dates, and a worker sets its heartbeat file's mtime to anything it likes.
MAX_TIME = 4_102_444_800.0
_SIGNAL_RE = re.compile(r"^SIG[A-Z0-9+]{1,12}$")


def unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode (JSON lets a lone surrogate through: "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else (bools, text, NaN, infinities,
    integers beyond any float)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _fits(kind: str, value: Any, words: tuple[str, ...]) -> bool:
    if kind == "i":
        return type(value) is int and 0 <= value < MAX_COUNT
    if kind == "f":
        number = finite(value)
        return number is not None and 0.0 <= number < MAX_TIME
    return value in words


class ProtocolError(ValueError):
    """A message out of protocol: ``field`` names what is wrong."""

    def __init__(self, kind: str, field_name: str, value: Any):
        try:
            shown = repr(value)[:40]
        except ValueError:  # an int past Python's digit limit
            shown = f"<{type(value).__name__}>"
        super().__init__(f"{kind}: bad {field_name} {shown}")
        self.kind, self.field, self.value = kind, field_name, value


class Fields:
    """Reads the fields of one raw message, raising ProtocolError for the first bad one."""

    def __init__(self, raw: dict[str, Any]):
        self.raw, self.kind = raw, str(raw.get("type"))

    def bad(self, name: str, value: Any = None) -> ProtocolError:
        return ProtocolError(self.kind, name, self.raw.get(name) if value is None else value)

    def integer(self, name: str, low: int = 0, high: int = MAX_COUNT, optional: bool = False,
            value: Any = ...) -> Any:
        v = self.raw.get(name) if value is ... else value
        if v is None and optional:
            return None
        if type(v) is not int or not low <= v <= high:
            raise self.bad(name, v)
        return v

    def text(self, name: str, limit: int = 4096, optional: bool = False, value: Any = ...
            ) -> Any:
        v = self.raw.get(name) if value is ... else value
        if v is None and optional:
            return None
        if not isinstance(v, str) or len(v) > limit or not unicode(v):
            raise self.bad(name, v)
        return v

    def flag(self, name: str, default: bool | None = None) -> bool:
        v = self.raw.get(name, default)
        if not isinstance(v, bool):
            raise self.bad(name, v)
        return v

    def number(self, name: str, optional: bool = False, value: Any = ...) -> Any:
        v: Any = self.raw.get(name) if value is ... else value
        if v is None and optional:
            return None
        number = finite(v)
        if number is None:
            raise self.bad(name, v)
        return number

    def timestamp(self, name: str, optional: bool = False, value: Any = ...) -> Any:
        """A Unix time between 1970 and 2100."""
        v = self.number(name, optional, value)
        if v is not None and not 0.0 <= v < MAX_TIME:
            raise self.bad(name, v)
        return v

    def stream(self) -> str:
        """A worker's output stream (``stream``)."""
        stream = self.text("stream", 16)
        if stream not in ("stdout", "stderr"):
            raise self.bad("stream")
        return stream

    def signal(self) -> str | None:
        """A signal's name (``signal``), as SIGTERM."""
        sig = self.text("signal", 16, True)
        if sig is not None and not _SIGNAL_RE.match(sig):
            raise self.bad("signal")
        return sig

    def array(self, name: str, optional: bool = False, limit: int = MAX_ITEMS,
              value: Any = ...) -> Any:
        v = self.raw.get(name) if value is ... else value
        if v is None and optional:
            return []
        if not isinstance(v, list) or len(v) > limit:
            raise self.bad(name, v)
        return v

    def mapping(self, name: str, optional: bool = False) -> dict[str, Any]:
        v = self.raw.get(name)
        if v is None and optional:
            return {}
        if not isinstance(v, dict) or len(v) > MAX_ITEMS:
            raise self.bad(name, v)
        return v

    def lines(self, name: str = "lines") -> tuple[str, ...]:
        v = self.array(name, limit=MAX_MESSAGE)
        try:
            # Every line is text, and valid Unicode (a lone surrogate, which no real agent
            # sends, would fail the log's write): checked at C speed, floods come here.
            "".join(v).encode("utf-8")
        except TypeError:
            raise ProtocolError(self.kind, name, "lines must be text") from None
        except UnicodeEncodeError:
            raise ProtocolError(self.kind, name, "lines must be valid Unicode") from None
        return tuple(v)

    def rank_tuples(self, name: str, kinds: str, words: tuple[str, ...] = ()
                    ) -> dict[int, Any]:
        """``{rank: [...]}``, each list of one shape: per item of ``kinds``, ``i`` a count,
        ``f`` a finite number from 0 (seconds), ``w`` one of ``words``."""
        out = {}
        for key, v in self.mapping(name, optional=True).items():
            if not (isinstance(v, list) and len(v) == len(kinds)
                    and all(_fits(kinds[i], v[i], words) for i in range(len(v)))):
                raise self.bad(name, v)
            out[self.rank_key(key, name)] = tuple(float(v[i]) if kinds[i] == "f" else v[i]
                                                  for i in range(len(v)))
        return out

    def rank_key(self, key: Any, name: str) -> int:
        """A mapping key that names a rank ("3")."""
        if not isinstance(key, str) or not key.isdigit() or len(key) > 9:
            raise ProtocolError(self.kind, name, key)
        return self.integer(name, 0, MAX_RANK, value=int(key))


class CommandFields(Fields):
    """Fields of a command: ``kind`` is its op (a reply's is its type)."""

    def __init__(self, raw: dict[str, Any], op: str):
        super().__init__(raw)
        self.kind = op

    def strings(self, name: str, optional: bool = True) -> dict[str, str]:
        """A mapping of text to text (an environment)."""
        v = self.mapping(name, optional)
        for key, value in v.items():
            self.text(name, 4096, value=key)
            self.text(name, MAX_ARG, value=value)
        return dict(v)

    def words(self, name: str, optional: bool = True, limit: int = MAX_ARG,
              items: int = MAX_ITEMS) -> tuple[str, ...]:
        return tuple(self.text(name, limit, value=v)
                     for v in self.array(name, optional, limit=items))

    def ports(self, name: str) -> tuple[int, ...]:
        return tuple(self.integer(name, 0, MAX_PORT, value=p)
                     for p in self.array(name, optional=True))

    def seconds(self, name: str, optional: bool = False) -> Any:
        v = self.number(name, optional)
        if v is not None and not 0 <= v < MAX_COUNT:
            raise self.bad(name, v)
        return v


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON line. Non-ASCII stays UTF-8 (fewer bytes than \\u escapes)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any] | None:
    """A JSON line as a dict, or None for anything that is not a JSON object (e.g. a login
    banner printed on an SSH channel, or nesting too deep to be ours)."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # a dataclass -> its fields' names


def plain(value: Any) -> Any:
    """A message or command as JSON values: dataclasses as objects (their None fields left
    out, which the door reads as absent), tuples as lists, bytes as base64."""
    kind = type(value)
    if kind in _JSON_SCALARS:  # most values: answered before any other look (a `start`
        return value           # for 4,000 nodes is 170,000 of them)
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        out = {}
        for name in names:
            field = getattr(value, name)
            if field is not None:
                out[name] = plain(field)
        return out
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value
