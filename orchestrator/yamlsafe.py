"""YAML read safely for job specs: one document that is a mapping, no duplicate keys (named
by their path), no alias bombs (the expanded size is counted before anything is built), no
nesting deeper than MAX_DEPTH, keys always names, env values always text, numbers, booleans
and dates that construct (whole numbers of at most MAX_INT_CHARS characters and MAX_INT),
files under MAX_SPEC_BYTES and UTF-8. Every refusal is a SpecError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import SpecError
from orchestrator.specparts import (
    MAX_DEPTH,
    MAX_EXPANDED_NODES,
    MAX_INT,
    MAX_INT_CHARS,
    MAX_SPEC_BYTES,
)

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_INT_TAG = "tag:yaml.org,2002:int"
_NUMBER_TAGS = (_INT_TAG, "tag:yaml.org,2002:float")
# Scalars whose construction fails with a bare Python error rather than a YAMLError (an
# explicit "!!int abc", "!!bool maybe", a date in month 13) or builds a whole number too long
# to print: built once in _check_tree, where their path is known, and named by what they are.
_CHECKED_SCALARS = {_INT_TAG: "whole number", "tag:yaml.org,2002:float": "number",
                    "tag:yaml.org,2002:bool": "boolean", "tag:yaml.org,2002:timestamp": "date"}
_SCALARS = yaml.constructor.SafeConstructor()


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting while composing: the composer recurses once per
    level, so 10 000 ``[`` would otherwise end in a RecursionError instead of an error."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _check_tree(node: yaml.Node, path: str, memo: dict[int, int], active: set[int]) -> int:
    """Walk the composed document before anything is built: refuse duplicate keys (naming
    their path) and self-referencing aliases, make every key a string, and count the values
    the document expands to, so an alias bomb is refused in microseconds; refuse a whole
    number too long to be any field's, and a scalar that does not construct, before anything
    is built (naming its path: past 4,300 digits int() raises a bare ValueError). Returns
    that count."""
    if id(node) in active:
        raise SpecError(path, "a YAML alias refers to a value that contains it")
    if id(node) in memo:  # an alias: already checked, and it costs its size again
        return memo[id(node)]
    active.add(id(node))
    size = 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise SpecError(path, f"line {key_node.start_mark.line + 1}: keys must be "
                                      "plain names")
            # Every key is a name (field or variable): without this YAML 1.1 turns ON, no
            # and 1 into bools and ints. Merge keys (<<) keep their meaning.
            if key_node.tag != _MERGE_TAG:
                key_node.tag = _STR_TAG
            key = key_node.value
            child = f"{path}.{key}" if path else key
            if key in seen:
                raise SpecError(child, f"duplicate key (line {key_node.start_mark.line + 1})")
            seen.add(key)
            # An env value is text: keep it as written, since 1.10 and 0x10 are not 1.1 and 16.
            if path == "env" and isinstance(value_node, yaml.ScalarNode) and \
                    value_node.tag in _NUMBER_TAGS:
                value_node.tag = _STR_TAG
            size += _check_tree(value_node, child, memo, active)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            size += _check_tree(item, f"{path}[{i}]", memo, active)
    elif isinstance(node, yaml.ScalarNode) and node.tag in _CHECKED_SCALARS:
        _check_scalar(node, path)
    active.discard(id(node))
    memo[id(node)] = size
    if size > MAX_EXPANDED_NODES:
        raise SpecError(path, f"the YAML expands to more than {MAX_EXPANDED_NODES} values "
                              "(alias bomb?)")
    return size


def _check_scalar(node: yaml.ScalarNode, path: str) -> None:
    """SpecError for a number, boolean or date that does not construct, or a whole number
    beyond MAX_INT (not echoed: thousands of digits help no one, and may not even print)."""
    line = node.start_mark.line + 1
    too_large = (f"a whole number larger than any field takes (line {line}; at most "
                 f"{MAX_INT:,}; quote it if it is text)")
    if node.tag == _INT_TAG and len(node.value) > MAX_INT_CHARS:
        raise SpecError(path, too_large)
    try:
        value = _SCALARS.yaml_constructors[node.tag](_SCALARS, node)
    except (ValueError, IndexError, KeyError, AttributeError, OverflowError):
        raise SpecError(path, f"not a valid {_CHECKED_SCALARS[node.tag]} (line {line})"
                        ) from None
    if type(value) is int and abs(value) > MAX_INT:
        raise SpecError(path, too_large)


def load_yaml(text: str, positions: dict[tuple[Any, ...], tuple[int, int]] | None = None
              ) -> dict[str, Any]:
    """One YAML document that is a mapping, or a SpecError. ``positions``, when given, is
    filled with where each field is written: its path (``("nodes", 1, "host")``) -> (line,
    column), counted from 1."""
    try:
        loader = _SpecLoader(text)  # refuses control characters already
    except yaml.YAMLError as exc:
        raise SpecError("", f"invalid YAML: {exc}") from None
    try:
        if not loader.check_node():
            raise SpecError("", "the spec is empty; expected a mapping of fields")
        root = loader.get_node()
        assert root is not None  # check_node() said there is one
        if loader.check_node():
            raise SpecError("", "several YAML documents; expected exactly one")
        _check_tree(root, "", {}, set())
        if positions is not None:
            _positions(root, (), positions, set())
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError("", f"invalid YAML: {where}{exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError("", f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if data is None:
        raise SpecError("", "the spec is empty; expected a mapping of fields")
    if not isinstance(data, dict):
        raise SpecError("", f"the spec must be a mapping of fields, not a {type(data).__name__}",
                        data, has_value=True)
    return data


def _positions(node: yaml.Node, path: tuple[Any, ...],
               out: dict[tuple[Any, ...], tuple[int, int]], seen: set[int]) -> None:
    """Where each key and list item under ``node`` starts (an alias is walked once)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                here = (*path, key.value)
                out.setdefault(here, (key.start_mark.line + 1, key.start_mark.column + 1))
                _positions(value, here, out, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.setdefault((*path, i), (item.start_mark.line + 1, item.start_mark.column + 1))
            _positions(item, (*path, i), out, seen)


def read_text(path: Path, field: str, what: str) -> str:
    """Read a small UTF-8 file; the size is checked before reading, and the read is capped
    in case the file grows or is not a regular file."""
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES:
            raise SpecError(field, f"{what} {path} is larger than {MAX_SPEC_BYTES} bytes ({size})")
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError(field, f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(field, f"{what} {path} is larger than {MAX_SPEC_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SpecError(field, f"{what} {path} is not UTF-8 (line {line}, byte {exc.start})"
                        ) from None
