"""Operations routes: ``/healthz`` (liveness) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from . import metrics
from .responses import json_response

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> Response:
    """Liveness: the process answers (Redis is not consulted)."""
    return json_response({"status": "ok"})


@router.get("/metrics")
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus metrics of every gateway process of this server."""
    request.app.gateway.flush_metrics()  # this process's counts are exact; others' lag
    content, media = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
    return Response(content, media_type=media)
