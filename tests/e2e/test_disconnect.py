"""A client that goes away cancels its request in the worker, which stays warm."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from e2e_support import Daemon, wait_for

from helpers import LONG, LONG_TOKENS, slack

# Until the client goes: it must still run when the daemon sees the disconnect and cancels
# it (a request that ended by itself counts as completed, not cancelled).
CANCEL_WAIT_S = slack(5.0)


def _cancelled_once_more(daemon: Daemon, before: dict[str, Any]) -> dict[str, Any]:
    stats: dict[str, Any] = wait_for(
        daemon.stats,
        lambda s: (
            s["counters"]["cancelled"] == before["counters"]["cancelled"] + 1
            and all(w["state"] == "idle" for w in s["workers"])
        ),
        CANCEL_WAIT_S,
        "the request to be cancelled",
    )
    return stats


def _assert_same_workers(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert {w["pid"] for w in after["workers"]} == {w["pid"] for w in before["workers"]}
    assert after["counters"]["kills"] == before["counters"]["kills"]
    assert after["counters"]["completed"] == before["counters"]["completed"]


def test_disconnect_mid_stream_cancels(daemon: Daemon) -> None:
    before = daemon.wait_settled(2)
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": LONG_TOKENS}
    daemon.assert_outlasts(body, 10.0 + CANCEL_WAIT_S)  # the client's timeout, the wait
    body["stream"] = True
    with (
        httpx.Client(base_url=daemon.url, timeout=10.0) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        received = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                received.append(line)
            if len(received) >= 3:
                break  # Leaving both blocks closes the connection mid-stream.
    after = _cancelled_once_more(daemon, before)
    _assert_same_workers(before, after)


def test_disconnect_while_waiting_for_a_plain_completion_cancels(daemon: Daemon) -> None:
    before = daemon.wait_settled(2)
    body = {"prompt": LONG, "max_tokens": LONG_TOKENS}
    daemon.assert_outlasts(body, 0.5 + CANCEL_WAIT_S)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.url + "/v1/completions", json=body, timeout=0.5)
    after = _cancelled_once_more(daemon, before)
    _assert_same_workers(before, after)
    assert "/v1/completions 499" in daemon.log()
