"""docs/api.md matches the API it documents (regenerate with `make docs`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from config.api import api
from tests.conftest import ROOT
from web.management.commands.api_docs import render_api_docs


def test_docs_api_md_is_current() -> None:
    written = (ROOT / "docs" / "api.md").read_text()

    assert written == render_api_docs(api.get_openapi_schema()), (
        "docs/api.md is stale: run `make docs` and commit it"
    )


def test_every_endpoint_is_documented() -> None:
    written = (ROOT / "docs" / "api.md").read_text()

    for path, item in api.get_openapi_schema()["paths"].items():
        for method in item:
            assert f"### {method.upper()} {path}\n" in written


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path: Path) -> None:
    output = tmp_path / "api.md"
    output.write_text("# old\n")

    with pytest.raises(CommandError, match="stale"):
        call_command("api_docs", "--check", output=output)
    call_command("api_docs", output=output)
    call_command("api_docs", "--check", output=output)


def test_renders_types_auth_parameters_and_bodies() -> None:
    # given: a small schema with the shapes the renderer must spell out
    schema = {
        "openapi": "3.1.0",
        "info": {"title": "Demo", "version": "2"},
        "paths": {
            "/api/things/{thing_id}/": {
                "post": {
                    "summary": "Thing Update",
                    "description": "Change a thing.\n\nSecond\nparagraph.",
                    "tags": ["things"],
                    "security": [{"TokenAuth": []}],
                    "parameters": [
                        {
                            "in": "path",
                            "name": "thing_id",
                            "required": True,
                            "schema": {"type": "integer"},
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ThingIn"}}
                        },
                    },
                    "responses": {
                        200: {"description": "OK"},
                        "200": {"description": "The thing", "content": {"application/pdf": {}}},
                        404: {"description": "Not Found"},
                    },
                }
            }
        },
        "components": {
            "schemas": {
                "ThingIn": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 10,
                            "description": "A | name",
                        },
                        "when": {
                            "anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]
                        },
                        "kind": {"enum": ["a", "b"], "type": "string"},
                        "tags": {
                            "type": "array",
                            "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                        },
                    },
                }
            },
            "securitySchemes": {"TokenAuth": {"type": "http", "scheme": "bearer"}},
        },
    }

    # when
    text = render_api_docs(schema)

    # then
    assert "| POST | [`/api/things/{thing_id}/`](#post-apithingsthing_id) | Thing Update |" in text
    assert "### POST /api/things/{thing_id}/\n\n**Thing Update**" in text
    assert "Change a thing.\n\nSecond paragraph." in text
    assert "Auth: TokenAuth\n" in text
    assert "| `thing_id` | path | integer | yes |  |" in text
    assert "Request body (required, `application/json`): [ThingIn](#thingin)" in text
    assert "| 200 The thing | `application/pdf` |  |" in text
    assert "| 200 OK" not in text  # the str-keyed override replaces ninja's int-keyed entry
    assert "| 404 Not Found |  |  |" in text
    assert "| `name` | string | yes | A \\| name. Not empty. At most 10 characters. |" in text
    assert "| `when` | string (date-time) or null | no |  |" in text
    assert '| `kind` | `"a"` \\| `"b"` | no |  |' in text
    assert "| `tags` | array of (string or integer) | no |  |" in text
