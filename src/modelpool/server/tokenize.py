"""The daemon's ``/tokenize`` and ``/detokenize`` routes, in vLLM's and SGLang's shapes.

Benchmark tools (``vllm bench``, guidellm, genai-perf) call them to size prompts in the
server's own tokens. The tokens are the worker's: ``ModelPool.atokenize`` asks a worker
to read the prompt the way a generation reads it (its tokenizer and chat template), so
the count is the one the context check uses::

    POST /tokenize    {"model": M, "prompt": "Hello"}
                      {"model": M, "messages": [...], "add_generation_prompt": true}
                   -> {"tokens": [...], "count": N, "max_model_len": L, "token_strs": null}
    POST /detokenize  {"model": M, "tokens": [1, 2, 3]}  ->  {"prompt": "text"}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelpool.server.core.fields import check_fields, check_ignored_fields, opt_bool
from modelpool.server.core.generation_body import message_content, token_prompt
from modelpool.server.http import invalid
from modelpool.shared.protocol import Prompt

TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_generation_prompt",
        "add_special_tokens",
        "return_token_strs",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@dataclass(frozen=True)
class TokenizeJob:
    prompt: Prompt
    add_generation_prompt: bool


def parse_tokenize(body: Mapping[str, Any]) -> TokenizeJob:
    """``prompt`` (a string or token ids, read as a completion's) or ``messages`` (read as
    a chat's, with the template's assistant opening unless ``add_generation_prompt`` is
    false). ``add_special_tokens`` may only say what the route does anyway (true for a
    prompt, false for messages, whose template writes its own): anything else is a 400."""
    check_fields(body, TOKENIZE_FIELDS)
    check_ignored_fields({"model": body["model"]} if "model" in body else {})
    if ("prompt" in body) == ("messages" in body):
        raise invalid("send exactly one of 'prompt' and 'messages'", param="prompt")
    if opt_bool(body, "return_token_strs"):
        raise invalid(
            "return_token_strs is not supported", "return_token_strs", "unsupported_value"
        )
    add_special_tokens = opt_bool(body, "add_special_tokens")
    if "prompt" in body:
        if add_special_tokens is False or "add_generation_prompt" in body:
            name = "add_special_tokens" if add_special_tokens is False else "add_generation_prompt"
            raise invalid(f"{name} is not supported with a prompt", name, "unsupported_value")
        return TokenizeJob(_prompt(body["prompt"]), True)
    if add_special_tokens:
        raise invalid(
            "add_special_tokens: the chat template writes the special tokens",
            "add_special_tokens",
            "unsupported_value",
        )
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    prompt: list[Mapping[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"{where} must be an object with a string role", param=where)
        role = "system" if message["role"] == "developer" else message["role"]
        prompt.append({"role": role, "content": message_content(message.get("content"), index)})
    add_generation_prompt = opt_bool(body, "add_generation_prompt")
    return TokenizeJob(prompt, add_generation_prompt is not False)


def _prompt(value: object) -> Prompt:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return token_prompt(value, "prompt")
    raise invalid("prompt must be a string or a list of token ids", param="prompt")


def parse_detokenize(body: Mapping[str, Any]) -> list[int]:
    check_fields(body, DETOKENIZE_FIELDS)
    check_ignored_fields({"model": body["model"]} if "model" in body else {})
    tokens = body.get("tokens")
    if "tokens" not in body:
        raise invalid("missing field 'tokens'", param="tokens", code="missing_field")
    if not isinstance(tokens, list):
        raise invalid("tokens must be a list of token ids", param="tokens")
    for index, token_id in enumerate(tokens):
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise invalid(
                f"tokens[{index}] must be a token id (an integer >= 0), got {token_id!r}",
                param="tokens",
            )
    return list(tokens)


def tokenize_body(tokens: list[int], max_model_len: int | None) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": max_model_len,
        "token_strs": None,
    }
