"""``priority`` and ``max_queue_time_s`` over HTTP, on a real daemon of one testing worker.

The docs, Priority and queue-time bounds: a bad value is a 400 naming the field; a
higher-priority request goes into the pool before lower ones that waited longer (fair
share applies within one priority); a request whose predicted wait passes its bound is
a 429 ``queue_full`` at once, with a ``Retry-After``, and an accepted one is served; a
more urgent request goes into a full pool and preempts a less urgent one, whose stream
reads as one answer.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_support import Daemon, daemon_config, start_daemon, wait_for

from helpers import FAR_DEADLINE_S, slack


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    server = start_daemon(
        Path(tmp_path_factory.mktemp("priority")),
        daemon_config(workers=1, deadline_s=FAR_DEADLINE_S),
    )
    yield server
    assert server.stop() == 0, server.log()[-4000:]


def _post(daemon: Daemon, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{daemon.url}/v1/completions", json=body, timeout=slack(30))


@pytest.mark.parametrize(
    ("field", "value"),
    [("priority", "high"), ("priority", 0.5), ("priority", False), ("max_queue_time_s", -1)],
)
def test_a_bad_queueing_field_is_a_400_naming_it(
    one_worker: Daemon, field: str, value: object
) -> None:
    response = _post(one_worker, {"prompt": "echo:x", field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_higher_priority_goes_in_first_and_a_late_one_is_refused(one_worker: Daemon) -> None:
    for _ in range(3):  # the predictor's samples: runs of about 0.4 s
        assert _post(one_worker, {"prompt": "tokens:4:0.1"}).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        # 3 s: long enough for the others to queue behind it on a loaded machine; more
        # urgent than all of them, so that none preempts it.
        blocker = threads.submit(_post, one_worker, {"prompt": "tokens:60:0.05", "priority": -5})
        wait_for(
            one_worker.stats,
            lambda s: s["running"] == 1,
            timeout=slack(5),
            what="the blocker running",
        )
        lows = [
            threads.submit(_post, one_worker, {"prompt": f"echo:low{i}", "priority": 3})
            for i in range(3)
        ]
        wait_for(
            one_worker.stats,
            lambda s: s["fair_share"]["waiting"] == 3,
            timeout=slack(5),
            what="three low-priority requests waiting",
        )
        high = threads.submit(_post, one_worker, {"prompt": "echo:high", "priority": -2})
        wait_for(
            one_worker.stats,
            lambda s: s["fair_share"]["waiting"] == 4,
            timeout=slack(5),
            what="the high-priority request waiting",
        )
        refused = _post(one_worker, {"prompt": "echo:late", "max_queue_time_s": 0.05})
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and error["predicted_ttft_s"] > 0.05
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-should-retry"] == "true"
        assert blocker.result().status_code == 200
        answers = [future.result() for future in (high, *lows)]
    assert all(answer.status_code == 200 for answer in answers)
    # The request ids say the order the pool took them in (a counter per pool).
    order = sorted(answers, key=lambda a: int(a.json()["id"].rsplit("-", 1)[-1], 16))
    texts = [a.json()["choices"][0]["text"] for a in order]
    # The three low ones were sent together: their arrival order is the threads'.
    assert texts[0] == "high" and sorted(texts[1:]) == ["low0", "low1", "low2"]
    assert one_worker.stats()["counters"]["queue_full"] == 1


def _stream_texts(daemon: Daemon, body: dict[str, object], started: list[float]) -> list[str]:
    """The text of each event of a streamed completion."""
    texts = []
    with httpx.stream(
        "POST", f"{daemon.url}/v1/completions", json={**body, "stream": True}, timeout=slack(30)
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                texts.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
                started.append(time.monotonic())
    return texts


@pytest.mark.slow
def test_an_urgent_request_preempts_a_streaming_low_one(one_worker: Daemon) -> None:
    expected = "".join(f"t{i} " for i in range(30))
    events: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        low = threads.submit(
            _stream_texts, one_worker, {"prompt": "tokens:30:0.1", "priority": 5}, events
        )
        wait_for(lambda: len(events), lambda n: n >= 3, timeout=slack(10), what="streaming")
        urgent = _post(one_worker, {"prompt": "echo:urgent", "priority": 0})
        answered_at = time.monotonic()
        assert urgent.status_code == 200 and urgent.json()["choices"][0]["text"] == "urgent"
        texts = low.result()
    assert events[-1] > answered_at, "the urgent request did not wait for the long one"
    assert "".join(texts) == expected, "a token twice, or one lost"
    assert one_worker.stats()["counters"]["preemptions"] >= 1
