"""MkDocs hooks: the reference pages are generated from the code at build time, and links to
the repository's own files (an example, a benchmark's table) work both here and on GitHub.

- ``<!-- generated: spec -->`` in a page becomes the table of every field of the job spec,
  read from ``jobspecs/jobspec.schema.json`` (``spec_reference``): nested sections too,
  following ``$ref``s into ``$defs``.
- ``<!-- generated: cli -->`` becomes every command of the ``orchestrator`` command with its
  arguments and options, read from the Typer app (``cli_reference``).
- ``<!-- generated: python-api -->`` becomes ``orchestrator.__all__`` with each name's
  signature and docstring (``python_api_reference``).

The generators are plain functions of their input, so a test calls them without MkDocs
(``tests/unit/test_docs.py``). A page links to a file outside ``docs/`` with the relative
path that works on GitHub (``../benchmarks/scale.md``); the build copies that file into the
site under ``_repo/`` and points the link there, so a link to a file that does not exist
still fails the build.
"""

from __future__ import annotations

import inspect
import json
import os
import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "jobspecs" / "jobspec.schema.json"
REPO_PREFIX = "_repo"
MARKERS = {
    "spec": "<!-- generated: spec -->",
    "cli": "<!-- generated: cli -->",
    "python-api": "<!-- generated: python-api -->",
}
# Commands whose options are parsed by the command itself (click sees none of them): their
# own usage text is the reference.
_OWN_USAGE = {"run": ("orchestrator.runargs", "USAGE")}
# Docstrings in the code cite pages as docs/<page>.md: a link on the generated pages (all in
# reference/, one level down).
_PAGE = re.compile(r"\bdocs/([\w/-]+\.md)")


# ---- the job spec, from its JSON Schema -------------------------------------------------


def _text(value: Any) -> str:
    """``value`` as one line of a Markdown table cell."""
    text = " ".join(str(value).split())
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = _PAGE.sub(r"[\1](../\1)", text)
    return text.replace("|", "\\|")


def _literal(value: Any) -> str:
    return "`" + json.dumps(value).replace("|", "\\|") + "`"


def _resolve(node: dict, defs: dict) -> tuple[dict, str | None]:
    """The schema ``node`` stands for, and the name of the definition it refers to."""
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        name = ref.rsplit("/", 1)[1]
        return defs[name], name
    return node, None


def _alternatives(node: dict, defs: dict) -> list[dict]:
    if "anyOf" in node or "oneOf" in node:
        found = []
        for option in node.get("anyOf", []) + node.get("oneOf", []):
            found.extend(_alternatives(option, defs))
        return found
    return [node]


def _constraints(node: dict) -> list[str]:
    found = []
    if "minimum" in node:
        found.append(f"≥ {node['minimum']}")
    if "exclusiveMinimum" in node:
        found.append(f"> {node['exclusiveMinimum']}")
    if "maximum" in node:
        found.append(f"≤ {node['maximum']}")
    if "exclusiveMaximum" in node:
        found.append(f"< {node['exclusiveMaximum']}")
    for key, words in (("minLength", "at least {} characters"),
                       ("maxLength", "at most {} characters"),
                       ("minItems", "at least {} items"), ("maxItems", "at most {} items")):
        if key in node:
            found.append(words.format(node[key]))
    if "pattern" in node:
        found.append(f"matches `{node['pattern']}`")
    return found


def _type(node: dict, defs: dict, anchor_of: dict[str, str]) -> tuple[str, list[str]]:
    """A field's type in words (a link where it is an object described below), and its
    constraints."""
    words: list[str] = []
    limits: list[str] = []
    for option in _alternatives(node, defs):
        option, name = _resolve(option, defs)
        if name is not None:
            words.append(f"[object]({anchor_of[name]})")
        elif "const" in option:
            words.append(_literal(option["const"]))
        elif "enum" in option:
            words.append(" \\| ".join(_literal(v) for v in option["enum"]))
        elif option.get("type") == "array":
            items, item_limits = _type(option.get("items", {}), defs, anchor_of)
            words.append(f"list of {items}")
            limits.extend(f"each item {limit}" for limit in item_limits)
        elif option.get("type") == "object" and isinstance(
                option.get("additionalProperties"), dict):
            values, _ = _type(option["additionalProperties"], defs, anchor_of)
            words.append(f"mapping of string to {values}")
        else:
            words.append(str(option.get("type", "any")))
        own = _constraints(option)
        if own and len(_alternatives(node, defs)) > 1:
            limits.append(f"{words[-1]}: {', '.join(own)}")
        else:
            limits.extend(own)
    return " or ".join(dict.fromkeys(words)), limits


