"""The third review's pooling attacks (issue 58, item 1), for ``scripts/abuse``.

They run against a daemon of the testing backend's embedding model whose forward passes
take the time a small model's take on two CPU cores (0.25 ms a token, the cancel flag
read only between passes of up to 16,384 tokens: the review measured MiniLM's at 2-4 s),
one worker; the ordinary clients embed one short text at a time. Each attack returns
what the attacker got, its figure and whether it is within its bound (``passed``);
:mod:`abuse` measures the ordinary clients around it, against ``P50_BOUND_S`` here (an
ordinary request waits for the pass in progress, which no ratio to a 5 ms baseline
bounds).

================  =========================================================================
pooling-deadline  the review's 1,024 inputs of 256 token ids with ``X-Request-Timeout:
                  1``, one every 3 s: every answer a 504, no worker killed
pooling-flood     two clients looping 2,048-document reranks (262,000 characters each):
                  the ordinary clients' p50 under ``P50_BOUND_S`` (the review: 20 ms to
                  29.4 s)
================  =========================================================================
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

CONFIG = """\
model = "none"
backend = "testing"
workers = 1
devices = ["cpu"]
deadline_s = 60.0

[backend_options]
task = "embed"
pooling_token_s = 0.00025

[server]
host = "127.0.0.1"
port = {port}
api_key_env = "MODELPOOL_ABUSE_UNSET_KEY"
drain_timeout_s = 5.0
"""
ORDINARY_PATH = "/v1/embeddings"
ORDINARY_BODY = {"input": "an ordinary short text to embed"}
# The ordinary clients' p50 during an attack: they wait for the micro-batches in the
# worker's step (two clients' of 2,048 tokens each), not for the attacker's whole request.
P50_BOUND_S = 1.0
ATTACKER = "127.0.0.2"
# The review's shapes: 1,024 x 256 ids (0.79 MB), and 2,048 documents of 127 characters.
LARGE_IDS = {"input": [[7] * 256] * 1024}
DOCUMENTS = {"query": "q", "documents": ["word " * 25 + "ab"] * 2048}
DEADLINE_GAP_S = 3.0


def attack_deadline(url: str, stop: threading.Event) -> dict[str, Any]:
    """The 1,024 x 256-id embedding with ``X-Request-Timeout: 1``, one every 3 s."""
    statuses: dict[str, int] = {}
    transport = httpx.HTTPTransport(local_address=ATTACKER)
    with httpx.Client(base_url=url, transport=transport, timeout=30) as client:
        kills_before = _kills(client)
        while not stop.is_set():
            response = client.post(
                "/v1/embeddings", json=LARGE_IDS, headers={"X-Request-Timeout": "1"}
            )
            status = str(response.status_code)
            statuses[status] = statuses.get(status, 0) + 1
            stop.wait(DEADLINE_GAP_S)
        # A kill comes cancel_grace_s (2 s) after a cancel the worker did not read.
        time.sleep(DEADLINE_GAP_S)
        killed = _kills(client) - kills_before
    passed = killed == 0 and set(statuses) == {"504"}
    return {
        "answers": statuses,
        "workers killed": killed,
        "figure": f"{sum(statuses.values())} requests: {statuses}, {killed} workers killed",
        "bound": "every answer 504, 0 workers killed",
        "passed": passed,
    }


def attack_flood(url: str, stop: threading.Event) -> dict[str, Any]:
    """Two clients looping 2,048-document reranks."""
    statuses: dict[str, int] = {}
    seconds: list[float] = []

    def loop() -> None:
        transport = httpx.HTTPTransport(local_address=ATTACKER)
        with httpx.Client(base_url=url, transport=transport, timeout=120) as client:
            while not stop.is_set():
                started = time.monotonic()
                status = str(client.post("/v1/rerank", json=DOCUMENTS).status_code)
                statuses[status] = statuses.get(status, 0) + 1
                seconds.append(time.monotonic() - started)
                if status == "429":
                    stop.wait(1.0)  # Retry-After

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"answers": statuses, "max s": round(max(seconds, default=0.0), 2)}


def _kills(client: httpx.Client) -> int:
    kills: int = client.get("/stats").json()["counters"]["kills"]
    return kills
