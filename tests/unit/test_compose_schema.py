"""docker-compose.yml loads in Docker Compose v2 and in Debian's docker-compose 1.29.

Both validate the file, once its variables are interpolated, against a JSON schema: v2 the
Compose Specification's, 1.29.2 the compose_spec.json it ships (used for files without a
`version:` key), with Draft 4 rules as 1.29 runs them. Both schemas are vendored under
tests/schemas/ (sources in its README), so this runs offline.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from tests.compose_render import interpolated
from tests.support import ROOT

SCHEMAS = ROOT / "tests" / "schemas"
DOTENV = "SECRET_KEY=s\nHOSTING_ENCRYPTION_KEYS=k\nPOSTGRES_PASSWORD=p\nPOSTGRES_WORKER_PASSWORD=w\nREDIS_PASSWORD=r\n"


def errors(schema_file: str, config: dict, validator_class=None) -> list[str]:
    schema = json.loads((SCHEMAS / schema_file).read_text())
    cls = validator_class or jsonschema.Draft7Validator
    found = cls(schema).iter_errors(config)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


@pytest.mark.parametrize(
    ("schema_file", "validator_class"),
    [("compose-spec.json", None), ("compose-1.29.2.json", jsonschema.Draft4Validator)],
    ids=["compose-v2", "compose-1.29"],
)
def test_the_compose_file_validates(schema_file, validator_class):
    assert errors(schema_file, interpolated(DOTENV), validator_class) == []


def test_the_1_29_schema_refuses_what_it_cannot_load():
    """The check has teeth: a top-level `name:` (what 1.29 failed on) is refused."""
    config = {**interpolated(DOTENV), "name": "aap-hosting"}
    assert any("name" in e for e in errors("compose-1.29.2.json", config, jsonschema.Draft4Validator))


def test_no_top_level_name_and_the_project_name_comes_from_env():
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "name" not in raw and "version" not in raw
    example = (ROOT / ".env.example").read_text()
    assert re.search(r"^COMPOSE_PROJECT_NAME=aap-hosting$", example, re.M)
