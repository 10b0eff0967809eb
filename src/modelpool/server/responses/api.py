"""``/v1/responses`` on the daemon's generation walk (``generation.Api``), and the
stored responses' ``GET`` and ``DELETE``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from modelpool.server.generation import RunsOnItsModel
from modelpool.server.http import ApiError, json_bytes
from modelpool.server.responses.request import ResponsesRequest, parse_responses
from modelpool.server.responses.store import ResponseStore
from modelpool.server.responses.stream import ResponseEvents
from modelpool.server.streaming import StreamedChoice

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Result


class ResponsesApi(RunsOnItsModel):
    """The Responses family: a body read onto the chat job, answers kept in ``store`` as
    ``owner``'s (a tenant's name; "" without keys), which only it reads back::

        state.responses.of("alice").stored("resp_...")     # a 404 for any other owner
    """

    def __init__(self, store: ResponseStore, owner: str = "") -> None:
        self.store = store
        self.owner = owner

    def of(self, owner: str) -> ResponsesApi:
        """The same store, seen by ``owner``."""
        return ResponsesApi(self.store, owner)

    def parse(self, body: dict[str, Any]) -> ResponsesRequest:
        return parse_responses(body, self.store, owner=self.owner)

    def answer(self, request: ResponsesRequest, results: Mapping[int, Result], model: str) -> bytes:
        writer = ResponseEvents(request, model, self.store)
        return json_bytes(writer.whole(results[0]))

    def writer(
        self, request: ResponsesRequest, choices: list[StreamedChoice], model: str
    ) -> ResponseEvents:
        return ResponseEvents(request, model, self.store)

    def stored(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id, owner=self.owner)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id, owner=self.owner):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"no stored response {response_id!r} (never stored, deleted, evicted or expired)",
        type="invalid_request_error",
        code="not_found",
        param="response_id",
    )
