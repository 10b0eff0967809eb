"""What clients and evaluation tools use beyond plain text, through the real ``openai``
client: retry headers, logprobs (streamed and not), echo, token-id prompts, n > 1.

The daemon runs the testing backend, whose logprobs are made up but fixed: every token
scores -0.25 (see ``modelpool.worker.backends.testing``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from e2e_support import Daemon, wait_for

from helpers import LONG, LONG_TOKENS, slack
from modelpool.worker.backends.testing import TOKEN_LOGPROB

# Until the test cancels it, past every (slack-scaled) wait below: the daemons' 64-token
# default ended tokens:100:0.05 in 3.2 s, not the 5 s its comment promised.
LONG_BODY = {"prompt": LONG, "max_tokens": LONG_TOKENS}
CANCEL_WAIT_S = slack(5.0)


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    # The client's default retry policy (2 retries): what users run with.
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=30.0) as client:
        yield client


def _posts(daemon: Daemon, status: int) -> int:
    return daemon.log().count(f"POST /v1/completions {status} ")


def test_a_passed_deadline_is_sent_once(client: openai.OpenAI, daemon: Daemon) -> None:
    daemon.wait_settled(2)
    before = _posts(daemon, 504)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="m", prompt="hang", extra_body={"timeout": 0.5})
    elapsed = time.monotonic() - started
    assert info.value.status_code == 504
    assert info.value.response.headers["x-should-retry"] == "false"
    # One send, not three (the access-log count below says which); the time only bounds it,
    # with the suite's slack: on a busy machine one 0.5 s deadline can take 2 s to answer.
    assert elapsed < slack(2.0), elapsed
    wait_for(lambda: _posts(daemon, 504), lambda count: count > before, 5.0, "the access log")
    assert _posts(daemon, 504) == before + 1


def test_retry_headers_per_status(http: httpx.Client, daemon: Daemon) -> None:
    daemon.wait_settled(2)
    crashed = http.post("/v1/completions", json={"prompt": "segfault"})
    assert crashed.status_code == 502 and crashed.headers["x-should-retry"] == "false"
    invalid = http.post("/v1/completions", json={"prompt": "x", "n": 0})
    assert invalid.status_code == 400 and invalid.headers["x-should-retry"] == "false"
    failed = http.post("/v1/completions", json={"prompt": "raise:boom"})
    assert failed.status_code == 500 and failed.headers["x-should-retry"] == "false"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="m", prompt="tokens:3", logprobs=2)
    choice = completion.choices[0]
    assert choice.text == "t0 t1 t2 "
    logprobs = choice.logprobs
    assert logprobs is not None
    assert logprobs.tokens == ["t0 ", "t1 ", "t2 "]
    assert logprobs.token_logprobs == [TOKEN_LOGPROB] * 3
    assert logprobs.text_offset == [0, 3, 6]
    assert logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0] == {"t0 ": TOKEN_LOGPROB, "<alt1>": -3.0}


def test_completion_logprobs_streamed(client: openai.OpenAI) -> None:
    text, tokens, logprobs = "", [], []
    for chunk in client.completions.create(model="m", prompt="tokens:4", logprobs=1, stream=True):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
            logprobs += chunk.choices[0].logprobs.token_logprobs or []
    assert text == "t0 t1 t2 t3 " == "".join(tokens)
    assert logprobs == [TOKEN_LOGPROB] * 4


def test_chat_logprobs(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "tokens:2"}]
    reply = client.chat.completions.create(
        model="m", messages=messages, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
    assert content is not None
    assert [(t.token, t.logprob, t.bytes) for t in content] == [
        ("t0 ", TOKEN_LOGPROB, list(b"t0 ")),
        ("t1 ", TOKEN_LOGPROB, list(b"t1 ")),
    ]
    assert [alt.token for alt in content[0].top_logprobs] == ["t0 ", "<alt1>"]

    streamed: list[str] = []
    for chunk in client.chat.completions.create(
        model="m", messages=messages, logprobs=True, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += [t.token for t in chunk.choices[0].logprobs.content]
            assert all(t.top_logprobs == [] for t in chunk.choices[0].logprobs.content)
    assert streamed == ["t0 ", "t1 "]

    plain = client.chat.completions.create(model="m", messages=messages)
    assert plain.choices[0].logprobs is None


def test_echo_scores_the_prompt(client: openai.OpenAI) -> None:
    # lm-eval's loglikelihood request: token ids, echo, logprobs, max_tokens 0.
    scored = client.completions.create(
        model="m", prompt=[[5, 6, 7]], echo=True, max_tokens=0, logprobs=1
    )
    choice = scored.choices[0]
    assert choice.text == "<5><6><7>"
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["<5>", "<6>", "<7>"]
    assert choice.logprobs.token_logprobs == [None, TOKEN_LOGPROB, TOKEN_LOGPROB]
    assert choice.logprobs.top_logprobs is not None and choice.logprobs.top_logprobs[0] is None
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == 3

    echoed = client.completions.create(model="m", prompt="echo:ab", echo=True, logprobs=0)
    assert echoed.choices[0].text == "echo:abab"
    assert echoed.choices[0].logprobs is not None
    assert echoed.choices[0].logprobs.tokens == [*"echo:ab", "ab"]

    streamed = client.completions.create(model="m", prompt="tokens:2", echo=True, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == "tokens:2t0 t1 "


def test_token_id_prompts(client: openai.OpenAI) -> None:
    one = client.completions.create(model="m", prompt=[1, 2, 3])
    assert one.choices[0].text == "1 2 3"
    batch = client.completions.create(model="m", prompt=[[4], [5, 6]])
    assert [(c.index, c.text) for c in batch.choices] == [(0, "4"), (1, "5 6")]
    strings = client.completions.create(model="m", prompt=["echo:a", "echo:b"], n=2)
    assert [(c.index, c.text) for c in strings.choices] == [
        (0, "a"),
        (1, "a"),
        (2, "b"),
        (3, "b"),
    ]


def test_n_choices(client: openai.OpenAI, daemon: Daemon) -> None:
    messages: Any = [{"role": "user", "content": "tokens:3"}]
    before = daemon.wait_settled(2)["counters"]["completed"]
    reply = client.chat.completions.create(model="m", messages=messages, n=3, seed=7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.message.content for c in reply.choices} == {"t0 t1 t2 "}
    assert reply.usage is not None and reply.usage.completion_tokens == 9
    assert daemon.stats()["counters"]["completed"] == before + 3

    texts: dict[int, str] = {}
    finished: set[int] = set()
    for chunk in client.completions.create(model="m", prompt="tokens:2", n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {0: "t0 t1 ", 1: "t0 t1 "} and finished == {0, 1}

    best = client.completions.create(model="m", prompt="tokens:2", n=1, best_of=3)
    assert [(c.index, c.text, c.logprobs) for c in best.choices] == [(0, "t0 t1 ", None)]


def test_a_failing_choice_cancels_the_others(http: httpx.Client, daemon: Daemon) -> None:
    before = daemon.wait_settled(2)["counters"]
    daemon.assert_outlasts(LONG_BODY, 30.0 + CANCEL_WAIT_S)  # the client's timeout, the wait
    body = {**LONG_BODY, "prompt": ["segfault", LONG]}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 502
    after = wait_for(
        daemon.stats,
        lambda s: s["counters"]["cancelled"] == before["cancelled"] + 1,
        CANCEL_WAIT_S,
        "the other choice to be cancelled",
    )
    assert after["counters"]["completed"] == before["completed"]


def test_disconnect_cancels_every_choice(daemon: Daemon) -> None:
    before = daemon.wait_settled(2)["counters"]
    daemon.assert_outlasts(LONG_BODY, 10.0 + CANCEL_WAIT_S)  # the client's timeout, the wait
    body = {**LONG_BODY, "n": 2, "stream": True}
    with (
        httpx.Client(base_url=daemon.url, timeout=10.0) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        indexes = set()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"index":1' in line:
                indexes.add(1)
            if line.startswith("data: ") and '"index":0' in line:
                indexes.add(0)
            if indexes == {0, 1}:
                break  # Both are generating; leaving the blocks disconnects.
    wait_for(
        daemon.stats,
        lambda s: (
            s["counters"]["cancelled"] == before["cancelled"] + 2
            and all(w["state"] == "idle" for w in s["workers"])
        ),
        CANCEL_WAIT_S,
        "both choices to be cancelled",
    )


def test_disconnect_cancels_every_choice_of_a_plain_completion(daemon: Daemon) -> None:
    before = daemon.wait_settled(2)["counters"]
    daemon.assert_outlasts(LONG_BODY, 0.5 + CANCEL_WAIT_S)
    body = {**LONG_BODY, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.url + "/v1/completions", json=body, timeout=0.5)
    wait_for(
        daemon.stats,
        lambda s: (
            s["counters"]["cancelled"] == before["cancelled"] + 2
            and all(w["state"] == "idle" for w in s["workers"])
        ),
        CANCEL_WAIT_S,
        "both choices to be cancelled",
    )
