"""The OpenAPI descriptions the routes cannot give themselves (their bodies are parsed by hand).

``install_openapi(app, names)`` adds the request bodies and error responses of the inference
routes, the two error schemas and the served model names (as each ``name`` parameter's enum).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from gpu_worker.model import DATATYPES

from . import kserve

JSON = "application/json"

TIMEOUT_PARAMETER = {
    "name": "X-Request-Timeout",
    "in": "header",
    "required": False,
    "description": "Seconds to wait for the result (capped by the gateway's max_timeout).",
    "schema": {"type": "number", "exclusiveMinimum": 0},
}

PRIORITY_PARAMETER = {
    "name": "X-Priority",
    "in": "header",
    "required": False,
    "description": "The request's priority: high or normal (the default); also 1 or 0. "
    "On v2, a 'priority' entry of the body's parameters wins over the header.",
    "schema": {"type": "string", "enum": ["high", "normal", "1", "0"]},
}

ERROR_CODES = (
    (400, "Malformed request"),
    (401, "Missing or wrong bearer token"),
    (404, "Unknown model"),
    (413, "Body or item count too large"),
    (422, "Input does not fit the model's declared inputs"),
    (500, "The model raised (ModelError)"),
    (503, "Queue full or Redis unavailable (Retry-After)"),
    (504, "Deadline exceeded"),
)

ERROR_SCHEMAS: dict[str, Any] = {
    "V2Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}, "type": {"type": "string"}},
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            }
        },
    },
}

ANY_ARRAY = {"type": "array", "items": {}}


def _errors_as(schema: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {
        str(code): {"description": text, "content": {JSON: {"schema": ref}}}
        for code, text in ERROR_CODES
    }


def _object(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


V1_INPUTS = {**ANY_ARRAY, "description": "One entry per item: the model's raw input."}
V1_FILE = {
    "type": "string",
    "format": "binary",
    "description": "One item per file field (models that take bytes).",
}
V1_PREDICT: dict[str, Any] = {
    "parameters": [TIMEOUT_PARAMETER, PRIORITY_PARAMETER],
    "requestBody": {
        "required": True,
        "content": {
            JSON: {"schema": _object(["inputs"], {"inputs": V1_INPUTS})},
            "multipart/form-data": {"schema": _object(["file"], {"file": V1_FILE})},
        },
    },
    "responses": {
        "200": {
            "description": "One output per item, in order",
            "content": {JSON: {"schema": {"type": "object", "properties": {"outputs": ANY_ARRAY}}}},
        },
        **_errors_as("Error"),
    },
}

TENSOR = _object(
    ["name", "shape", "datatype"],
    {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": sorted(DATATYPES)},
        "parameters": {"type": "object"},
        "data": ANY_ARRAY,
    },
)
REQUESTED_OUTPUT = _object(["name"], {"name": {"type": "string"}, "parameters": {"type": "object"}})
V2_INFER: dict[str, Any] = {
    "parameters": [TIMEOUT_PARAMETER, PRIORITY_PARAMETER],
    "requestBody": {
        "required": True,
        "content": {
            JSON: {
                "schema": _object(
                    ["inputs"],
                    {
                        "id": {"type": "string"},
                        "parameters": {"type": "object"},
                        "inputs": {"type": "array", "items": TENSOR},
                        "outputs": {"type": "array", "items": REQUESTED_OUTPUT},
                    },
                )
            }
        },
    },
    "responses": {"200": {"description": "Output tensors"}, **_errors_as("V2Error")},
}


def _name_enums(schema: dict[str, Any], names: list[str]) -> None:
    """Each ``name`` path parameter takes a served model's name; each ``version``, "1"."""
    enums = {"name": names, "version": list(kserve.VERSIONS)}
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path" and parameter.get("name") in enums:
                    parameter["schema"]["enum"] = enums[parameter["name"]]


def install_openapi(app: FastAPI, names: list[str]) -> None:
    """Complete ``app``'s generated schema with what this module describes."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(ERROR_SCHEMAS)
            _name_enums(schema, names)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
