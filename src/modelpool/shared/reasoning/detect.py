"""Which reasoning family a model is (``reasoning_parser = "auto"``), from its chat
template and its vocabulary, and the text of its end of thinking."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from modelpool.shared.reasoning.parsers import (
    HARMONY_ANALYSIS,
    HARMONY_FINAL,
    HARMONY_THINKING_END,
    THINK_END,
    THINK_START,
    Family,
    ParserName,
)


@dataclass(frozen=True)
class ReasoningFamily:
    """A model's thinking: its family, the text that opens it and the text that ends it
    (the worker forces it at a bound, and a model that writes it has ended thinking);
    ``answer_text``: what a forced close adds when no tool call may follow (Harmony's
    ``final`` channel; a request with tools lets the model name the channel itself)."""

    family: Family
    start_text: str
    end_text: str
    answer_text: str = ""


def family_named(name: Family) -> ReasoningFamily:
    if name == "gpt_oss":
        return ReasoningFamily("gpt_oss", HARMONY_ANALYSIS, HARMONY_THINKING_END, HARMONY_FINAL)
    return ReasoningFamily(name, THINK_START, THINK_END)


def detect_family(
    configured: ParserName, chat_template: str | None, vocabulary: Collection[str]
) -> ReasoningFamily | None:
    """The family ``configured`` names, or for "auto" the one the template and the
    vocabulary show: Harmony's channel tokens are gpt-oss; ``<think>`` and ``</think>``
    both in the vocabulary, or a template that writes them, are a think-tag model
    (Qwen3's when its template reads ``enable_thinking``, else DeepSeek-R1's). None:
    not a reasoning model (or ``"none"``)."""
    if configured == "none":
        return None
    if configured != "auto":
        return family_named(configured)
    template = chat_template or ""
    if "<|channel|>" in vocabulary and "<|message|>" in vocabulary:
        return family_named("gpt_oss")
    tagged = (THINK_START in vocabulary and THINK_END in vocabulary) or THINK_END in template
    if not tagged:
        return None
    return family_named("qwen3" if "enable_thinking" in template else "deepseek_r1")
