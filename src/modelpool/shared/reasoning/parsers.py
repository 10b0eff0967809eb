"""Streaming reasoning parsers: fed text pieces, they yield reasoning and answer text.

Every family's raw output is read by one :class:`ReasoningParser`; a worker returns its
text in the canonical form ``<think>REASONING</think>ANSWER`` (thinking that the chat
template opened in the prompt gets its ``<think>`` written back), which
:class:`ThinkTagParser` (``started=False``) splits on the server side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

THINK_START = "<think>"
THINK_END = "</think>"

ParserName = Literal["auto", "deepseek_r1", "qwen3", "gpt_oss", "none"]
PARSER_NAMES: tuple[ParserName, ...] = ("auto", "deepseek_r1", "qwen3", "gpt_oss", "none")
Family = Literal["deepseek_r1", "qwen3", "gpt_oss"]

# Harmony (gpt-oss): the analysis channel is thinking, the final channel the answer.
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_END = "<|end|>"
HARMONY_START = "<|start|>assistant"
HARMONY_THINKING_END = HARMONY_END + HARMONY_START
"""The end of gpt-oss's thinking: the analysis message ends and the next one starts, on
whichever channel the model names next (``final``: the answer; ``commentary
to=functions.NAME``: a call)."""
HARMONY_CLOSE = HARMONY_THINKING_END + HARMONY_FINAL
"""The forced close of a request that cannot call a tool: straight to the answer."""
HARMONY_TOKENS = frozenset(
    {
        "<|start|>",
        "<|end|>",
        "<|channel|>",
        "<|message|>",
        "<|return|>",
        "<|call|>",
        "<|constrain|>",
    }
)
"""Harmony's special tokens: a worker keeps them in a gpt-oss model's text (every other
special token is dropped), since its channels are told apart by them."""


@dataclass(frozen=True)
class Parsed:
    """What one piece of text held: reasoning, answer (either may be empty)."""

    reasoning: str = ""
    answer: str = ""


class ReasoningParser(Protocol):
    def feed(self, text: str) -> Parsed:
        """The reasoning and answer that ``text`` (the next piece) makes certain."""
        ...

    def finish(self) -> Parsed:
        """What was held back, at the end of the text."""
        ...


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class ThinkTagParser:
    """``<think>REASONING</think>ANSWER`` (DeepSeek-R1, Qwen3, SmolLM3, GLM).

    ``started``: the template opened thinking in the prompt (the text begins inside it).
    Otherwise thinking is only what a ``<think>`` at the start of the text (after
    whitespace) opens; text that does not start so is all answer. Whitespace around
    the tags is left out of both parts."""

    def __init__(self, started: bool = False) -> None:
        self._phase: Literal["opening", "thinking", "answer_start", "answer"] = (
            "thinking" if started else "opening"
        )
        self._held = ""
        self._reasoning_begun = False

    @property
    def thinking(self) -> bool:
        return self._phase in ("opening", "thinking")

    def feed(self, text: str) -> Parsed:
        held = self._held + text
        self._held = ""
        reasoning = answer = ""
        while held:
            if self._phase == "opening":
                stripped = held.lstrip()
                if stripped.startswith(THINK_START):
                    held = stripped[len(THINK_START) :]
                    self._phase = "thinking"
                    continue
                if THINK_START.startswith(stripped):
                    self._held = held
                    break
                self._phase = "answer"
                continue
            if self._phase == "thinking":
                if not self._reasoning_begun:
                    held = held.lstrip()
                    if not held:
                        break
                    self._reasoning_begun = True
                end = held.find(THINK_END)
                if end >= 0:
                    reasoning += held[:end].rstrip()
                    held = held[end + len(THINK_END) :]
                    self._phase = "answer_start"
                    continue
                keep = _partial_suffix(held, THINK_END)
                certain = held[: len(held) - keep]
                # Trailing whitespace may be the last before </think>: held until it is not.
                body = certain.rstrip()
                reasoning += body
                self._held = certain[len(body) :] + held[len(certain) :]
                break
            if self._phase == "answer_start":
                held = held.lstrip()
                if not held:
                    break
                self._phase = "answer"
            answer += held
            break
        return Parsed(reasoning, answer)

    def finish(self) -> Parsed:
        held, self._held = self._held, ""
        if self._phase == "thinking":
            return Parsed(held.rstrip(), "")
        if self._phase == "opening":
            return Parsed("", held)
        return Parsed("", held if self._phase == "answer" else held.lstrip())


class HarmonyParser:
    """gpt-oss's Harmony: ``<|channel|>analysis<|message|>THINKING<|end|>`` then
    ``<|start|>assistant<|channel|>final<|message|>ANSWER``. Text before any channel is
    answer; other channels' text (commentary: tool calls) is answer too, for the tool
    parser to read."""

    _MARKERS = (HARMONY_ANALYSIS, HARMONY_FINAL, HARMONY_END, HARMONY_START, "<|return|>")

    def __init__(self) -> None:
        self._channel: Literal["none", "analysis", "final"] = "none"
        self._held = ""

    def feed(self, text: str) -> Parsed:
        held = self._held + text
        self._held = ""
        reasoning = answer = ""
        while held:
            found = min(
                ((index, marker) for marker in self._MARKERS if (index := held.find(marker)) >= 0),
                default=None,
            )
            if found is None:
                keep = max(_partial_suffix(held, marker) for marker in self._MARKERS)
                body, self._held = held[: len(held) - keep], held[len(held) - keep :]
                if self._channel == "analysis":
                    reasoning += body
                else:
                    answer += body
                break
            index, marker = found
            if self._channel == "analysis":
                reasoning += held[:index]
            else:
                answer += held[:index]
            held = held[index + len(marker) :]
            if marker == HARMONY_ANALYSIS:
                self._channel = "analysis"
            elif marker == HARMONY_FINAL:
                self._channel = "final"
            elif marker == HARMONY_END:
                self._channel = "none"
        return Parsed(reasoning, answer)

    def finish(self) -> Parsed:
        held, self._held = self._held, ""
        return Parsed(held, "") if self._channel == "analysis" else Parsed("", held)


class ReturnedTextParser:
    """A worker's returned text, whichever form it has: the canonical
    ``<think>...</think>`` (every bounded family's), or Harmony's channels as a backend
    that keeps gpt-oss's special tokens writes them; anything else is all answer. The
    form is told by the text's first characters."""

    def __init__(self) -> None:
        self._held = ""
        self._parser: ReasoningParser | None = None

    def feed(self, text: str) -> Parsed:
        if self._parser is None:
            self._held += text
            opening = self._held.lstrip()[: len(HARMONY_ANALYSIS)]
            if HARMONY_ANALYSIS.startswith(opening) and len(opening) < len(HARMONY_ANALYSIS):
                return Parsed()
            harmony = opening == HARMONY_ANALYSIS
            self._parser = HarmonyParser() if harmony else ThinkTagParser()
            text, self._held = self._held, ""
        return self._parser.feed(text)

    def finish(self) -> Parsed:
        if self._parser is not None:
            return self._parser.finish()
        # Shorter than Harmony's opening: a start of <think>, or answer.
        parser = ThinkTagParser()
        first, last = parser.feed(self._held), parser.finish()
        return Parsed(first.reasoning + last.reasoning, first.answer + last.answer)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """A worker's canonical text as (reasoning, answer); reasoning None when the text
    holds no thinking."""
    stripped = text.lstrip()
    if not stripped.startswith((THINK_START, HARMONY_ANALYSIS)):
        return None, text
    parser = ReturnedTextParser()
    first = parser.feed(text)
    last = parser.finish()
    return first.reasoning + last.reasoning, first.answer + last.answer
