"""What a misbehaving caller, backend or callback can do to the pool: never more than fail
its own request."""

from __future__ import annotations

import collections
import sys
import threading
import types
from typing import Any

import pytest

from helpers import (
    LONG,
    UNCAPPED,
    BackendModule,
    assert_no_children,
    make_config,
    new_children,
    open_pool,
    pid_alive,
    slack,
    wait_until,
)
from modelpool import (
    BackendError,
    InvalidRequest,
    ModelPool,
    PoolError,
)
from modelpool.supervisor.faults import run_on_dispatcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

BAD_BACKEND = """
import os
from modelpool import Generation

class Handler:
    def generate(self, call):
        kind = call.prompt
        if kind == "emit_bytes":
            call.emit(b"tok")
        if kind == "none_text":
            return Generation(None)
        if kind == "odd_reason":
            return Generation("x", "because")
        if kind == "not_text":
            return 42
        return "fine"

def load(model="", device="cpu", **options):
    return Handler()
"""


@pytest.fixture()
def bad_backend(backend_module: BackendModule) -> str:
    return backend_module(BAD_BACKEND, "load")


@pytest.mark.parametrize("prompt", ["emit_bytes", "none_text", "odd_reason", "not_text"])
def test_a_backend_returning_garbage_fails_its_request_only(bad_backend: str, prompt: str) -> None:
    with open_pool(backend=bad_backend, workers=1) as pool:
        pid = pool.stats().workers[0].pid
        with pytest.raises(BackendError):
            list(pool.stream(prompt))
        assert pool.generate("anything").text == "fine"
        assert pool.stats().state == "ready"
        assert pool.stats().workers[0].pid == pid  # the worker stayed warm
        assert pool.stats().counters["crashes"] == 0


def test_arguments_that_cannot_reach_a_worker_are_invalid_requests() -> None:
    with open_pool(workers=1) as pool:
        with pytest.raises(InvalidRequest):
            pool.submit("echo:x", seed=lambda: 1)
        assert pool.stats().counters["submitted"] == 0
        # Any mapping will do as a message; what is sent is a plain copy.
        proxy = types.MappingProxyType({"role": "user", "content": "echo:proxied"})
        assert pool.generate([proxy]).text == "proxied"
        user_dict = collections.UserDict({"role": "user", "content": "echo:copied"})
        assert pool.generate([user_dict]).text == "copied"


def test_the_prompt_is_copied_at_submit() -> None:
    with open_pool(workers=1) as pool:
        messages = [{"role": "user", "content": "tokens:3:0.05"}]
        future = pool.submit(messages)
        messages[0]["content"] = "echo:changed"
        assert future.result().text == "t0 t1 t2 "


def test_a_deadline_of_a_month_is_accepted() -> None:
    with open_pool(workers=1, startup_timeout_s=30 * 86400.0) as pool:
        assert pool.generate("echo:x", deadline_s=30 * 86400.0).text == "x"
        with pytest.raises(InvalidRequest):
            pool.generate("echo:x", deadline_s=10**400)
        assert pool.generate("echo:y").text == "y"


def test_generate_inside_a_callback_is_refused_and_the_pool_goes_on() -> None:
    with open_pool(workers=1) as pool:
        seen: list[BaseException] = []
        done = threading.Event()

        def callback(_: Any) -> None:
            try:
                pool.generate("echo:inner")
            except PoolError as exc:
                seen.append(exc)
            done.set()

        # Still running when the callback is attached (it ends at its 0.5 s deadline), so the
        # callback runs on the dispatcher thread; one attached to a done future would run
        # here, in the caller's thread, where generate() is allowed.
        pool.submit(LONG, deadline_s=0.5, **UNCAPPED).add_done_callback(callback)
        assert done.wait(slack(5))
        assert seen and "callback" in str(seen[0])
        assert pool.generate("echo:after", deadline_s=2).text == "after"


def test_a_failed_dispatcher_fails_calls_and_kills_workers_instead_of_hanging() -> None:
    """The dispatcher thread dies inside a living supervisor: the running request fails
    with PoolError, the workers are killed, and a later submit is refused at once (it used
    to be posted to the dead loop, where it never resolved)."""
    pool = ModelPool(make_config(workers=2, deadline_s=30.0))
    pool.start()
    try:
        pids = [w.pid for w in pool.stats().workers]
        running = pool.submit("hang")

        def broken() -> None:
            raise RuntimeError("a bug in the dispatcher")

        dispatcher = run_on_dispatcher(pool, broken)
        error = running.exception(timeout=5)
        assert isinstance(error, PoolError) and "dispatcher failed" in str(error), repr(error)
        dispatcher.join(10)
        assert not dispatcher.is_alive()
        assert pool.stats().state == "failed"
        assert not any(pid is not None and pid_alive(pid) for pid in pids)
        with pytest.raises(PoolError, match="dispatcher failed"):
            pool.submit("echo:x")
    finally:
        pool.close(drain=False, timeout=2)
    assert_no_children()


@pytest.mark.slow
def test_close_kills_the_workers_when_the_dispatcher_is_wedged() -> None:
    pool = ModelPool(
        make_config(workers=2, cancel_grace_s=0, term_grace_s=0, gpu_release_timeout_s=0)
    )
    pool.start()
    wedge = threading.Event()
    try:
        run_on_dispatcher(pool, wedge.wait)  # a callback that never returns, say
        pool.close(drain=False, timeout=0.5)
        # Killed, though not reaped: only the wedged thread could reap them.
        wait_until(lambda: not new_children(include_zombies=False), timeout=5)
    finally:
        wedge.set()
    assert_no_children(timeout=5)
