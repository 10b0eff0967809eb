"""The testing backend's scripted thinker: a reasoning model rehearsed without a model.

``think:N:ANSWER[:DELAY]`` (ANSWER may hold colons) thinks N tokens (``"w0 "``,
``"w1 "`` ...) inside thinking the template opened (as DeepSeek-R1's does), writes
``</think>``, then answers ANSWER word by word (each word a token), DELAY seconds a
token. ``think_tag:...`` is the same model opening thinking itself (``<think>`` first, as
Qwen3 does). ``harmony:...`` is gpt-oss: it opens its analysis channel itself, ends
it with ``<|end|><|start|>assistant``, and ANSWER is the next message from its channel
on (``<|channel|>final<|message|>4``, or a call: ``<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``); after a forced close
that wrote the final channel already, ANSWER's own ``<|channel|>final<|message|>`` is
left out. N as ``loop`` thinks ``"a b c a b c ..."`` until something closes it. The
worker's bound (``common.thinking``) runs over it as over a real model's tokens (each
piece one token): its forced end of thinking replaces the script's next piece, and the
answer follows. With ``reasoning_parser = "none"`` nothing is bounded and the text is the script's.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

from modelpool.shared.protocol import Call, FinishReason, Generation, note_prompt
from modelpool.shared.reasoning.controls import PARSER_PARAM
from modelpool.shared.reasoning.detect import family_named
from modelpool.shared.reasoning.parsers import (
    HARMONY_ANALYSIS,
    HARMONY_END,
    HARMONY_FINAL,
    HARMONY_START,
    THINK_END,
    THINK_START,
)
from modelpool.worker.backends.common.thinking import ThinkingModel, ThinkingTracker

COMMANDS = frozenset({"think", "think_tag", "harmony"})
SCRIPTED_MODEL: ThinkingModel[str] = ThinkingModel(
    family_named("deepseek_r1"), (THINK_START,), (THINK_END,)
)
# Harmony's markers, each one piece (one token) of the script.
SCRIPTED_HARMONY: ThinkingModel[str] = ThinkingModel(
    family_named("gpt_oss"), (HARMONY_ANALYSIS,), (HARMONY_END, HARMONY_START), (HARMONY_FINAL,)
)
_LOOP = ("a ", "b ", "c ")


def _script(command: str, count: str, answer: str) -> tuple[Iterator[str], list[str]]:
    """The thinking pieces (the end of thinking last) and the answer's."""
    thinking: Iterator[str]
    model = SCRIPTED_HARMONY if command == "harmony" else SCRIPTED_MODEL
    if count == "loop":
        thinking = itertools.cycle(_LOOP)
    else:
        thinking = itertools.chain((f"w{index} " for index in range(int(count or 8))), model.end)
    if command != "think":
        thinking = itertools.chain(model.start, thinking)
    return thinking, _words(answer)


def _after_final(pieces: list[str]) -> Iterator[str]:
    """A Harmony answer, after a forced close that wrote its final channel already."""
    text = "".join(pieces)
    rest = text[len(HARMONY_FINAL) :] if text.startswith(HARMONY_FINAL) else text
    return iter(_words(rest))


def _words(answer: str) -> list[str]:
    """``answer`` word by word, each word a token (its space kept)."""
    words = answer.split(" ") if answer else []
    return [word + (" " if index < len(words) - 1 else "") for index, word in enumerate(words)]


def _answer_and_delay(rest: str) -> tuple[str, float]:
    """``ANSWER[:DELAY]``: the delay is the last field when it is a number, so that an
    answer may hold colons (a JSON tool call, say)."""
    answer, _, delay_text = rest.rpartition(":")
    try:
        return answer, float(delay_text)
    except ValueError:
        return rest, 0.0


def think(call: Call, command: str, argument: str, limit: int | None) -> Generation:
    """Run the script of ``command:argument`` through the worker's bound."""
    count, _, rest = argument.partition(":")
    answer, delay = _answer_and_delay(rest)
    thinking, answer_pieces = _script(command, count, answer)
    started = command == "think"
    model = SCRIPTED_HARMONY if command == "harmony" else SCRIPTED_MODEL
    tracker: ThinkingTracker[str] | None = None
    if call.params.get(PARSER_PARAM) != "none":
        tracker = ThinkingTracker(model, started, call.params, limit or 1 << 30)
    note_prompt(call, 1, 0)
    delivered = getattr(call, "delivered", None)
    pause = threading.Event()
    # Thinking the template opened gets its opening written back (the canonical text).
    lead = THINK_START if started and tracker is not None else ""
    pieces: list[str] = [lead] if lead else []
    answering = iter(answer_pieces)
    in_thought = True
    generated = 0
    while True:
        if call.cancelled():
            return _generation(pieces, "cancelled", generated, tracker)
        if limit is not None and generated >= limit:
            return _generation(pieces, "length", generated, tracker)
        forced = None if tracker is None else tracker.forced()
        if forced is not None:
            piece: str | None = forced
        elif in_thought:
            piece = next(thinking)
        else:
            piece = next(answering, None)
        if piece is None:
            return _generation(pieces, "stop", generated, tracker)
        if delay:
            pause.wait(delay)
        generated += 1
        if delivered is not None:
            delivered()
        ended = piece == model.end[-1] if tracker is None else tracker.take(piece)
        if ended:
            in_thought = False
            if piece == HARMONY_FINAL:
                answering = _after_final(answer_pieces)
        call.emit(lead + piece)
        lead = ""
        pieces.append(piece)


def _generation(
    pieces: list[str], reason: FinishReason, generated: int, tracker: ThinkingTracker[str] | None
) -> Generation:
    return Generation(
        "".join(pieces),
        reason,
        1,
        generated,
        reasoning_tokens=None if tracker is None else tracker.tokens,
        thinking_closed=None if tracker is None else tracker.closed_by,
    )
