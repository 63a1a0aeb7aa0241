"""Regenerate ``jobspecs/jobspec.schema.json`` from the JobSpec model (a unit test checks
that the committed file is current)::

    python -m orchestrator._schema
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.spec import JobSpec

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "jobspecs" / "jobspec.schema.json"


def schema_text() -> str:
    """The JSON Schema of a job spec, as the committed file holds it."""
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "orchestrator job spec"
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(schema_text())
    print(f"wrote {SCHEMA_PATH}")
