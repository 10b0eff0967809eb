"""Reasoning without a model: the parsers (whole and cut at every place), detection, the
controls, the loop detector, and the worker's bound (``common.thinking``) over the
testing backend's scripted thinker."""

from __future__ import annotations

import time

import pytest

from helpers import FakeCall
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.reasoning.controls import (
    ControlError,
    ThinkingBound,
    chat_controls,
    check_settings,
    check_thinking_params,
    messages_controls,
    ollama_controls,
    responses_controls,
)
from modelpool.shared.reasoning.detect import detect_family
from modelpool.shared.reasoning.loops import LoopDetector
from modelpool.shared.reasoning.parsers import (
    HARMONY_FINAL,
    HARMONY_THINKING_END,
    HarmonyParser,
    ReasoningParser,
    ReturnedTextParser,
    ThinkTagParser,
    split_reasoning,
)
from modelpool.worker.backends import testing_thinking
from modelpool.worker.backends.common.thinking import ThinkingModel, ThinkingTracker

CANONICAL = "<think>\nI add 2 and 2.\nIt is 4.\n</think>\n\nThe answer is 4."
HARMONY = (
    "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>4.<|return|>"
)


def _pieces(parser: ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str]:
    reasoning, answer = [], []
    start = 0
    for cut in [*cuts, len(text)]:
        parsed = parser.feed(text[start:cut])
        reasoning.append(parsed.reasoning)
        answer.append(parsed.answer)
        start = cut
    last = parser.finish()
    return "".join(reasoning) + last.reasoning, "".join(answer) + last.answer


@pytest.mark.parametrize("cut", range(len(CANONICAL)))
def test_think_tags_split_the_same_wherever_the_text_is_cut(cut: int) -> None:
    assert _pieces(ThinkTagParser(), CANONICAL, [cut]) == (
        "I add 2 and 2.\nIt is 4.",
        "The answer is 4.",
    )


def test_think_tags_one_character_at_a_time() -> None:
    text = CANONICAL
    assert _pieces(ThinkTagParser(), text, list(range(1, len(text)))) == (
        "I add 2 and 2.\nIt is 4.",
        "The answer is 4.",
    )


def test_thinking_opened_in_the_prompt_and_text_without_thinking() -> None:
    started = ThinkTagParser(started=True)
    assert _pieces(started, "plan it</think>done", [3, 12]) == ("plan it", "done")
    assert _pieces(ThinkTagParser(), "Just an answer <think> here", [2]) == (
        "",
        "Just an answer <think> here",
    )
    unclosed = ThinkTagParser()
    assert _pieces(unclosed, "<think>still thinking", [9]) == ("still thinking", "")
    assert split_reasoning("no thinking") == (None, "no thinking")
    assert split_reasoning("<think></think>answer") == ("", "answer")


@pytest.mark.parametrize("cut", range(0, len(HARMONY), 3))
def test_harmony_channels(cut: int) -> None:
    assert _pieces(HarmonyParser(), HARMONY, [cut]) == ("User asks 2+2. Easy.", "4.")


@pytest.mark.parametrize("cut", range(0, 40, 3))
def test_returned_text_in_either_form(cut: int) -> None:
    assert _pieces(ReturnedTextParser(), HARMONY, [cut]) == ("User asks 2+2. Easy.", "4.")
    assert _pieces(ReturnedTextParser(), CANONICAL, [cut]) == (
        "I add 2 and 2.\nIt is 4.",
        "The answer is 4.",
    )
    assert _pieces(ReturnedTextParser(), "<|ok", []) == ("", "<|ok")
    assert split_reasoning(HARMONY) == ("User asks 2+2. Easy.", "4.")


def test_detection_from_template_and_vocabulary() -> None:
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    found = detect_family("auto", qwen3, ())
    assert found is not None and found.family == "qwen3"
    # DeepSeek-R1 writes its markers in full-width bars: any template text will do.
    deepseek = detect_family("auto", "<|Assistant|><think>\n", {"<think>", "</think>"})
    assert deepseek is not None and deepseek.family == "deepseek_r1"
    harmony = detect_family("auto", None, {"<|channel|>", "<|message|>"})
    assert harmony is not None and harmony.end_text == HARMONY_THINKING_END
    assert harmony.answer_text == HARMONY_FINAL
    assert detect_family("auto", "{{ messages }}", {"<s>"}) is None
    assert detect_family("none", qwen3, {"<think>", "</think>"}) is None
    assert detect_family("qwen3", None, ()) is not None


