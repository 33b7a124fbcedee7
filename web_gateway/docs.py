"""``/docs``: Swagger UI served from this process, never from a CDN (so it works offline).

The assets come from the ``swagger-ui-bundle-v2`` package (a gateway dependency) and are served
under ``/docs/static/``. Without that package, ``/docs`` is a plain page that says where the
OpenAPI schema is.
"""

from __future__ import annotations

import html
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

DOCS = "/docs"
STATIC = "/docs/static"


def _assets() -> str | None:
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return str(swagger_ui_path)


def install_docs(app: FastAPI) -> None:
    """Serve Swagger UI at ``/docs`` (the app must be built with ``docs_url=None``)."""
    assets = _assets()
    openapi_url = app.openapi_url or "/openapi.json"
    if assets is not None:
        app.mount(STATIC, StaticFiles(directory=assets), name="docs-static")

    @app.get(DOCS, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        if assets is None:
            return HTMLResponse(_plain_page(app.title, root + openapi_url))
        parameters: dict[str, Any] = {**(app.swagger_ui_parameters or {}), "validatorUrl": None}
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC}/favicon-32x32.png",
            swagger_ui_parameters=parameters,
        )


def _plain_page(title: str, openapi_url: str) -> str:
    url = html.escape(openapi_url)
    return (
        f"<!DOCTYPE html><html><head><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><p>The OpenAPI schema of this gateway is at "
        f'<a href="{url}">{url}</a>. Swagger UI is not installed here '
        "(it comes with the gateway's Python dependencies: swagger-ui-bundle-v2).</p>"
        "</body></html>"
    )
