"""The documentation (README.md, docs/, mkdocs.yml) against the code and itself, without
MkDocs: the generated references name everything they are generated from, links from the
README lead somewhere, every page is in the site's nav, and no page cites this project's
own issues (a reader has no access to them). `mkdocs build --strict` (CI) checks the rest:
links and anchors between pages.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
USER_DOCS = [ROOT / "README.md", *PAGES]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


# ---- no references to this project's issues --------------------------------------------

# "issue 12", "issues #3 and #4", "PR 7", "pull request #9", and a bare "#12" in prose;
# another project's "owner/repo#123" (and its URL) is a citation a reader can follow.
_OWN_ISSUE = re.compile(
    r"\b(?:issues?|pull requests?)\s*(?:no\.?\s*)?#?\d+"
    r"|\bPRs?\s*#?\d+"
    r"|(?<![\w/.#-])#\d+\b",
    re.IGNORECASE)


def _prose(markdown: str) -> str:
    """``markdown`` without fenced code blocks and inline code: examples of output (a
    quarantine's ``(#1)``) are not citations."""
    kept, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def own_issue_references(markdown: str) -> list[str]:
    return [m.group(0) for m in _OWN_ISSUE.finditer(_prose(markdown))]


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_documentation_cites_no_issue_of_this_project(path):
    assert own_issue_references(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("text, found", [
    ("fixed in issue 12.", ["issue 12"]),
    ("see issues #3", ["issues #3"]),
    ("as PR 7 did", ["PR 7"]),
    ("(#42) made it faster", ["#42"]),
    ("torch's own bug (pytorch/pytorch#190489)", []),
    ("[pytorch/pytorch#1](https://github.com/pytorch/pytorch/issues/1)", []),
    ("QUARANTINED until then `(#1)`", []),
    ("```\nHOST  QUARANTINED (#1)\n```", []),
    ("a known torch 2.13 issue, not ours", []),
    ("[the field](#field-health)", []),
])
def test_the_issue_pattern(text, found):
    assert own_issue_references(text) == found


# ---- the generated references name everything -----------------------------------------


def _schema_objects(schema: dict) -> dict[str, dict]:
    """Every object of the spec by its path (top level: ""), following $refs, found here
    independently of the generator."""
    defs = schema.get("$defs", {})
    found: dict[str, dict] = {}

    def options(node: dict) -> list[dict]:
        if "anyOf" in node:
            return [o for option in node["anyOf"] for o in options(option)]
        return [node]

    def walk(path: str, node: dict) -> None:
        found[path] = node
        for field, prop in node.get("properties", {}).items():
            for option in options(prop):
                suffix = ""
                if option.get("type") == "array":
                    option, suffix = option.get("items", {}), "[]"
                if "$ref" in option:
                    target = defs[option["$ref"].rsplit("/", 1)[1]]
                    child = f"{path}.{field}{suffix}" if path else f"{field}{suffix}"
                    if child not in found:
                        walk(child, target)

    walk("", schema)
    return found


def _sections(markdown: str) -> dict[str, str]:
    """The generated text by heading (``### `health` {#...}`` -> "health")."""
    parts = re.split(r"^### (.+)$", markdown, flags=re.M)
    sections = {}
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        name = re.sub(r"\s*\{[^}]*\}\s*$", "", heading).strip().strip("`")
        sections["" if name == "Top level" else name] = body
    return sections


def test_the_spec_reference_names_every_field_of_the_schema():
    schema = json.loads((ROOT / "jobspecs" / "jobspec.schema.json").read_text())
    sections = _sections(hooks.spec_reference(schema))
    objects = _schema_objects(schema)
    assert {"", "health", "health.network_check", "nodes[]", "slurm", "restart_policy"} \
        <= set(objects)
    missing = []
    for path, node in objects.items():
        if path not in sections:
            missing.append(f"section {path!r}")
            continue
        for field, prop in node.get("properties", {}).items():
            if f"| `{field}` |" not in sections[path]:
                missing.append(f"{path}.{field}" if path else field)
                continue
            description = prop.get("description")
            if description:
                first = " ".join(description.split())[:30].replace("|", "\\|")
                if first not in sections[path]:
                    missing.append(f"the description of {path}.{field}")
    assert missing == []
    assert set(hooks.spec_fields(schema)) >= {"command", "health.node_timeout",
                                              "nodes[].host", "sync.path"}


def test_the_spec_reference_gives_types_defaults_and_constraints():
    schema = json.loads((ROOT / "jobspecs" / "jobspec.schema.json").read_text())
    sections = _sections(hooks.spec_reference(schema))
    row = next(line for line in sections["health"].splitlines()
               if line.startswith("| `node_timeout` |"))
    assert "number" in row and "`30.0`" in row and "≥ 0.01" in row
    row = next(line for line in sections[""].splitlines() if line.startswith("| `command` |"))
    assert "required" in row
    row = next(line for line in sections["rendezvous"].splitlines()
               if line.startswith("| `backend` |"))
    assert '`"static"` \\| `"c10d"`' in row


def test_the_cli_reference_names_every_command_and_option():
    import typer

    from orchestrator.cli import app

    text = hooks.cli_reference(app)
    sections = _sections(text)
    root = typer.main.get_command(app)
    expected: dict[str, list[str]] = {}

    def walk(path: str, command) -> None:
        expected[path] = [opt for param in command.params if param.name != "help"
                          for opt in param.opts if opt.startswith("-")]
        for name, child in getattr(command, "commands", {}).items():
            walk(f"{path} {name}", child)

    walk("orchestrator", root)
    assert {"orchestrator submit", "orchestrator run", "orchestrator nodes release"} \
        <= set(expected)
    assert set(hooks.command_names(app)) == set(expected)
    missing = [path for path in expected if path not in sections]
    missing += [f"{path} {opt}" for path, opts in expected.items() if path in sections
                for opt in opts if opt not in sections[path]]
    assert missing == []
    # `run` parses its own (torchrun's) options: its reference is its own usage text.
    from orchestrator import runargs

    assert runargs.USAGE.splitlines()[0] in sections["orchestrator run"]


def test_the_python_api_reference_names_every_public_name():
    import orchestrator

    text = hooks.python_api_reference(orchestrator)
    assert [name for name in orchestrator.__all__ if f"#### `{name}`" not in text] == []


@pytest.mark.parametrize("page, marker", [
    ("reference/spec.md", "spec"), ("reference/cli.md", "cli"),
    ("reference/python-api.md", "python-api")])
def test_the_reference_pages_keep_their_markers(page, marker):
    assert hooks.MARKERS[marker] in (DOCS / page).read_text(encoding="utf-8")


# ---- links and the site's nav ---------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(markdown: str) -> list[str]:
    return [link for link in _LINK.findall(_prose(markdown))
            if not re.match(r"[a-z][a-z0-9+.-]*:", link) and not link.startswith("#")]


def broken_links(path: Path) -> list[str]:
    return [link for link in relative_links(path.read_text(encoding="utf-8"))
            if not (path.parent / link.split("#", 1)[0]).exists()]


def test_every_relative_link_in_the_readme_leads_to_a_file():
    readme = ROOT / "README.md"
    assert relative_links(readme.read_text()), "the README links to the documentation"
    assert broken_links(readme) == []


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](docs/nowhere.md#x) `[code](nowhere.md)` "
                    "[web](https://example.org/x.md) [here](#top)\n")
    assert broken_links(page) == ["docs/nowhere.md#x"]


def _nav_pages(nav) -> list[str]:
    found: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = [str(p.relative_to(DOCS)) for p in PAGES]
    assert sorted(nav) == sorted(pages)
    assert config["theme"]["name"] == "material" and config["strict"] is True
    assert "docs/hooks.py" in config["hooks"]


# ---- the README's commands are the ones the tests and CI run ---------------------------


def _code_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.M | re.S)


def test_the_readme_first_command_is_the_fresh_venv_tests():
    # tests/integration/test_fresh_venv.py runs exactly this, in a new venv.
    first = _code_blocks((ROOT / "README.md").read_text())[0].strip()
    assert first == ("pip install torch==2.13.0 && pip install -e . && "
                     "orchestrator submit jobspecs/local-ddp.yaml --follow")


def test_the_readme_test_command_is_what_ci_runs_last():
    last_block = _code_blocks((ROOT / "README.md").read_text())[-1].strip()
    ci_last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_last == "python3 -m pytest -q -ra"
    assert last_block.endswith(ci_last)
