"""The context-length check and where a worker learns the limit, without a pool."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from modelpool import ContextLengthExceeded, InvalidRequest
from modelpool.shared.context import context_length, fit_to_context
from modelpool.shared.protocol import Generation, Prompt
from modelpool.worker.backends.testing import load as load_testing
from modelpool.worker.backends.testing_prompts import count_tokens


def test_explicit_max_new_tokens_up_to_the_limit_is_kept() -> None:
    assert fit_to_context(100, 27, 128, default=64) == 27  # one under
    assert fit_to_context(100, 28, 128, default=64) == 28  # exactly the limit


def test_one_token_past_the_limit_is_refused_with_the_numbers() -> None:
    with pytest.raises(ContextLengthExceeded) as caught:
        fit_to_context(100, 29, 128, default=64)
    error = caught.value
    assert (error.prompt_tokens, error.max_new_tokens, error.max_model_len) == (100, 29, 128)
    assert isinstance(error, InvalidRequest) and isinstance(error, ValueError)
    message = str(error)
    assert "maximum context length is 128 tokens" in message
    assert "129 tokens" in message and "100 in the prompt" in message and "29" in message


def test_a_default_is_capped_to_what_the_context_leaves() -> None:
    assert fit_to_context(100, None, 128, default=64) == 28
    assert fit_to_context(100, None, 1000, default=64) == 64
    assert fit_to_context(127, None, 128, default=64) == 1


def test_a_prompt_that_leaves_no_room_is_refused_even_without_max_new_tokens() -> None:
    for prompt_tokens in (128, 129, 10_000):
        with pytest.raises(ContextLengthExceeded) as caught:
            fit_to_context(prompt_tokens, None, 128, default=64)
        assert caught.value.max_new_tokens is None
        assert f"prompt is {prompt_tokens} tokens" in str(caught.value)


def test_an_unknown_limit_checks_nothing() -> None:
    assert fit_to_context(10**6, 10**6, None, default=64) == 10**6
    assert fit_to_context(10**6, None, None, default=64) == 64


def test_the_refusal_pickles_with_its_numbers() -> None:
    error = ContextLengthExceeded(prompt_tokens=9000, max_new_tokens=4, max_model_len=8192)
    error.request_id = "req-1"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ContextLengthExceeded
    assert (copy.prompt_tokens, copy.max_new_tokens, copy.max_model_len) == (9000, 4, 8192)
    assert copy.request_id == "req-1" and str(copy) == str(error)


# ---- where the limit comes from -------------------------------------------------------------


def test_the_limit_is_read_from_the_model_config() -> None:
    assert context_length(SimpleNamespace(max_position_embeddings=8192)) == 8192
    assert context_length(SimpleNamespace(n_positions=1024)) == 1024  # gpt2
    # A config with a position table and a shorter sequence limit: the shorter one holds.
    assert context_length(SimpleNamespace(max_position_embeddings=4096, seq_length=2048)) == 2048
    assert context_length(SimpleNamespace(hidden_size=64)) is None


def test_a_multimodal_config_is_read_through_its_text_config() -> None:
    text = SimpleNamespace(max_position_embeddings=32768)

    class Outer:
        max_position_embeddings = None

        def get_text_config(self) -> SimpleNamespace:
            return text

    assert context_length(Outer()) == 32768


def test_the_option_overrides_the_config(caplog: pytest.LogCaptureFixture) -> None:
    config = SimpleNamespace(max_position_embeddings=8192)
    assert context_length(config, 2048) == 2048
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="modelpool.shared.context"):
        assert context_length(config, 16384) == 16384
    assert "above the model config's 8192" in caplog.text
    assert context_length(SimpleNamespace(), 512) == 512


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8192", True])
def test_a_bad_override_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        context_length(SimpleNamespace(max_position_embeddings=8192), bad)
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        load_testing(max_model_len=bad)


# ---- the testing backend's side, in process ---------------------------------------------------


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


def test_the_testing_backend_counts_words_and_a_template() -> None:
    assert count_tokens("echo:a b c") == 3
    chat: Prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert count_tokens(chat) == (2 + 2) + (2 + 1) + 1


def test_the_testing_backend_caps_a_default_and_refuses_the_callers_own() -> None:
    backend = load_testing(max_model_len=8)
    assert backend.max_model_len == 8
    defaulted = frozenset({"max_new_tokens"})
    capped = backend.generate(Call("tokens:20", {"max_new_tokens": 64}, defaulted))
    assert isinstance(capped, Generation)
    assert (capped.finish_reason, capped.prompt_tokens, capped.completion_tokens) == (
        "length",
        1,
        7,
    )
    refused = Call("tokens:20", {"max_new_tokens": 64})
    with pytest.raises(ContextLengthExceeded):
        backend.generate(refused)
    assert refused.chunks == [], "nothing is generated before the refusal"
    assert load_testing().max_model_len is None


def test_modelpool_stats_shows_the_context_length() -> None:
    from modelpool.cli.tables import stats_tables

    _, _, rows = stats_tables({"max_model_len": 8192})[0]
    assert ["context length", "8192 tokens"] in rows
    _, _, rows = stats_tables({"max_model_len": None})[0]
    assert ["context length", "-"] in rows


def test_the_testing_backend_reads_the_environment_only_when_a_test_enables_it() -> None:
    # The testing backend is a flag of the production daemon: env: must not be a way to
    # read a worker's environment there (issue 25).
    with pytest.raises(RuntimeError, match="env_command"):
        load_testing().generate(Call("env:PATH"))
    enabled = load_testing(env_command=True).generate(Call("env:PATH"))
    assert enabled and enabled != "env:PATH"


def test_a_request_that_fits_the_context_gets_its_room_and_any_other_the_default() -> None:
    from modelpool.worker.backends.common.params import DEFAULT_MAX_NEW_TOKENS, fit_new_tokens

    fit = {"fit_to_context": True}
    # Nothing asked: the library's default, or with fit_to_context all the room left.
    assert fit_new_tokens(Call("p"), {}, 100, 4096) == DEFAULT_MAX_NEW_TOKENS == 128
    assert fit_new_tokens(Call("p"), fit, 100, 4096) == 3996
    assert fit_new_tokens(Call("p"), fit, 100, None) == DEFAULT_MAX_NEW_TOKENS
    # A maximum past the context: refused, or with fit_to_context cut to what fits.
    with pytest.raises(ContextLengthExceeded) as refused:
        fit_new_tokens(Call("p"), {"max_new_tokens": 32000}, 31, 8192)
    assert (refused.value.prompt_tokens, refused.value.max_new_tokens) == (31, 32000)
    assert fit_new_tokens(Call("p"), {"max_new_tokens": 32000, **fit}, 31, 8192) == 8161
    assert fit_new_tokens(Call("p"), {"max_new_tokens": 64, **fit}, 31, 8192) == 64
    # The prompt alone past the context: refused either way, as the prompt's.
    with pytest.raises(ContextLengthExceeded) as too_long:
        fit_new_tokens(Call("p"), {"max_new_tokens": 32000, **fit}, 9000, 8192)
    assert too_long.value.max_new_tokens is None


def test_the_testing_backend_fits_the_context_as_the_real_ones_do() -> None:
    backend = load_testing(max_model_len=4096)
    fitted = backend.generate(Call("tokens:9000", {"fit_to_context": True}))
    assert isinstance(fitted, Generation)
    assert fitted.prompt_tokens is not None and fitted.completion_tokens is not None
    assert fitted.prompt_tokens + fitted.completion_tokens == 4096
    assert fitted.finish_reason == "length"
    default = load_testing().generate(Call("tokens:9000"))
    assert isinstance(default, Generation) and default.completion_tokens == 128
