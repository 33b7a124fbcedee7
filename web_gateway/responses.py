"""JSON responses written with orjson (numpy arrays and bytes included)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from .serving import to_json

JSON = "application/json"


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``content`` as a JSON response."""
    body = orjson.dumps(content, default=to_json, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, headers=headers, media_type=JSON)
