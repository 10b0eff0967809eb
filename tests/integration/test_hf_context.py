"""The hf backend's context check, in process, on a tiny model with a 64-token context."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from modelpool.shared.errors import ContextLengthExceeded
from modelpool.shared.protocol import Generation, Prompt
from modelpool.tinymodel import build_tiny_model
from modelpool.worker.backends.hf.handler import HFHandler, load

LIMIT = 64


@dataclass
class Call:
    prompt: Prompt
    params: dict[str, Any] = field(default_factory=dict)
    defaulted: frozenset[str] = frozenset()
    chunks: list[str] = field(default_factory=list)

    def cancelled(self) -> bool:
        return False

    def emit(self, text: str) -> None:
        self.chunks.append(text)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-64", context_length=LIMIT)


@pytest.fixture(scope="module")
def handler(model_dir: Path) -> HFHandler:
    return load(str(model_dir))


def prompt_of(handler: HFHandler, tokens: int) -> str:
    """A string prompt of exactly ``tokens`` tokens ("Hello " is 3 of the tiny tokenizer's)."""
    for text in ("a" * tokens, "x " * tokens):
        for cut in range(len(text), 0, -1):
            if len(handler.tokenizer(text[:cut])["input_ids"]) == tokens:
                return text[:cut]
    raise AssertionError(f"no prompt of {tokens} tokens")


def generate(handler: HFHandler, call: Call) -> Generation:
    generation = handler.generate(call)
    assert isinstance(generation, Generation)
    return generation


def test_the_limit_comes_from_the_config(handler: HFHandler) -> None:
    assert handler.max_model_len == LIMIT


def test_the_option_overrides_the_config(model_dir: Path) -> None:
    assert load(str(model_dir), max_model_len=32).max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        load(str(model_dir), max_model_len="long")


def test_one_token_under_and_exactly_at_the_limit_generate_every_token(
    handler: HFHandler,
) -> None:
    prompt = prompt_of(handler, 40)
    for new_tokens in (LIMIT - 40 - 1, LIMIT - 40):
        # min_new_tokens makes the model run to the very end of the context.
        call = Call(prompt, {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens})
        generation = generate(handler, call)
        assert (generation.prompt_tokens, generation.completion_tokens) == (40, new_tokens)
        assert generation.finish_reason == "length"
        assert "".join(call.chunks) == generation.text


def test_one_token_over_is_refused_before_anything_runs(handler: HFHandler) -> None:
    call = Call(prompt_of(handler, 40), {"max_new_tokens": LIMIT - 40 + 1})
    with pytest.raises(ContextLengthExceeded) as caught:
        handler.generate(call)
    error = caught.value
    assert (error.prompt_tokens, error.max_new_tokens, error.max_model_len) == (40, 25, LIMIT)
    assert "maximum context length is 64 tokens" in str(error)
    assert call.chunks == []


def test_max_new_tokens_far_past_the_limit_is_refused(handler: HFHandler) -> None:
    with pytest.raises(ContextLengthExceeded) as caught:
        handler.generate(Call("hi", {"max_new_tokens": 20_000}))
    assert caught.value.max_new_tokens == 20_000


def test_a_prompt_alone_over_the_limit_is_refused(handler: HFHandler) -> None:
    with pytest.raises(ContextLengthExceeded) as caught:
        handler.generate(Call(prompt_of(handler, LIMIT + 1)))
    assert (caught.value.prompt_tokens, caught.value.max_new_tokens) == (LIMIT + 1, None)
    with pytest.raises(ContextLengthExceeded):
        handler.generate(Call(prompt_of(handler, LIMIT)))  # no room for one new token


def test_without_max_new_tokens_the_default_is_capped(handler: HFHandler) -> None:
    prompt = prompt_of(handler, LIMIT - 4)
    # No max_new_tokens at all: the backend's default (128) is cut to the 4 that fit.
    generation = generate(handler, Call(prompt, {"min_new_tokens": 4}))
    assert (generation.finish_reason, generation.completion_tokens) == ("length", 4)
    # The pool's default (marked as such in call.defaulted) is capped the same way.
    defaulted = frozenset({"max_new_tokens"})
    pooled = Call(prompt, {"max_new_tokens": 128, "min_new_tokens": 4}, defaulted)
    generation = generate(handler, pooled)
    assert (generation.finish_reason, generation.completion_tokens) == ("length", 4)
    # A minimum of the caller's that the capped default cannot hold is refused.
    with pytest.raises(ContextLengthExceeded) as caught:
        handler.generate(Call(prompt, {"min_new_tokens": 5}))
    assert caught.value.max_new_tokens == 5


def test_a_chat_prompt_is_measured_after_its_template(handler: HFHandler) -> None:
    messages: Prompt = [{"role": "user", "content": prompt_of(handler, 40)}]
    tokenizer = handler.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    templated = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert templated > 40
    fits = LIMIT - templated
    generation = generate(handler, Call(messages, {"max_new_tokens": fits, "min_new_tokens": fits}))
    assert (generation.prompt_tokens, generation.completion_tokens) == (templated, fits)
    # The content alone (40 tokens) plus fits + 1 would fit; the templated prompt does not.
    assert 40 + fits + 1 <= LIMIT
    with pytest.raises(ContextLengthExceeded) as caught:
        handler.generate(Call(messages, {"max_new_tokens": fits + 1}))
    assert caught.value.prompt_tokens == templated


def test_fit_to_context_fills_the_room_or_cuts_a_maximum_past_it(handler: HFHandler) -> None:
    prompt = prompt_of(handler, LIMIT - 20)
    # No maximum: all 20 tokens the context leaves (the tiny model ends no sentence).
    fitted = generate(handler, Call(prompt, {"fit_to_context": True}))
    assert (fitted.finish_reason, fitted.completion_tokens) == ("length", 20)
    # A maximum past the context, as Claude Code asks: cut to the 20 that fit.
    cut = generate(handler, Call(prompt, {"max_new_tokens": 32000, "fit_to_context": True}))
    assert (cut.finish_reason, cut.completion_tokens) == ("length", 20)
    with pytest.raises(ContextLengthExceeded) as refused:
        handler.generate(Call(prompt, {"max_new_tokens": 32000}))
    assert (refused.value.prompt_tokens, refused.value.max_new_tokens) == (LIMIT - 20, 32000)
