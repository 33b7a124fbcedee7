"""JSON responses written with orjson (numpy arrays and bytes included)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from .serving import to_json

JSON = "application/json"


_CONTENT_TYPE = (b"content-type", JSON.encode("latin-1"))


class JSONBody(Response):
    """A JSON body as a response, with starlette's headers for it (content-length, then
    content-type) made without its general header handling (the hot routes' answers)."""

    media_type = JSON

    def __init__(self, body: bytes, status: int = 200) -> None:
        self.status_code = status
        self.background = None
        self.body = body
        self.raw_headers = [(b"content-length", str(len(body)).encode("latin-1")), _CONTENT_TYPE]


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None, option: int = 0
) -> Response:
    """``content`` as a JSON response (``option``: orjson options besides numpy's)."""
    body = orjson.dumps(content, default=to_json, option=orjson.OPT_SERIALIZE_NUMPY | option)
    if headers is None and status >= 200 and status not in (204, 304):
        return JSONBody(body, status)
    return Response(body, status_code=status, headers=headers, media_type=JSON)