def test_controls_of_each_api() -> None:
    assert chat_controls({"reasoning_effort": "low"}) == {"reasoning_effort": "low"}
    assert chat_controls(
        {"thinking_token_budget": 7, "chat_template_kwargs": {"enable_thinking": False}}
    ) == {"thinking_token_budget": 7, "enable_thinking": False}
    assert responses_controls({"effort": "high", "summary": "auto"}) == {"reasoning_effort": "high"}
    assert messages_controls({"type": "enabled", "budget_tokens": 1024}) == {
        "thinking_token_budget": 1024
    }
    assert messages_controls({"type": "disabled"}) == {"enable_thinking": False}
    assert ollama_controls(True) == {} and ollama_controls("low") == {"reasoning_effort": "low"}
    with pytest.raises(ControlError) as bad:
        chat_controls({"chat_template_kwargs": {"tools_in_user_message": True}})
    assert bad.value.param == "chat_template_kwargs.tools_in_user_message"
    with pytest.raises(ControlError):
        messages_controls({"type": "enabled", "budget_tokens": "lots"})
    with pytest.raises(InvalidRequest):
        check_thinking_params({"thinking_deadline": "soon"})
    with pytest.raises(ValueError, match="reasoning_budgets"):
        check_settings("auto", {"extreme": 5}, 256)
    with pytest.raises(ValueError, match="reasoning_parser"):
        check_settings("deepseek", {}, 256)


def test_effort_budgets_and_their_overrides() -> None:
    assert ThinkingBound.of({"reasoning_effort": "medium"}).budget == 2048
    assert ThinkingBound.of({"reasoning_effort": "none"}).budget == 0
    bound = ThinkingBound.of({"reasoning_effort": "low", "reasoning_budgets": {"low": 10}})
    assert bound.budget == 10
    assert ThinkingBound.of({"reasoning_effort": "low", "thinking_token_budget": 3}).budget == 3
    assert ThinkingBound.of({"enable_thinking": False, "thinking_token_budget": 3}).budget == 0
    assert ThinkingBound.of({}).budget is None


def test_loop_detector_finds_repeats_and_not_varied_text() -> None:
    loops = LoopDetector(min_tokens=32)
    assert not any(loops.take(token) for token in range(500))
    looped = LoopDetector(min_tokens=32)
    hits = [looped.take(token) for token in [*range(10), *[1, 2, 3, 4, 5] * 20]]
    assert any(hits)
    assert hits.index(True) < 10 + 32 + 5


MODEL: ThinkingModel[str] = testing_thinking.SCRIPTED_MODEL


def _think(tracker: ThinkingTracker[str], pieces: int) -> list[str]:
    """Feed ``tracker`` a thinker that never stops, taking forced tokens as a runner does."""
    taken = []
    for index in range(pieces):
        token = tracker.forced() or f"w{index}"
        taken.append(token)
        tracker.take(token)
        if tracker.ended:
            break
    return taken


@pytest.mark.parametrize("budget", [0, 1, 5, 100])
def test_budget_is_never_passed(budget: int) -> None:
    tracker = ThinkingTracker(MODEL, True, {"thinking_token_budget": budget}, 10_000)
    taken = _think(tracker, 1000)
    assert taken[-1] == "</think>"
    assert tracker.tokens == budget == len(taken) - 1
    assert tracker.closed_by == "budget"


def test_reserve_leaves_room_for_the_answer() -> None:
    tracker = ThinkingTracker(MODEL, True, {}, 40)
    taken = _think(tracker, 40)
    assert tracker.closed_by == "reserve"
    assert 40 - len(taken) >= 10  # a quarter of max_new_tokens left for the answer


def test_thinking_the_model_opens_is_counted_from_its_start() -> None:
    tracker = ThinkingTracker(MODEL, False, {"thinking_token_budget": 2}, 1000)
    assert not tracker.thinking
    tracker.take("<think>")
    assert tracker.thinking
    assert _think(tracker, 10) == ["w0", "w1", "</think>"]


def test_deadline_closes_thinking_at_the_measured_rate() -> None:
    call = FakeCall(
        "think:400:the end:0.01",
        {"thinking_deadline": time.time() + 0.6, "reasoning_answer_reserve": 4},
    )
    generation = testing_thinking.think(call, "think", "400:the end:0.01", 1000)
    assert generation.thinking_closed == "deadline"
    assert generation.text.endswith("</think>the end")
    assert generation.finish_reason == "stop"


