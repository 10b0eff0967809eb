"""Context limits through a real pool, on the testing backend with a declared context.

The testing backend counts one token per word of a string prompt; a chat prompt
also counts its template (a role marker and an end marker per message, one for
the assistant's turn). See tests/e2e/test_context_length.py for the HTTP side on
a real model.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from helpers import counters, open_pool, workers
from modelpool import ContextLengthExceeded, InvalidRequest, ModelPool, RetryPolicy
from modelpool.shared.protocol import Prompt

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

LIMIT = 16


@pytest.fixture(scope="module")
def pool() -> Iterator[ModelPool]:
    # Every failed attempt kind is retried, so a refusal that counted as one would show.
    with open_pool(
        workers=2,
        backend_options={"max_model_len": LIMIT},
        retry=RetryPolicy(max_retries=2, on=("timeout", "crash", "error")),
        generation_defaults={"max_new_tokens": 64},
    ) as started:
        yield started


def words(count: int) -> str:
    """An echo prompt of exactly ``count`` tokens for the testing backend."""
    return "echo:" + " w" * (count - 1)


def refused(pool: ModelPool, prompt: Prompt, **params: int) -> ContextLengthExceeded:
    before = counters(pool)
    pids = {w.pid for w in workers(pool)}
    with pytest.raises(ContextLengthExceeded) as caught:
        pool.generate(prompt, **params)
    after = counters(pool)
    error = caught.value
    assert isinstance(error, InvalidRequest)
    assert error.attempts == [], "a refusal is not a failed attempt"
    assert error.request_id is not None
    assert after["retries"] == before["retries"], "a refusal is not retried"
    assert after["failed"] == before["failed"] + 1
    assert after["respawns"] == before["respawns"] and {w.pid for w in workers(pool)} == pids
    return error


def test_stats_show_the_context_length(pool: ModelPool) -> None:
    snapshot = pool.stats()
    assert snapshot.max_model_len == LIMIT
    assert [w.max_model_len for w in snapshot.workers] == [LIMIT, LIMIT]
    assert snapshot.to_dict()["max_model_len"] == LIMIT


def test_a_backend_without_a_limit_reports_none() -> None:
    with open_pool(workers=1) as plain:
        assert plain.stats().max_model_len is None
        assert plain.stats().workers[0].max_model_len is None
        assert plain.generate(words(500), max_new_tokens=10_000).text


def test_one_token_under_fits_and_one_over_is_refused(pool: ModelPool) -> None:
    assert pool.generate(words(10), max_new_tokens=5).finish_reason == "stop"  # 15 of 16
    assert pool.generate(words(10), max_new_tokens=6).finish_reason == "stop"  # 16 of 16
    error = refused(pool, words(10), max_new_tokens=7)  # 17 of 16
    assert (error.prompt_tokens, error.max_new_tokens, error.max_model_len) == (10, 7, LIMIT)
    assert "maximum context length is 16 tokens" in str(error)
    assert "17 tokens (10 in the prompt, 7 for the completion)" in str(error)


def test_streaming_refuses_the_same_way(pool: ModelPool) -> None:
    assert "".join(pool.stream(words(10), max_new_tokens=5)) == " w" * 9
    stream = pool.stream(words(10), max_new_tokens=7)
    with pytest.raises(ContextLengthExceeded) as caught:
        list(stream)
    assert caught.value.attempts == []


def test_max_new_tokens_past_the_limit_is_refused_at_once(pool: ModelPool) -> None:
    error = refused(pool, "tokens:20000:1.0", max_new_tokens=20_000)
    assert (error.prompt_tokens, error.max_new_tokens) == (1, 20_000)


def test_a_prompt_alone_past_the_limit_is_refused(pool: ModelPool) -> None:
    error = refused(pool, words(LIMIT))  # no room for a single new token
    assert (error.prompt_tokens, error.max_new_tokens) == (LIMIT, None)
    refused(pool, words(LIMIT + 500))


def test_the_default_is_capped_to_what_fits(pool: ModelPool) -> None:
    # The pool's default of 64 new tokens is cut to the 15 the context leaves.
    result = pool.generate("tokens:100")
    assert result.finish_reason == "length"
    assert (result.prompt_tokens, result.completion_tokens) == (1, LIMIT - 1)
    assert result.text == "".join(f"t{i} " for i in range(LIMIT - 1))
    streamed = pool.stream("tokens:100")
    assert "".join(streamed) == result.text
    assert streamed.result is not None and streamed.result.finish_reason == "length"


def test_a_default_that_fits_is_not_touched() -> None:
    with open_pool(
        workers=1,
        backend_options={"max_model_len": LIMIT},
        generation_defaults={"max_new_tokens": 3},
    ) as small_default:
        result = small_default.generate("tokens:100")
        assert (result.finish_reason, result.completion_tokens) == ("length", 3)
        assert small_default.generate("tokens:2").finish_reason == "stop"


def test_a_chat_prompt_is_measured_after_its_template(pool: ModelPool) -> None:
    # 10 words of content, 2 messages: 10 + 2 * 2 + 1 = 15 tokens once templated.
    chat: Prompt = [
        {"role": "system", "content": "a b c d e f g h i"},
        {"role": "user", "content": "echo:x"},
    ]
    assert pool.generate(chat, max_new_tokens=1).text == "x"
    # 10 + 5 would fit the content alone; the template makes it 20.
    error = refused(pool, chat, max_new_tokens=5)
    assert error.prompt_tokens == 15


def test_the_pool_keeps_serving_after_refusals(pool: ModelPool) -> None:
    for _ in range(5):
        refused(pool, words(LIMIT + 1))
    assert pool.generate("echo:still here").text == "still here"
    assert all(w.state in ("idle", "busy") for w in workers(pool))
