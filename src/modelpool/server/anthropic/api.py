"""``/v1/messages`` on the daemon's generation walk (``generation.Api``), and what
``/v1/messages/count_tokens`` asks the tokenizer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from modelpool.server.anthropic.request import MessagesRequest, parse_messages
from modelpool.server.anthropic.stream import MessageEvents
from modelpool.server.core.job import Job
from modelpool.server.generation import RunsOnItsModel
from modelpool.server.http import json_bytes
from modelpool.server.streaming import StreamedChoice
from modelpool.shared.config import PoolConfig
from modelpool.shared.protocol import Prompt
from modelpool.shared.tools import GENERIC_PREAMBLE
from modelpool.shared.validation import FIT_PARAM

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Result


class MessagesApi(RunsOnItsModel):
    """The Anthropic Messages family."""

    def parse(self, body: dict[str, Any]) -> MessagesRequest:
        return parse_messages(body)

    def answer(self, request: MessagesRequest, results: Mapping[int, Result], model: str) -> bytes:
        return json_bytes(MessageEvents(request, model).whole(results[0]))

    def writer(
        self, request: MessagesRequest, choices: list[StreamedChoice], model: str
    ) -> MessageEvents:
        return MessageEvents(request, model)


def fit_max_tokens(request: object, config: PoolConfig) -> None:
    """A Messages request's ``max_tokens`` is cut to what the model's context leaves after
    the prompt, not refused: Claude Code asks 32000 of every model whatever its context.
    A model whose ``generation_defaults`` set ``fit_to_context`` keeps that choice
    (false: refused, with the numbers, in Anthropic's words)."""
    if isinstance(request, MessagesRequest) and FIT_PARAM not in config.generation_defaults:
        request.job.params[FIT_PARAM] = True


def count_job(body: Mapping[str, Any]) -> Job:
    """A ``count_tokens`` body as a generation's job (no ``max_tokens``), whose images the
    daemon settles as a generation's (``server.images``) before :func:`count_prompt`."""
    return parse_messages(body, count=True).job


def count_prompt(job: Job) -> Prompt:
    """The prompt whose tokens ``count_tokens`` reports: the conversation as a
    generation's, rendered by the model's template. The tools are counted as the generic
    tool preamble in the system message (what a template that cannot render tools is
    given; a template's own tool rendering may differ by a few tokens)."""
    prompt = job.prompts[0]
    assert isinstance(prompt, list)
    messages = [dict(message) for message in prompt]
    offered = job.params.get("tools")
    if offered:
        preamble = GENERIC_PREAMBLE.format(
            tools="\n".join(json.dumps(tool["function"]) for tool in offered)
        )
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{preamble}"
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages
