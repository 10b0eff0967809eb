"""OpenAI's response shapes for the daemon's completions and chat routes.

``core.generation_body`` parses a request into a :class:`~modelpool.server.core.job.Job`
(its prompts, the pool kwargs, ``n``, ``echo``, ``logprobs``); ``app.py`` runs one pool
request per :meth:`Job.choices` entry and builds the answer here from the
:class:`~modelpool.Result` of each::

    job = Job(prompts=["Hello"], params={"max_new_tokens": 8}, n=2, logprobs=1)
    results = [await pool.agenerate(prompt, **params) for _, prompt, params in job.choices()]
    body = response_body(job, results, "smollm2", chat=False, created=int(time.time()))

Logprobs come in two shapes. Completions (legacy) carry parallel lists::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
     "text_offset": [...]}

with ``echo`` putting the prompt's tokens first (the very first has a null logprob), and
``top_logprobs`` holding the N likeliest tokens plus the chosen one. Chat carries
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modelpool.server.core.job import Job
from modelpool.server.http import JSON_SLICE_ITEMS, EncodedArray, compact_json
from modelpool.server.reasoning import chat_reasoning
from modelpool.shared.logprob_columns import TokenLogprobs
from modelpool.shared.protocol import Prompt, TokenLogprob
from modelpool.shared.tools import answer_message

if TYPE_CHECKING:
    from modelpool.supervisor.results import Result


def usage(
    prompt_tokens: int | None, completion_tokens: int | None, cached_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI's usage object. ``prompt_tokens_details.cached_tokens`` is always there (0
    without a cache hit): clients compute their cache hit rate from it."""
    # A backend that cannot count says None; the client sees null rather than a made-up 0.
    total = (
        None
        if prompt_tokens is None or completion_tokens is None
        else prompt_tokens + completion_tokens
    )
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def total_usage(job: Job, results: dict[int, Result]) -> dict[str, Any]:
    """Prompt tokens once per prompt, completion tokens of every run (best_of included)."""
    per_prompt = job.runs_per_prompt
    firsts = [results[index] for index in results if index % per_prompt == 0]
    completion_counts = [result.completion_tokens for result in results.values()]
    cached = sum(result.cached_tokens for result in firsts)
    return usage(_sum([r.prompt_tokens for r in firsts]), _sum(completion_counts), cached)


def _sum(counts: Sequence[int | None]) -> int | None:
    return None if any(count is None for count in counts) else sum(c or 0 for c in counts)


def keep_best(job: Job, results: dict[int, Result]) -> dict[int, Result]:
    """The returned choices, by their index in the answer: all runs unless best_of > n,
    then each prompt's n runs with the highest summed logprob."""
    if job.best_of <= job.n:
        return results
    kept: dict[int, Result] = {}
    for prompt_index in range(len(job.prompts)):
        first = prompt_index * job.best_of
        candidates = [results[first + number] for number in range(job.best_of)]
        candidates.sort(key=_summed_logprob, reverse=True)
        for rank, result in enumerate(candidates[: job.n]):
            kept[prompt_index * job.n + rank] = result
    return kept


def _summed_logprob(result: Result) -> float:
    return TokenLogprobs.of(result.logprobs or []).summed_logprob()


def prompt_text(prompt: Prompt, result: Result | None) -> str:
    """The text ``echo`` puts first: the prompt string, or a token-id prompt's tokens."""
    if isinstance(prompt, str):
        return prompt
    if result is None or result.prompt_logprobs is None:
        return ""
    return TokenLogprobs.of(result.prompt_logprobs).text()


