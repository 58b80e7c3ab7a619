"""`manage.py api_docs [--check]`: the django-ninja OpenAPI schema as Markdown (docs/api.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils.module_loading import import_string

Schema = dict[str, Any]

GENERATED_BY = (
    "<!-- Generated from the OpenAPI schema by `python manage.py api_docs` (make docs). "
    "Do not edit by hand: tests/system/test_api_docs.py fails when it is stale. -->"
)
HTTP_METHODS = ("get", "post", "put", "patch", "delete")
REASONS = {
    "200": "OK",
    "201": "Created",
    "202": "Accepted",
    "204": "No Content",
    "400": "Bad Request",
    "401": "Unauthorized",
    "403": "Forbidden",
    "404": "Not Found",
    "409": "Conflict",
    "413": "Content Too Large",
    "422": "Unprocessable Content",
}
# What the schema cannot say about each security scheme, keyed by scheme name.
AUTH_NOTES = {
    "TokenAuth": (
        "`Authorization: Bearer <token>`; a user's token comes from "
        "`python manage.py api_token USERNAME`. No CSRF token needed."
    ),
    "SessionAuth": (
        "the Django session cookie (`sessionid`) after signing in at `/accounts/login/`; "
        "writes (POST) also need the `X-CSRFToken` header from the `csrftoken` cookie."
    ),
}
# JSON Schema validation keywords, as sentences for a field's description.
CONSTRAINTS = {
    "minLength": "At least {} characters.",
    "maxLength": "At most {} characters.",
    "minimum": "At least {}.",
    "maximum": "At most {}.",
    "minItems": "At least {} items.",
    "maxItems": "At most {} items.",
    "maxProperties": "At most {} keys.",
    "pattern": "Matches `{}`.",
}


class Command(BaseCommand):
    help = "Write docs/api.md from the API's OpenAPI schema, or --check that it is current."
    # Reading the schema needs no database or Redis; their checks would only add noise.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--api", default="config.api.api", help="Dotted path of the NinjaAPI instance."
        )
        parser.add_argument(
            "--output", default=str(Path(settings.BASE_DIR) / "docs" / "api.md"), type=Path
        )
        parser.add_argument(
            "--check", action="store_true", help="Exit 1 if the file differs; write nothing."
        )

    def handle(self, *args: Any, api: str, output: Path, check: bool, **options: Any) -> None:
        text = render_api_docs(import_string(api).get_openapi_schema())
        if check:
            if not output.exists() or output.read_text() != text:
                raise CommandError(f"{output} is stale: run `python manage.py api_docs`.")
            self.stdout.write(f"{output} is current.")
            return
        output.write_text(text)
        self.stdout.write(f"Wrote {output}.")


def render_api_docs(schema: Schema) -> str:
    """The whole Markdown page for an OpenAPI 3 schema: auth, endpoints by tag, schemas."""
    info = schema.get("info", {})
    operations = list(_operations(schema))
    lines = [
        f"# {info.get('title', 'API')}",
        "",
        GENERATED_BY,
        "",
        f"Version {info.get('version', '?')}. The live schema is served at `/api/openapi.json` "
        "and an interactive explorer at `/api/docs`.",
    ]
    if info.get("description"):
        lines += ["", info["description"].strip()]
    lines += ["", *_authentication(schema)]
    lines += ["", "## Endpoints", "", "| method | path | summary |", "| --- | --- | --- |"]
    lines += [
        f"| {method.upper()} | [`{path}`](#{_slug(_heading(method, path))}) "
        f"| {_cell(op.get('summary', ''))} |"
        for method, path, op in operations
    ]
    for tag in dict.fromkeys(_tag(op) for _, _, op in operations):
        lines += ["", f"## {tag}"]
        for method, path, op in operations:
            if _tag(op) == tag:
                lines += ["", *_operation(method, path, op, schema)]
    components = schema.get("components", {}).get("schemas", {})
    if components:
        lines += ["", "## Schemas"]
        for name in sorted(components):
            lines += ["", f"### {name}", "", *_object(components[name])]
    return "\n".join(lines).rstrip() + "\n"


def _operations(schema: Schema) -> list[tuple[str, str, Schema]]:
    return [
        (method, path, op)
        for path, item in schema.get("paths", {}).items()
        for method, op in item.items()
        if method in HTTP_METHODS
    ]


def _tag(op: Schema) -> str:
    return str((op.get("tags") or ["other"])[0])


def _heading(method: str, path: str) -> str:
    return f"{method.upper()} {path}"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def _authentication(schema: Schema) -> list[str]:
    schemes = schema.get("components", {}).get("securitySchemes", {})
    if not schemes:
        return ["## Authentication", "", "None."]
    lines = ["## Authentication", "", "An endpoint that lists several schemes accepts any one."]
    lines.append("")
    for name, scheme in schemes.items():
        kind = (
            f"HTTP {scheme.get('scheme', '')}"
            if scheme.get("type") == "http"
            else f"API key in {scheme.get('in', '?')} `{scheme.get('name', '?')}`"
        )
        note = AUTH_NOTES.get(name, scheme.get("description", ""))
        lines.append(f"- **{name}** ({kind})" + (f": {note}" if note else ""))
    return lines


def _operation(method: str, path: str, op: Schema, schema: Schema) -> list[str]:
    lines = [f"### {_heading(method, path)}"]
    if op.get("summary"):
        lines += ["", f"**{op['summary']}**"]
    if op.get("description"):
        lines += ["", _paragraphs(op["description"])]
    lines += ["", f"Auth: {_security(op, schema)}"]
    if op.get("parameters"):
        lines += [
            "",
            "Parameters:",
            "",
            "| name | in | type | required | description |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| `{p['name']}` | {p.get('in', '')} | {_type(p.get('schema', {}))} "
            f"| {'yes' if p.get('required') else 'no'} "
            f"| {_cell(p.get('description') or p.get('schema', {}).get('description', ''))} |"
            for p in op["parameters"]
        ]
    body = op.get("requestBody")
    if body:
        for media_type, content in body.get("content", {}).items():
            body_schema = content.get("schema", {})
            required = "required" if body.get("required") else "optional"
            if "$ref" in body_schema:
                lines += ["", f"Request body ({required}, `{media_type}`): {_type(body_schema)}"]
            else:
                lines += ["", f"Request body ({required}, `{media_type}`):", ""]
                lines += _object(body_schema)
    lines += ["", "Responses:", "", "| status | content | body |", "| --- | --- | --- |"]
    for status, response in _responses(op).items():
        reason = REASONS.get(status, "")
        description = response.get("description", "")
        label = f"{status} {description if description not in ('', reason) else reason}"
        contents = response.get("content") or {"": {}}
        for media_type, content in contents.items():
            body_type = _type(content["schema"]) if content.get("schema") else ""
            lines.append(
                f"| {_cell(label.strip())} | {f'`{media_type}`' if media_type else ''} "
                f"| {body_type} |"
            )
    return lines


def _responses(op: Schema) -> dict[str, Schema]:
    # ninja keys declared responses by int and openapi_extra ones by str; the str entry is
    # the endpoint's own override of the same status, so it wins.
    merged: dict[str, Schema] = {}
    for status, response in op.get("responses", {}).items():
        if isinstance(status, int) and str(status) in op["responses"]:
            continue
        merged[str(status)] = response
    return dict(sorted(merged.items()))


def _security(op: Schema, schema: Schema) -> str:
    requirements: list[dict[str, list[str]]] = op.get("security", schema.get("security")) or []
    names = [name for requirement in requirements for name in requirement]
    return " or ".join(names) if names else "none"


def _object(schema: Schema) -> list[str]:
    """A table of an object schema's fields (or one line for anything else)."""
    lines = []
    if schema.get("description"):
        lines += [_paragraphs(schema["description"]), ""]
    properties = schema.get("properties")
    if not properties:
        return [*lines, f"Type: {_type(schema)}"]
    required = set(schema.get("required", []))
    lines += ["| field | type | required | description |", "| --- | --- | --- | --- |"]
    for name, field in properties.items():
        notes = [_sentence(field.get("description", "")), *_constraints(field)]
        lines.append(
            f"| `{name}` | {_type(field)} | {'yes' if name in required else 'no'} "
            f"| {_cell(' '.join(n for n in notes if n))} |"
        )
    if schema.get("additionalProperties") is False:
        lines += ["", "Other fields are refused."]
    return lines


def _constraints(field: Schema) -> list[str]:
    found = {key: field[key] for key in CONSTRAINTS if key in field}
    for option in field.get("anyOf", []):
        found.update({key: option[key] for key in CONSTRAINTS if key in option})
    notes = [
        "Not empty." if (key, value) == ("minLength", 1) else CONSTRAINTS[key].format(value)
        for key, value in found.items()
    ]
    if "default" in field:
        notes.append(f"Default `{json.dumps(field['default'])}`.")
    notes += [f"Example: `{json.dumps(example)}`." for example in field.get("examples", [])]
    return notes


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text if not text or text.endswith((".", "!", "?")) else text + "."


def _type(schema: Schema) -> str:
    """A short Markdown type: `string (date-time) or null`, `array of [Job](#job)`..."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_slug(name)})"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return " or ".join(_type(option) for option in schema[combinator])
    if "allOf" in schema:
        return " and ".join(_type(option) for option in schema["allOf"])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {_grouped(_type(schema.get('items', {})))}"
    if kind == "object":
        values = schema.get("additionalProperties")
        return f"object of {_grouped(_type(values))}" if isinstance(values, dict) else "object"
    if kind is None:
        return "any"
    return f"{kind} ({schema['format']})" if "format" in schema else str(kind)


def _grouped(type_text: str) -> str:
    """`(a or b)` inside `array of ...`, so the reader sees what the array holds."""
    return f"({type_text})" if " or " in type_text or " and " in type_text else type_text


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _paragraphs(text: str) -> str:
    """A docstring's paragraphs with their hard line breaks unwrapped."""
    return "\n\n".join(" ".join(p.split()) for p in text.strip().split("\n\n"))
