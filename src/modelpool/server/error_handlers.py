"""The daemon's exception handlers, in one place: every error leaves in the API's error
shape (``errors.error_response``), with ``x-should-retry`` and, for 429 and 503,
``Retry-After``. A typed pool error maps to its status (``errors.pool_error_to_api``),
as much of it as the caller may see (``rights.seen_error``); Starlette's 404 and 405
name the route and method; anything else is a 500 that names only the exception's type."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from modelpool.server import rights
from modelpool.server.errors import error_response, pool_error_to_api
from modelpool.server.http import ApiError
from modelpool.shared.errors import PoolError


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers of ``ApiError``, ``PoolError``, Starlette's HTTP errors and
    any other exception on ``app``."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc, request.url.path)

    @app.exception_handler(PoolError)
    async def on_pool_error(request: Request, exc: PoolError) -> Response:
        note_attempts(request.scope, exc.request_id, exc.attempts)
        return error_response(pool_error_to_api(rights.seen_error(request, exc)), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            error = ApiError(
                404,
                f"no route {request.method} {request.url.path}",
                type="not_found_error",
                code="not_found",
            )
        elif exc.status_code == 405:
            error = ApiError(
                405,
                f"method {request.method} not allowed on {request.url.path}",
                code="method_not_allowed",
                headers=exc.headers,
            )
        else:
            error = ApiError(
                exc.status_code, str(exc.detail), code="http_error", headers=exc.headers
            )
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after sending this, so uvicorn logs the traceback once.
        error = ApiError(
            500,
            f"internal server error: {type(exc).__name__}",
            type="server_error",
            code="internal_error",
        )
        return error_response(error, request.url.path)


def note_attempts(scope: Scope, request_id: str | None, attempts: list[Any]) -> None:
    """A failed request's id and attempts, for its access log line."""
    note = scope.setdefault("state", {})
    note["request_id"] = request_id
    if attempts:
        note["attempts"] = len(attempts)
        note["worker_pid"] = attempts[-1].worker_pid