def completion_logprobs(*parts: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of ``parts``' entries in order (echo:
    the prompt's, then the generated ones); ``offset`` is where the first token's text
    starts in the choice's text (streamed chunks carry the offsets of the whole).

    An echoed prompt may have tens of thousands of entries: each list is encoded to JSON
    a window of entries at a time, so that the daemon never holds more than a window's
    Python objects (a dict per entry of every list whole would be ten times the answer's
    size), and comes back as an :class:`EncodedArray`, which ``json_bytes`` writes as is.
    """
    lists: dict[str, list[str]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    windows = (TokenLogprobs.of(part).windows(JSON_SLICE_ITEMS) for part in parts)
    for window in itertools.chain.from_iterable(windows):
        tokens = window.tokens()
        token_logprobs = window.logprob_values()
        text_offset = list(itertools.accumulate(map(len, tokens), initial=offset))
        offset = text_offset.pop()
        texts, values, bounds = window.alternative_columns()
        top_logprobs: list[dict[str, float] | None] = []
        for token, logprob, start, end in zip(
            tokens, token_logprobs, bounds[:-1], bounds[1:], strict=True
        ):
            if logprob is None:
                top_logprobs.append(None)
                continue
            top = dict(zip(texts[start:end], values[start:end], strict=True))
            if len(top) < end - start:
                # Two alternatives with one text (undecodable bytes): the likelier one's.
                top = {}
                for text, value in zip(texts[start:end], values[start:end], strict=True):
                    top.setdefault(text, value)
            # OpenAI: "the logprob of the sampled token is always returned".
            top.setdefault(token, logprob)
            top_logprobs.append(top)
        for name, items in (
            ("tokens", tokens),
            ("token_logprobs", token_logprobs),
            ("top_logprobs", top_logprobs),
            ("text_offset", text_offset),
        ):
            lists[name].append(compact_json(items)[1:-1])
    return {name: EncodedArray(pieces) for name, pieces in lists.items()}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...], "refusal": None}``, its content
    encoded a window of entries at a time (see completion_logprobs)."""
    pieces: list[str] = []
    for window in TokenLogprobs.of(entries).windows(JSON_SLICE_ITEMS):
        texts, values, bounds = window.alternative_columns()
        content = [
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": text, "logprob": value, "bytes": list(text.encode())}
                    for text, value in zip(texts[start:end], values[start:end], strict=True)
                ],
            }
            for token, logprob, start, end in zip(
                window.tokens(), window.logprob_values(), bounds[:-1], bounds[1:], strict=True
            )
        ]
        pieces.append(compact_json(content)[1:-1])
    return {"content": EncodedArray(pieces), "refusal": None}


def choice_logprobs(job: Job, prompt: Prompt, result: Result) -> dict[str, Any] | None:
    """The whole ``logprobs`` object of one choice; None when the client asked for none."""
    if job.logprobs is None:
        return None
    generated = result.logprobs or []
    if job.chat:
        return chat_logprobs(generated)
    if job.echo:
        return completion_logprobs(result.prompt_logprobs or [], generated)
    return completion_logprobs(generated)


def response_body(job: Job, results: dict[int, Result], model: str, created: int) -> dict[str, Any]:
    """The non-streamed answer: one choice per kept run, ``index`` set."""
    first = results[min(results)]
    choices = []
    for index, result in sorted(keep_best(job, results).items()):
        prompt = job.prompts[index // job.n]
        logprobs = choice_logprobs(job, prompt, result)
        if job.chat:
            message: dict[str, Any] = {"role": "assistant", "content": result.text}
            finish_reason: str | None = result.finish_reason
            if job.tools is not None:
                message, finish_reason = answer_message(job.tools, result.text, finish_reason)
            chat_choice = {
                "index": index,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
            chat_reasoning(message, chat_choice, result)
            choices.append(chat_choice)
        else:
            text = result.text
            if job.echo:
                text = prompt_text(prompt, result) + text
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "finish_reason": result.finish_reason,
                    "logprobs": logprobs,
                }
            )
    usage_body = total_usage(job, results)
    thought = [r.reasoning_tokens for r in results.values() if r.reasoning_tokens is not None]
    if job.chat and thought:
        usage_body["completion_tokens_details"] = {"reasoning_tokens": sum(thought)}
    return {
        "id": f"{'chatcmpl' if job.chat else 'cmpl'}-{first.request_id}",
        "object": "chat.completion" if job.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body,
    }
