"""What a backend returned, as the plain answer that crosses the pipe to the supervisor."""

from __future__ import annotations

from modelpool.shared.logprob_columns import TokenLogprobs
from modelpool.shared.protocol import Generation, TokenLogprob


def normalise(output: object) -> Generation:
    """Plain types only cross the pipe: the supervisor never imports what a backend used
    (a torch tensor as a token count would drag torch into it) and never sees a bad field."""
    if not isinstance(output, Generation):
        if not isinstance(output, str):
            raise TypeError(f"generate() returned {type(output).__name__}, not str or Generation")
        return Generation(output)
    if not isinstance(output.text, str):
        raise TypeError(f"Generation.text is {type(output.text).__name__}, not str")
    if output.finish_reason not in ("stop", "length", "cancelled"):
        raise ValueError(
            f"Generation.finish_reason {output.finish_reason!r} is not one of "
            "'stop', 'length', 'cancelled'"
        )
    if output.stop_sequence is not None and not isinstance(output.stop_sequence, str):
        raise TypeError(
            f"Generation.stop_sequence is {type(output.stop_sequence).__name__}, not str or None"
        )
    return Generation(
        output.text,
        output.finish_reason,
        None if output.prompt_tokens is None else int(output.prompt_tokens),
        None if output.completion_tokens is None else int(output.completion_tokens),
        plain_logprobs(output.logprobs, "logprobs"),
        plain_logprobs(output.prompt_logprobs, "prompt_logprobs"),
        None if output.cached_tokens is None else int(output.cached_tokens),
        None if output.token_ids is None else [int(token) for token in output.token_ids],
        # str() of a str subclass: a plain str crosses the pipe.
        None if output.stop_sequence is None else str(output.stop_sequence),
        None,
        None if output.reasoning_tokens is None else int(output.reasoning_tokens),
        None if output.thinking_closed is None else str(output.thinking_closed),
    )


def plain_logprobs(entries: object, name: str) -> TokenLogprobs | None:
    """As columns: a list of objects would cost the supervisor's dispatcher thread one
    long unpickling that holds the GIL (see logprob_columns)."""
    if entries is None or isinstance(entries, TokenLogprobs):
        return entries
    if not isinstance(entries, list) or not all(isinstance(e, TokenLogprob) for e in entries):
        raise TypeError(
            f"Generation.{name} must be a list of TokenLogprob, a TokenLogprobs or None"
        )
    return TokenLogprobs.of(entries)
