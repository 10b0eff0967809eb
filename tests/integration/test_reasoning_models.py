"""The worker's bound on thinking over real backends: tiny random models with Qwen3's and
DeepSeek-R1's chat templates and ``<think>`` tokens (``tinymodel.build_thinking_model``)
in process on the hf backend, both forms (one request at a time, and batched), and the
embedded GGUF on llama_cpp with a template that opens thinking. Random weights never
close their thinking: every end of thinking here is the worker's, and the answer
follows it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helpers import FakeCall, Recorder, step_until_answered
from modelpool.shared.reasoning.parsers import split_reasoning
from modelpool.tinymodel import ThinkingFamily, build_thinking_model
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def handler(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFHandler:
    family: ThinkingFamily = request.param
    path = build_thinking_model(tmp_path_factory.mktemp("thinking") / family, family)
    return load(str(path))


def _alone(handler: HFHandler, **params: Any) -> Any:
    call = FakeCall(CHAT, params)
    generation = handler.generate(call)
    assert "".join(call.chunks) == generation.text  # the canonical text, streamed as returned
    return generation


def test_template_opened_thinking_is_bounded_at_the_budget(handler: HFHandler) -> None:
    generation = _alone(handler, max_new_tokens=40, thinking_token_budget=5)
    assert generation.text.startswith("<think>")
    assert generation.reasoning_tokens == 5
    assert generation.thinking_closed == "budget"
    reasoning, answer = split_reasoning(generation.text)
    assert reasoning is not None and answer


def test_a_random_model_loops_and_is_closed(handler: HFHandler) -> None:
    generation = _alone(handler, max_new_tokens=400)
    assert generation.thinking_closed == "loop"
    assert generation.reasoning_tokens < 300
    assert split_reasoning(generation.text)[1]


def test_max_tokens_keeps_the_answer_reserve(handler: HFHandler) -> None:
    generation = _alone(handler, max_new_tokens=24)
    assert generation.thinking_closed == "reserve"
    answer = split_reasoning(generation.text)[1]
    assert answer  # never "length" with an empty answer because of thinking alone
    assert generation.reasoning_tokens + 1 + 6 <= 24


def test_structured_output_constrains_the_answer_not_the_thinking(handler: HFHandler) -> None:
    from modelpool.shared.structured import grammar_for_response_format

    grammar = grammar_for_response_format({"type": "json_object"})
    generation = _alone(handler, max_new_tokens=80, thinking_token_budget=6, grammar=grammar)
    reasoning, answer = split_reasoning(generation.text)
    assert reasoning  # the thinking is free text
    assert isinstance(json.loads(answer), dict)


def test_enable_thinking_false(handler: HFHandler) -> None:
    generation = _alone(handler, max_new_tokens=20, enable_thinking=False)
    assert generation.reasoning_tokens == 0
    if "enable_thinking" in handler.tokenizer.chat_template:
        # Qwen3's template writes the thinking closed: none is started.
        assert not generation.text.startswith("<think>")
        assert generation.thinking_closed is None
    else:
        # DeepSeek-R1's opens it anyway: the worker closes it at once.
        assert generation.text.startswith("<think></think>")
        assert generation.thinking_closed == "budget"


def test_batched_rows_are_bounded_each_by_its_own_budget(handler: HFHandler) -> None:
    calls = [
        Recorder(CHAT, {"max_new_tokens": 30, "thinking_token_budget": budget})
        for budget in (2, 7, 0)
    ]
    for call in calls:
        handler.admit(call)
    answers = step_until_answered(handler, len(calls))
    for call in calls:
        generation = answers[id(call)]
        assert generation.reasoning_tokens == call.params["thinking_token_budget"]
        assert generation.thinking_closed == "budget"


def test_parser_none_leaves_the_text_alone(handler: HFHandler) -> None:
    generation = _alone(handler, max_new_tokens=10, reasoning_parser="none")
    assert generation.reasoning_tokens is None
    assert not generation.text.startswith("<think>")


def test_llama_cpp_bounds_thinking_written_as_text() -> None:
    from modelpool.shared.embedded import prepare_gguf
    from modelpool.worker.backends.llama_cpp import load as load_gguf

    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    gguf = load_gguf(str(prepare_gguf()), threads=1, chat_template=template)
    call = FakeCall(
        [{"role": "user", "content": "What is 2+2?"}],
        {"max_new_tokens": 40, "thinking_token_budget": 6, "reasoning_parser": "deepseek_r1"},
    )
    generation = gguf.generate(call)
    assert generation.reasoning_tokens == 6
    assert generation.thinking_closed == "budget"
    assert generation.text.startswith("<think>") and "</think>" in generation.text


def test_llama_cpp_keeps_the_special_tokens_asked_for_and_drops_the_others() -> None:
    """The llama_cpp decode path of gpt-oss's Harmony tokens (no Harmony GGUF is built
    here: the embedded GGUF's own control tokens stand in for them)."""
    from modelpool.shared.embedded import prepare_gguf
    from modelpool.worker.backends.common.text import TextProgress
    from modelpool.worker.backends.llama_cpp import load as load_gguf

    runtime = load_gguf(str(prepare_gguf()), threads=1).runtime
    controls = runtime.control_tokens()
    assert {"<|im_start|>", "<|im_end|>"} <= controls.keys()
    ids = runtime.tokenize("<|im_start|>Hi<|im_end|>", add_special=False)
    assert controls["<|im_end|>"] in ids

    def decoded(keep: frozenset[str]) -> str:
        progress = TextProgress(runtime.decoder(), FakeCall(CHAT, {}), 0, ())
        if keep:
            progress.keep_special(keep)
        progress.take(ids)
        progress.flush()
        return progress.text

    assert decoded(frozenset()) == "Hi"
    assert decoded(frozenset({"<|im_end|>"})) == "Hi<|im_end|>"


WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def test_enable_thinking_reaches_the_template_on_the_tools_path(handler: HFHandler) -> None:
    ids = handler.encode(CHAT, [WEATHER], template_kwargs={"enable_thinking": False})
    prompt = handler.tokenizer.decode(ids[0])
    if "enable_thinking" in handler.tokenizer.chat_template:
        assert prompt.rstrip().endswith("</think>")  # Qwen3's: written closed
    else:
        assert prompt.rstrip().endswith("<think>")  # DeepSeek-R1's opens it anyway


def test_llama_cpp_template_reads_enable_thinking() -> None:
    from modelpool.shared.embedded import prepare_gguf
    from modelpool.tinymodel import QWEN3_TEMPLATE
    from modelpool.worker.backends.llama_cpp import load as load_gguf

    gguf = load_gguf(str(prepare_gguf()), threads=1, chat_template=QWEN3_TEMPLATE)
    asked = {"max_new_tokens": 8, "reasoning_parser": "qwen3", "enable_thinking": False}
    for tools in (None, [WEATHER]):
        params = {**asked, **({"tools": tools} if tools else {})}
        generation = gguf.generate(FakeCall(CHAT, params))
        # The template wrote the thinking closed: nothing to close, none counted.
        assert generation.reasoning_tokens == 0
        assert generation.thinking_closed is None
        assert not generation.text.startswith("<think>")
    opened = gguf.generate(FakeCall(CHAT, {**asked, "enable_thinking": True}))
    assert opened.text.startswith("<think>")
