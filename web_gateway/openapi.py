"""The OpenAPI descriptions the routes cannot give themselves (their bodies are parsed by hand).

``install_openapi(app, names)`` adds the request bodies and error responses of the inference
routes, the two error schemas and the served model names (as each ``name`` parameter's enum),
and drops the 422 FastAPI declares for its parameter validation: the gateway answers that 400.
The other routes declare their responses here too (``responses=``).
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

UNAUTHORIZED = "Missing or wrong bearer token"
ERROR_CODES = (
    (400, "Malformed request"),
    (401, UNAUTHORIZED),
    (404, "Unknown model"),
    (413, "Body or item count too large"),
    (415, "Content-Encoding other than gzip (or x-gzip), deflate or identity"),
    (422, "Input does not fit the model's declared inputs"),
    (500, "The model raised (ModelError)"),
    (503, "Queue full, no live worker, or Redis unavailable (Retry-After)"),
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


def _error(text: str, schema: str) -> dict[str, Any]:
    return {
        "description": text,
        "content": {JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


def _errors_as(schema: str) -> dict[str, Any]:
    return {str(code): _error(text, schema) for code, text in ERROR_CODES}


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
BINARY = "application/octet-stream"
HEADER_LENGTH_PARAMETER = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "required": False,
    "description": "Triton's binary tensor data extension: the size in bytes of the JSON at the "
    "start of the body; the binary data of the inputs whose parameters give binary_data_size "
    "follow it, in order.",
    "schema": {"type": "integer", "minimum": 1},
}
BINARY_BODY = {
    "schema": {
        "type": "string",
        "format": "binary",
        "description": "The JSON (its size in Inference-Header-Content-Length), then the "
        "binary tensor data.",
    }
}
OUTPUT_TENSOR = _object(
    ["name", "datatype", "shape"],
    {
        "name": {"type": "string"},
        "datatype": {"type": "string", "enum": sorted(DATATYPES)},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "data": {**ANY_ARRAY, "description": "Absent when the output is sent in binary."},
        "parameters": {
            "type": "object",
            "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
        },
    },
)
INFER_ANSWER = _object(
    ["model_name", "model_version", "outputs"],
    {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string", "description": "The request's id, when it gave one."},
        "outputs": {"type": "array", "items": OUTPUT_TENSOR},
    },
)
V2_INFER: dict[str, Any] = {
    "parameters": [TIMEOUT_PARAMETER, PRIORITY_PARAMETER, HEADER_LENGTH_PARAMETER],
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
            },
            BINARY: BINARY_BODY,
        },
    },
    "responses": {
        "200": {
            "description": "Output tensors: JSON, or with binary outputs (asked for with "
            "parameters.binary_data_output or an output's parameters.binary_data) the JSON, "
            "its size in the Inference-Header-Content-Length header, then their data",
            "content": {JSON: {"schema": INFER_ANSWER}, BINARY: BINARY_BODY},
        },
        **_errors_as("V2Error"),
    },
}


def _answer(text: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": text, "content": {JSON: {"schema": schema}}}


UNKNOWN_MODEL = "Unknown model or version"
SERVER_READY_BODY = _object(["ready"], {"ready": {"type": "boolean"}, "error": {"type": "string"}})
MODEL_READY_BODY = _object(
    ["name", "ready", "workers"],
    {"name": {"type": "string"}, "ready": {"type": "boolean"}, "workers": {"type": "integer"}},
)
Responses = dict[int | str, dict[str, Any]]
MODELS: Responses = {401: _error(UNAUTHORIZED, "Error")}
SERVER_READY: Responses = {
    200: _answer("Redis answers", SERVER_READY_BODY),
    503: _answer(
        "Redis does not answer, or the Redis URL names a Redis Cluster node (error says so)",
        SERVER_READY_BODY,
    ),
}
METADATA: Responses = {401: _error(UNAUTHORIZED, "V2Error"), 404: _error(UNKNOWN_MODEL, "V2Error")}
MODEL_READY: Responses = {
    200: _answer(
        "A live worker consumes the model (of every stage, for a pipeline)", MODEL_READY_BODY
    ),
    404: _error(UNKNOWN_MODEL, "V2Error"),
    503: _answer("No live worker consumes the model, or Redis does not answer", MODEL_READY_BODY),
}
VALIDATION_ERROR = {"$ref": "#/components/schemas/HTTPValidationError"}


def _drop_validation_errors(schema: dict[str, Any]) -> None:
    """Remove the 422 FastAPI adds to every route with parameters, and its schemas."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            if responses.get("422", {}).get("content", {}).get(JSON, {}).get("schema") == (
                VALIDATION_ERROR
            ):
                del responses["422"]
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)


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
            _drop_validation_errors(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
