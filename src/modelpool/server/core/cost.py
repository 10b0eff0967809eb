"""What a request costs in the budget's units (``max_request_tokens``): its prompts, the
answer it may ask for, and the logprobs around them; a request past its client's budget
is a 400 ``request_too_expensive`` before it reaches a pool::

    check_budget(job, limit=262_144, default_max_tokens=128)
    check_size(inputs_size(inputs), limit=262_144, param="input")   # the pooling routes
"""

from __future__ import annotations

from collections.abc import Mapping

from modelpool.server.core.job import Job
from modelpool.server.http import invalid
from modelpool.shared.images import IMAGE_TOKEN_ESTIMATE, count_images
from modelpool.shared.protocol import Prompt, TokenIds

# What a chat message costs besides its text: the template's markers around it, which a
# request of thousands of empty messages would otherwise get for nothing.
MESSAGE_UNITS = 8
# What one logprob alternative costs in the answer, in the budget's units (a few bytes
# each): ``{"token":"x","logprob":-1.25,"bytes":[120]}`` is about 45 bytes, some ten
# times what a plain token adds; 4 units keeps n x max_tokens x top_logprobs from
# answering tens of megabytes to a request of a few hundred bytes.
LOGPROB_UNITS = 4


def text_units(value: object) -> int:
    """The size of a JSON value in the budget's units: its strings' characters, and one
    unit per other item (a stack, not recursion: a value may nest deeply)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            total += len(item)
            for key, child in item.items():
                total += len(key) if isinstance(key, str) else 1
                stack.append(child)
        elif isinstance(item, (list, tuple)):
            total += len(item)
            stack.extend(item)
        else:
            total += 1
    return total


def prompt_size(prompt: Prompt) -> int:
    """A prompt's size in the budget's units: token ids, or characters (a bound on the
    tokens of a text for the usual tokenizers, and known without the model); a chat's
    messages each cost ``MESSAGE_UNITS`` besides their text (content, calls, names)."""
    if isinstance(prompt, TokenIds):
        return len(prompt.ids)
    if isinstance(prompt, str):
        return len(prompt)
    # An image's bytes count one unit in text_units: it costs its estimated tokens instead.
    return IMAGE_TOKEN_ESTIMATE * count_images(prompt) + sum(
        MESSAGE_UNITS + text_units([value for key, value in message.items() if key != "role"])
        for message in prompt
    )


def request_cost(job: Job, default_max_tokens: int) -> int:
    """What bounds the work and the size of the answer, summed over the prompts: per
    run, the prompt (with the tools' definitions the template renders into it) and
    ``max_tokens``, and for logprobs each answered token's alternatives
    (``LOGPROB_UNITS`` each; the prompt's too when it is echoed with them)."""
    return _cost(job, job.params.get("max_new_tokens", default_max_tokens))


def output_ceiling(job: Job, limit: int) -> int:
    """The largest ``max_tokens`` whose :func:`request_cost` stays within ``limit``: what
    a request that set no maximum may generate within its client's budget (at least 1)."""
    fixed = _cost(job, 0)
    per_token = _cost(job, 1) - fixed
    return max(1, (limit - fixed) // max(per_token, 1))


def _cost(job: Job, max_tokens: int) -> int:
    tools = text_units(job.tools.template_tools()) if job.tools is not None else 0
    cost = 0
    for prompt in job.prompts:
        size = prompt_size(prompt) + tools
        scored = max_tokens + (size if job.echo else 0)
        alternatives = 0 if job.logprobs is None else 1 + job.logprobs
        cost += job.runs_per_prompt * (size + max_tokens + LOGPROB_UNITS * alternatives * scored)
    return cost


def check_size(size: int, *, limit: int, param: str) -> None:
    """400 ``request_too_expensive`` for a tokenizer route's input past the budget."""
    if size > limit:
        raise invalid(
            f"the request's {param} is {size} token units, more than max_request_tokens ({limit})",
            param=param,
            code="request_too_expensive",
        )


def check_budget(job: Job, *, limit: int, default_max_tokens: int) -> None:
    """400 ``request_too_expensive`` past the server's ``max_request_tokens``."""
    cost = request_cost(job, default_max_tokens)
    if cost > limit:
        raise invalid(
            f"the request asks for {cost} token units, more than max_request_tokens ({limit}): "
            f"n x (prompt + messages x {MESSAGE_UNITS} + tools + max_tokens "
            f"+ {LOGPROB_UNITS} x (1 + logprobs) x max_tokens); ask for fewer choices, "
            "messages, tokens or logprobs",
            param="n" if job.runs_per_prompt > 1 else "max_tokens",
            code="request_too_expensive",
        )