def _default(name: str, node: dict, required: list[str], defs: dict) -> str:
    if name in required:
        return "required"
    if "default" not in node:
        return ""
    default = node["default"]
    nested = [_resolve(o, defs)[1] for o in _alternatives(node, defs)]
    if isinstance(default, dict) and any(nested):
        return "see below"
    return _literal(default)


def _sections(schema: dict) -> list[tuple[str, dict, str | None]]:
    """Every object of the spec, top level first: (its path in a spec, its schema, the
    definition's name), depth first in field order."""
    defs = schema.get("$defs", {})
    found: list[tuple[str, dict, str | None]] = [("", schema, None)]
    seen: set[str] = set()

    def walk(path: str, node: dict) -> None:
        for field, prop in sorted(node.get("properties", {}).items()):
            for option in _alternatives(prop, defs):
                if option.get("type") == "array":
                    option, suffix = option.get("items", {}), "[]"
                else:
                    suffix = ""
                target, name = _resolve(option, defs)
                if name is None or name in seen:
                    continue
                seen.add(name)
                child = f"{path}.{field}{suffix}" if path else f"{field}{suffix}"
                found.append((child, target, name))
                walk(child, target)

    walk("", schema)
    return found


def _anchor(path: str) -> str:
    return "field-" + (re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "top")


def spec_reference(schema: dict) -> str:
    """Markdown for every field of the job spec: type, default, constraints, description;
    one table for the top level and one for each nested object."""
    defs = schema.get("$defs", {})
    sections = _sections(schema)
    anchor_of = {name: f"#{_anchor(path)}" for path, _, name in sections if name}
    out: list[str] = []
    for path, node, name in sections:
        title = f"`{path}`" if path else "Top level"
        out.append(f"### {title} {{ #{_anchor(path)} }}\n")
        if node.get("description"):
            out.append(_text(node["description"]) + "\n")
        elif name:
            out.append(f"({name})\n")
        out.append("| field | type | default | constraints | description |")
        out.append("| --- | --- | --- | --- | --- |")
        required = node.get("required", [])
        for field, prop in sorted(node.get("properties", {}).items()):
            kind, limits = _type(prop, defs, anchor_of)
            out.append(" | ".join([
                f"| `{field}`", kind, _default(field, prop, required, defs),
                _text("; ".join(limits)), _text(prop.get("description", "")) + " |"]))
        if node.get("additionalProperties") is False:
            out.append("\nNo other field is accepted (a misspelled one is an error).")
        out.append("")
    return "\n".join(out)


def spec_fields(schema: dict) -> list[str]:
    """Every field's dotted path (``health.network_check.bytes``), for tests."""
    return [f"{path}.{field}" if path else field
            for path, node, _ in _sections(schema) for field in node.get("properties", {})]


# ---- the command line, from the Typer app ----------------------------------------------


def _commands(app: Any) -> list[tuple[str, Any, Any]]:
    """(command path, click command, its context) for the app and every command in it."""
    import typer

    root = typer.main.get_command(app)
    found = []

    def walk(command: Any, ctx: Any) -> None:
        found.append((ctx.command_path, command, ctx))
        children = getattr(command, "commands", {})
        for name, child in children.items():  # as the app declares them
            if not getattr(child, "hidden", False):
                walk(child, child.context_class(child, info_name=name, parent=ctx))

    walk(root, root.context_class(root, info_name="orchestrator"))
    return found


def command_names(app: Any) -> list[str]:
    """Every command's path (``orchestrator nodes release``), for tests."""
    return [path for path, _, _ in _commands(app)]


def _own_usage(name: str) -> str | None:
    if name not in _OWN_USAGE:
        return None
    module, attribute = _OWN_USAGE[name]
    return str(getattr(__import__(module, fromlist=[attribute]), attribute))


def cli_reference(app: Any) -> str:
    """Markdown for every command: what it does, its usage line, and a table of its
    arguments and options as ``--help`` shows them."""
    out: list[str] = []
    for path, command, ctx in _commands(app):
        out.append(f"### `{path}`\n")
        help_text = inspect.cleandoc(command.help or "")
        own = _own_usage(command.name or "")
        if own is not None:  # its first paragraph, then its own usage text
            out.append(help_text.split("\n\n")[0] + "\n")
            out.append("```\n" + own.rstrip() + "\n```\n")
            continue
        if help_text:
            out.append(help_text + "\n")
        usage = command.get_usage(ctx).strip()
        out.append("```\n" + usage.removeprefix("Usage: ") + "\n```\n")
        rows = []
        for param in command.get_params(ctx):
            if getattr(param, "hidden", False) or param.name == "help":
                continue
            record = param.get_help_record(ctx)
            if record is None:
                continue
            names, help_line = record
            kind = getattr(param, "param_type_name", "")
            rows.append(f"| `{names}` | {kind} | {_text(help_line)} |")
        if rows:
            out.append("| name | kind | meaning |")
            out.append("| --- | --- | --- |")
            out.extend(rows)
            out.append("")
    return "\n".join(out)


