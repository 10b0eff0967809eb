"""The live status page, ``/ui``: static HTML, JavaScript and CSS shipped in the package.

The page holds no data: its script reads ``/stats`` every two seconds (with the API key
when one is set: it asks for it, or takes it from ``#key=...``, which never reaches the
server) and shows the workers, the queue, recent kills, retries and release checks with
their cause, and tokens per second, latency and the queue over the last minutes. So the
three files are served without the key (``UI_PATHS``, open in ``guard``), with a
content security policy that lets the page load only its own files::

    add_ui_routes(app)          # GET /ui, /ui/app.js, /ui/app.css
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

# Path -> (file, media type).
_FILES = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
UI_PATHS = frozenset(_FILES)
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_ui_routes(app: FastAPI) -> None:
    """Serve the page's files, read once from the package."""
    files = resources.files(__name__)
    for path, (name, media_type) in _FILES.items():
        body = files.joinpath(name).read_bytes()
        app.add_api_route(
            path,
            _serve(body, media_type),
            methods=["GET"],
            include_in_schema=False,
        )


def _serve(body: bytes, media_type: str) -> Callable[[], Coroutine[Any, Any, Response]]:
    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)

    return serve
