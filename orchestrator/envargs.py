"""Environment variables given to ``submit`` on its command line, without putting a secret
there: a command line is readable by every local user (``ps``, ``/proc/<pid>/cmdline``) for
as long as the process runs, and stays in shell history.

- ``--env KEY``: the value of KEY in the submitting environment;
- ``--env KEY=VALUE``: the value as written, refused for a name that looks secret (see
  ``specparts.looks_secret``, or listed in the spec's ``secret_env``); so is any ``--set``
  that writes such a variable: ``env.KEY=VALUE``, or the whole of ``env`` (``env={KEY: V}``,
  a block mapping, a merge key);
- ``--env-file FILE``: ``KEY=VALUE`` lines (``#`` comments, blank lines and an ``export``
  prefix allowed; one pair of matching quotes around a value is removed).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from orchestrator.errors import SpecError
from orchestrator.spec import JobSpec, parse_override
from orchestrator.specparts import looks_secret
from orchestrator.yamlsafe import read_text

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse(items: list[str], files: list[str], environ: Mapping[str, str]
          ) -> tuple[dict[str, str], set[str]]:
    """(the variables to add, in order: files first, then ``--env``; the names whose value
    was written on the command line)."""
    env: dict[str, str] = {}
    for path in files:
        env.update(read_file(Path(path)))
    written = set()
    for item in items:
        key, sep, value = item.partition("=")
        if not _NAME.match(key):
            raise SpecError("--env", f"expects KEY or KEY=VALUE, got {item.split('=')[0]!r}")
        if sep:
            env[key] = value
            written.add(key)
        elif key in environ:
            env[key] = environ[key]
        else:
            raise SpecError("--env", f"{key} is not set in this environment (--env {key} "
                                     "passes its value from here)")
    return env, written


def read_file(path: Path) -> dict[str, str]:
    """The variables of an env file (see above); SpecError naming the line."""
    env = {}
    text = read_text(path, "--env-file", "env file")
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _NAME.match(key):
            raise SpecError("--env-file", f"{path} line {number}: expected KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def refuse_webhook_sets(overrides: list[str]) -> None:
    """SpecError for ``--set notify...``: a webhook URL is a secret (it often holds a token),
    and a command line is readable by every local user. Checked before the spec is read."""
    for item in overrides:
        path = item.partition("=")[0].strip()
        if path == "notify" or path.startswith(("notify.", "notify[")):
            raise SpecError("--set", f"{path}: a webhook URL is a secret (it often holds a "
                                     "token) and the command line is readable by every local "
                                     "user (ps): write notify: in the spec file")


def set_env_names(overrides: list[str]) -> set[str]:
    """The env names whose values these ``--set`` items write: ``env.KEY=...``, and every
    key of a mapping given to ``env`` itself (read as the spec reads it, so flow and block
    mappings, aliases and merge keys all count). Even one a later ``--set`` replaces was on
    the command line."""
    names: set[str] = set()
    for item in overrides:
        try:
            _, steps, value = parse_override(item)
        except SpecError:
            continue  # not an override at all: loading the spec says so
        if steps[0] != "env":
            continue
        if len(steps) > 1:
            names.add(str(steps[1]))
        elif isinstance(value, dict):
            names.update(str(key) for key in value)
    return names


def refuse_written_secrets(spec: JobSpec, written: set[str], overrides: list[str]) -> None:
    """SpecError for a secret-looking variable whose value was written on the command line
    (``--env KEY=VALUE``, or a ``--set`` that puts it into env: see set_env_names)."""
    written = written | set_env_names(overrides)
    for key in sorted(written):
        if looks_secret(key) or key in spec.secret_env:
            raise SpecError("--env", f"{key}'s value is on the command line, where every "
                                     f"local user can read it (ps): pass --env {key} to take it "
                                     "from your environment, or --env-file FILE")


def file_is_private(path: str) -> bool:
    """Whether only its owner can read an env file (a warning otherwise)."""
    try:
        return not os.stat(path).st_mode & 0o077
    except OSError:
        return True  # read_file says what is wrong with it
