"""Priority inside a worker's batch (the shared scheduler, ``backends/common/scheduler``),
on the scripted fake llama.cpp of ``test_llama_cpp_engine``: a more urgent request takes
the next free KV room before one that waited longer, unless that one was promoted (the
pool's order, ``scheduling.ordering``), and a long low-priority prompt read in slices
yields its slice to a more urgent one."""

from __future__ import annotations

from test_llama_cpp_engine import END, FakeRuntime, drain, engine_for

from helpers import Recorder
from modelpool.shared.protocol import Generation, TokenIds
from modelpool.shared.validation import PROMOTED_AT_PARAM


def test_a_more_urgent_request_takes_the_next_free_room() -> None:
    runtime = FakeRuntime({3: [3] * 8, 4: [4, END], 6: [6, END]})
    # Room for one request at a time: 2 prompt + 8 new tokens = 10 cells each.
    engine = engine_for(runtime, kv_cells=12)
    running = Recorder(TokenIds((3, 5)), {"max_new_tokens": 8})
    low = Recorder(TokenIds((4, 5)), {"max_new_tokens": 8, "priority": 5})
    high = Recorder(TokenIds((6, 5)), {"max_new_tokens": 8, "priority": -1})
    engine.admit(running)
    engine.step()
    engine.admit(low)
    engine.admit(high)
    while running in [row.call for row in engine.rows + engine.prefilling]:
        engine.step()
    engine.step()  # the room it left is given at the next step
    started = [row.call for row in engine.rows + engine.prefilling]
    assert started == [high] and [row.call for row in engine.waiting] == [low]
    ended = drain(engine)
    assert all(isinstance(ended[id(call)], Generation) for call in (low, high))


def test_a_request_promoted_in_the_pool_takes_the_next_free_room_first() -> None:
    """The pool sends each request's promotion instant (aged, or due): once it has come,
    the request goes ahead of every one not promoted, whatever its priority."""
    runtime = FakeRuntime({3: [3] * 8, 4: [4, END], 6: [6, END]})
    engine = engine_for(runtime, kv_cells=12)
    running = Recorder(TokenIds((3, 5)), {"max_new_tokens": 8})
    aged = {"max_new_tokens": 8, "priority": 5, PROMOTED_AT_PARAM: 0.0}
    low = Recorder(TokenIds((4, 5)), aged)
    high = Recorder(TokenIds((6, 5)), {"max_new_tokens": 8, "priority": -1})
    engine.admit(running)
    engine.step()
    engine.admit(low)
    engine.admit(high)
    while running in [row.call for row in engine.rows + engine.prefilling]:
        engine.step()
    engine.step()
    started = [row.call for row in engine.rows + engine.prefilling]
    assert started == [low] and [row.call for row in engine.waiting] == [high]
    ended = drain(engine)
    assert all(isinstance(ended[id(call)], Generation) for call in (low, high))


def test_a_long_low_priority_prefill_yields_its_slice() -> None:
    runtime = FakeRuntime({4: [4, END], 6: [6, END]})
    engine = engine_for(runtime, prefill_chunk_tokens=3)
    long_low = Recorder(TokenIds((4, *[5] * 20)), {"max_new_tokens": 2, "priority": 5})
    engine.admit(long_low)
    engine.step()
    (low_row,) = engine.prefilling
    assert low_row.prefilled == 3
    high = Recorder(TokenIds((6, *[5] * 5)), {"max_new_tokens": 2, "priority": 0})
    engine.admit(high)
    engine.step()
    high_row = next(row for row in engine.prefilling if row.call is high)
    assert high_row.prefilled == 3 and low_row.prefilled == 3, "the slice went to high"
    engine.step()
    assert high_row.prefilled == 6 and low_row.prefilled == 3
    ended = drain(engine)
    assert all(isinstance(ended[id(call)], Generation) for call in (long_low, high))


def test_without_priorities_the_order_is_arrival() -> None:
    runtime = FakeRuntime({4: [4, END], 6: [6, END]})
    engine = engine_for(runtime, prefill_chunk_tokens=3)
    first = Recorder(TokenIds((4, *[5] * 8)), {"max_new_tokens": 2})
    second = Recorder(TokenIds((6, *[5] * 8)), {"max_new_tokens": 2})
    engine.admit(first)
    engine.admit(second)
    engine.step()
    assert [row.prefilled for row in engine.prefilling] == [3, 0]