# ---- the Python API, from orchestrator.__all__ -----------------------------------------


class _Annotation:
    """An annotation kept as text (``from __future__ import annotations``), shown bare."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(function: Any) -> str:
    signature = inspect.signature(function)
    params = [p.replace(annotation=_Annotation(p.annotation))
              if isinstance(p.annotation, str) else p for p in signature.parameters.values()]
    returns = signature.return_annotation
    if isinstance(returns, str):
        returns = _Annotation(returns)
    return str(signature.replace(parameters=params, return_annotation=returns))


def python_api_reference(module: Any) -> str:
    """Markdown for each public name of ``module`` (its ``__all__``): signature and
    docstring, functions first, then classes."""
    names = list(module.__all__)
    functions = [n for n in names if inspect.isfunction(getattr(module, n))]
    others = [n for n in names if n not in functions]
    out: list[str] = []
    for title, group in (("Functions", functions), ("Classes and errors", others)):
        out.append(f"### {title}\n")
        for name in group:
            obj = getattr(module, name)
            signature = _signature(obj) if inspect.isfunction(obj) else ""
            out.append(f"#### `{name}`\n")
            if signature:
                out.append(f"```python\norchestrator.{name}{signature}\n```\n")
            doc = inspect.getdoc(obj) or ""
            if doc:
                out.append("```text\n" + doc + "\n```\n")
    return "\n".join(out)


# ---- links to the repository's files --------------------------------------------------

_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
_FENCE = re.compile(r"^(```|~~~)")


def _repo_path(link: str, page_uri: str) -> str | None:
    """The repository path a relative ``link`` on the page at ``page_uri`` points to, where
    it leaves the docs directory; None for any other link."""
    if "://" in link or link.startswith(("/", "mailto:")):
        return None
    target = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), link))
    return target[3:] if target.startswith("../") else None


def _outside_links(markdown: str, page_uri: str) -> list[str]:
    """The repository paths of the links in ``markdown`` (outside code blocks) that leave
    the docs directory from the page at ``page_uri``."""
    found = []
    for code, text in _code_split(markdown):
        if not code:
            for match in _LINK.finditer(text):
                repo_path = _repo_path(match.group(2), page_uri)
                if repo_path is not None:
                    found.append(repo_path)
    return found


def _code_split(markdown: str) -> list[tuple[bool, str]]:
    """``markdown`` in pieces, each marked True where it is inside a fenced code block."""
    pieces: list[tuple[bool, str]] = []
    current: list[str] = []
    inside = False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line.lstrip()):
            if not inside:
                pieces.append((False, "".join(current)))
                current = [line]
                inside = True
            else:
                current.append(line)
                pieces.append((True, "".join(current)))
                current = []
                inside = False
            continue
        current.append(line)
    pieces.append((inside, "".join(current)))
    return pieces


def _rewrite_outside_links(markdown: str, page_uri: str) -> str:
    def fix(match: re.Match[str]) -> str:
        repo_path = _repo_path(match.group(2), page_uri)
        if repo_path is None:
            return match.group(0)
        new = posixpath.relpath(f"{REPO_PREFIX}/{repo_path}", posixpath.dirname(page_uri) or ".")
        return match.group(1) + new + match.group(3)

    return "".join(text if code else _LINK.sub(fix, text)
                   for code, text in _code_split(markdown))


# ---- MkDocs events ---------------------------------------------------------------------


def on_config(config: Any) -> Any:
    # `mkdocs serve` rebuilds when what the reference is generated from changes.
    for path in (SCHEMA, ROOT / "orchestrator" / "cli.py", ROOT / "orchestrator" / "runargs.py",
                 ROOT / "orchestrator" / "__init__.py"):
        if str(path) not in config.watch:
            config.watch.append(str(path))
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File, InclusionLevel

    wanted: set[str] = set()
    for page in files.documentation_pages():
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        wanted.update(_outside_links(text, page.src_uri))
    for repo_path in sorted(wanted):
        source = ROOT / repo_path
        if not source.is_file() or ROOT not in source.resolve().parents:
            continue  # left to MkDocs: a link to nothing fails the build
        files.append(File.generated(config, f"{REPO_PREFIX}/{repo_path}",
                                    abs_src_path=os.fspath(source),
                                    inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKERS["spec"] in markdown:
        schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
        markdown = markdown.replace(MARKERS["spec"], spec_reference(schema))
    if MARKERS["cli"] in markdown:
        from orchestrator.cli import app

        markdown = markdown.replace(MARKERS["cli"], cli_reference(app))
    if MARKERS["python-api"] in markdown:
        import orchestrator

        markdown = markdown.replace(MARKERS["python-api"], python_api_reference(orchestrator))
    return _rewrite_outside_links(markdown, page.file.src_uri)
