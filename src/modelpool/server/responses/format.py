"""The Responses API's objects: the response (``GET``, the non-streamed answer and the
``response`` of the streamed events), its ``usage`` and its ``error``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from modelpool.server.http import ApiError

if TYPE_CHECKING:
    from modelpool.server.responses.request import ResponsesRequest
    from modelpool.supervisor.pool import Result

Status = Literal["in_progress", "completed", "incomplete", "failed"]
# The request fields a response object echoes, with their defaults.
_ECHOED: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": None,
    "temperature": None,
    "tool_choice": "auto",
    "top_p": None,
    "truncation": "disabled",
    "user": None,
    "prompt_cache_key": None,
    "safety_identifier": None,
    "service_tier": None,
}


def response_object(
    request: ResponsesRequest,
    model: str,
    status: Status,
    output: list[dict[str, Any]],
    *,
    result: Result | None = None,
    error: ApiError | None = None,
) -> dict[str, Any]:
    body = request.body
    response: dict[str, Any] = {
        "id": request.response_id,
        "object": "response",
        "created_at": request.created_at,
        "status": status,
        "model": model,
        "output": output,
        "error": None if error is None else error_object(error),
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        **{name: body.get(name, default) for name, default in _ECHOED.items()},
        "store": request.store,
        "text": body.get("text") or {"format": {"type": "text"}},
        "tools": request.tools,
        "usage": None if result is None else usage(result),
    }
    if response["metadata"] is None:
        response["metadata"] = {}
    return response


def usage(result: Result) -> dict[str, Any]:
    # A backend that cannot count says None; the Responses usage has no null counts.
    prompt = result.prompt_tokens or 0
    completion = result.completion_tokens or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens or 0},
        "total_tokens": prompt + completion,
    }


def error_object(error: ApiError) -> dict[str, Any]:
    """A failed response's ``error``: the daemon's code (``deadline_exceeded``,
    ``worker_crashed``...) and message, which say the cause."""
    return {
        "code": error.code or "server_error",
        "message": error.message,
        "param": error.param,
        "type": error.type,
    }
