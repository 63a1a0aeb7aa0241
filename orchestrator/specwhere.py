"""Where each of a spec's problems is: its line and column in the file, or the ``--set`` that
wrote it; and a missing field's likely misspelling nearby. A spec with a misspelt
``comand:`` and ``max_restarts: two`` says, at once::

    error: comand: unknown field; did you mean 'command'? (line 3, column 1)
    error: command: required field is missing; is 'comand' (line 3) a misspelling of it?
    error: max_restarts: must be a whole number (...) (got 'two') (line 4, column 15)

Pure: it takes the problems (orchestrator/spec.py), where the YAML put each field
(orchestrator/yamlsafe.py) and the paths each ``--set`` wrote.
"""

from __future__ import annotations

import difflib
from typing import Any

from orchestrator.errors import SpecError

Positions = dict[tuple[Any, ...], tuple[int, int]]


def located(error: SpecError, positions: Positions, set_by: dict[tuple[Any, ...], str]
            ) -> SpecError:
    """``error`` and its other ``problems``, each told where it is (``where``, which the CLI
    shows after the message); the first holds all."""
    unknown = [p.loc for p in error.problems if p.kind == "extra_forbidden" and p.loc]
    out = []
    for problem in error.problems:
        message = problem.message
        if problem.kind == "missing" and problem.loc:
            parent, name = problem.loc[:-1], str(problem.loc[-1])
            near = difflib.get_close_matches(
                name, [str(loc[-1]) for loc in unknown if loc[:-1] == parent], n=1)
            if near:
                line = positions.get((*parent, near[0]))
                message += (f"; is {near[0]!r}" + (f" (line {line[0]})" if line else "") +
                            " a misspelling of it?")
        told = SpecError(problem.field, message, problem.value, has_value=problem.has_value)
        told.loc, told.kind = problem.loc, problem.kind
        told.where = _where(problem.loc, positions, set_by)
        out.append(told)
    out[0].problems = out
    return out[0]


def path_text(loc: tuple[Any, ...]) -> str:
    """``("nodes", 1, "host")`` as ``nodes[1].host``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part:
            text += ("." if text else "") + str(part)
    return text


def value_at(data: Any, loc: tuple[Any, ...]) -> tuple[bool, Any]:
    """(found, the value) at ``loc`` in the parsed document."""
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


def _where(loc: tuple[Any, ...], positions: Positions, set_by: dict[tuple[Any, ...], str]
           ) -> str:
    """`` (from --set X=Y)`` where a --set wrote the field or a section above it, else
    `` (line L, column C)`` of the field, or of the nearest section above it that the file
    has (a missing field is in none); "" where nothing is known."""
    for depth in range(len(loc), 0, -1):
        if loc[:depth] in set_by:
            return f" (from --set {set_by[loc[:depth]]})"
    if loc in positions:
        line, column = positions[loc]
        return f" (line {line}, column {column})"
    for depth in range(len(loc) - 1, 0, -1):
        if loc[:depth] in positions:
            return f" (in the section at line {positions[loc[:depth]][0]})"
    return ""