def test_scripted_thinker_with_parser_none_is_left_alone() -> None:
    call = FakeCall("think:3:ok", {"reasoning_parser": "none", "thinking_token_budget": 1})
    generation = testing_thinking.think(call, "think", "3:ok", 100)
    assert generation.text == "w0 w1 w2 </think>ok"
    assert generation.reasoning_tokens is None


HARMONY_CALL = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
    '"Paris"}<|call|>'
)


def test_harmony_forced_close_stops_where_a_call_may_follow() -> None:
    model = testing_thinking.SCRIPTED_HARMONY
    plain = ThinkingTracker(model, False, {"thinking_token_budget": 2}, 1000)
    plain.take("<|channel|>analysis<|message|>")
    # No tools: straight into the final channel, the grammar (if any) not led.
    assert _think(plain, 10) == ["w0", "w1", "<|end|>", "<|start|>assistant", HARMONY_FINAL]
    assert plain.grammar_lead == ()
    tools = {"thinking_token_budget": 2, "tools": [{"type": "function"}]}
    calling = ThinkingTracker(model, False, tools, 1000)
    calling.take("<|channel|>analysis<|message|>")
    # Tools: the close ends at the next message's start; the model names the channel.
    assert _think(calling, 10) == ["w0", "w1", "<|end|>", "<|start|>assistant"]
    assert calling.closed_by == "budget" and calling.tokens == 2
    assert calling.grammar_lead == (
        "<|channel|>analysis<|message|>",
        "<|end|>",
        "<|start|>assistant",
    )


def test_harmony_thinking_the_model_ends_itself_before_a_call() -> None:
    tracker = ThinkingTracker(testing_thinking.SCRIPTED_HARMONY, False, {}, 1000)
    ended = [tracker.take(t) for t in ("<|channel|>analysis<|message|>", "Hm.", "<|end|>")]
    assert ended == [False, False, False] and tracker.thinking
    assert tracker.take("<|start|>assistant")
    assert tracker.ended and tracker.closed_by is None and tracker.tokens == 1


def test_scripted_harmony_call_after_a_forced_close_and_after_its_own_end() -> None:
    params = {"thinking_token_budget": 3, "tools": [{"type": "function"}]}
    call = FakeCall("harmony:40:" + HARMONY_CALL, params)
    forced = testing_thinking.think(call, "harmony", "40:" + HARMONY_CALL, 1000)
    assert forced.thinking_closed == "budget" and forced.reasoning_tokens == 3
    assert forced.text == (
        "<|channel|>analysis<|message|>w0 w1 w2 <|end|><|start|>assistant" + HARMONY_CALL
    )
    assert split_reasoning(forced.text) == ("w0 w1 w2 ", HARMONY_CALL)
    own = testing_thinking.think(FakeCall("", {}), "harmony", "2:" + HARMONY_CALL, 1000)
    assert own.thinking_closed is None and own.reasoning_tokens == 2
    assert split_reasoning(own.text) == ("w0 w1 ", HARMONY_CALL)
    # Without tools the close writes the final channel, which the answer does not repeat.
    final = testing_thinking.think(
        FakeCall("", {"thinking_token_budget": 1}), "harmony", "9:<|channel|>final<|message|>4.", 99
    )
    assert split_reasoning(final.text) == ("w0 ", "4.")


def test_harmony_analysis_opened_again_counts_against_the_same_budget() -> None:
    # Harmony's markers as a model's tokens: several per sequence.
    model = ThinkingModel(
        testing_thinking.SCRIPTED_HARMONY.family,
        ("<|channel|>", "analysis", "<|message|>"),
        ("<|end|>", "<|start|>", "assistant"),
        ("<|channel|>", "final", "<|message|>"),
    )
    tracker = ThinkingTracker(model, False, {"thinking_token_budget": 3}, 1000)
    for token in ("<|channel|>", "analysis", "<|message|>", "w0", "w1", "<|end|>", "<|start|>"):
        assert not tracker.take(token)
    assert tracker.take("assistant") and tracker.closed_by is None
    for token in ("<|channel|>", "<|channel|>", "analysis", "<|message|>"):
        tracker.take(token)  # the model opens analysis again (a stray header first)
    assert tracker.thinking and tracker.tokens == 2
    assert _think(tracker, 10) == [
        "w0",
        "<|end|>",
        "<|start|>",
        "assistant",
        "<|channel|>",
        "final",
        "<|message|>",
    ]
    assert tracker.tokens == 3 and tracker.closed_by == "budget"
