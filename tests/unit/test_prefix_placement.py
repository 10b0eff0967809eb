"""Placement that follows the prefix cache (placement.py, prefixes.py), on the records alone.

A request goes to the worker whose last prefix cache report holds the longest part of its
prompt, while that worker runs at most PREFIX_LOAD_SLACK requests more than the least
loaded one; otherwise, and for a worker that reported nothing (new, replaced) or evicted
the prefix, least loaded first as before.
"""

from __future__ import annotations

from modelpool.scheduling.placement import PREFIX_LOAD_SLACK, assign, tier_held
from modelpool.shared.prefixes import (
    TEXT_BLOCK_CHARS,
    answered_fingerprints,
    matched_units,
    partition_of,
    prompt_fingerprints,
)
from modelpool.shared.protocol import PrefixCacheReport, TokenIds, encode_request
from modelpool.supervisor.records import Request, Run, Worker
from modelpool.supervisor.results import PoolFuture

SYSTEM = {"role": "system", "content": "You are terse."}


def request(prompt: list[dict[str, str]] | str, number: int = 1) -> Request:
    return Request(
        request_id=f"r{number}",
        payload=encode_request(prompt, {}),
        future=PoolFuture(f"r{number}", lambda _: None),
        submitted_at=0.0,
        deadline=60.0,
        prefix_fingerprints=prompt_fingerprints(prompt),
    )


def worker(number: int, running: int = 0, held: tuple[int, ...] | None = None) -> Worker:
    record = Worker(id=number, slot=number, device="cpu", started_at=0.0, state="idle")
    record.role, record.slots = "serving", 4
    for attempt in range(running):
        owner = request("busy", 100 + attempt)
        record.runs[attempt] = Run(attempt, owner, owner, record, attempt, 0.0, 60.0)
    if held is not None:
        record.prefix_cache = PrefixCacheReport(bytes=1, fingerprints=frozenset(held))
    return record


def test_the_next_turn_goes_where_the_conversation_is_cached() -> None:
    turn_one = [SYSTEM, {"role": "user", "content": "Hi"}]
    turn_two = [*turn_one, {"role": "assistant", "content": "Hello."}]
    turn_two.append({"role": "user", "content": "Bye"})
    only_system = worker(1, held=prompt_fingerprints([SYSTEM]))
    conversation = worker(2, held=answered_fingerprints(turn_one, "Hello.", []))
    [(_, chosen)] = assign([request(turn_two)], [only_system, conversation])
    assert chosen is conversation
    # Within the slack a busier worker holding the prefix still wins...
    held = answered_fingerprints(turn_one, "Hello.", [])
    busier = worker(2, running=PREFIX_LOAD_SLACK, held=held)
    [(_, chosen)] = assign([request(turn_two)], [worker(1), busier])
    assert chosen is busier
    # ...beyond it, the least loaded worker does.
    loaded = worker(2, running=PREFIX_LOAD_SLACK + 1, held=held)
    idle = worker(1)
    [(_, chosen)] = assign([request(turn_two)], [loaded, idle])
    assert chosen is idle


def test_a_worker_that_evicted_the_prefix_or_was_replaced_gets_no_preference() -> None:
    prompt = [SYSTEM, {"role": "user", "content": "Hi"}]
    evicted = worker(1, running=1, held=())
    replaced = worker(2, running=2)  # a fresh worker has reported nothing
    idle = worker(3)
    [(_, chosen)] = assign([request(prompt)], [evicted, replaced, idle])
    assert chosen is idle


def test_string_and_token_prompts_match_by_whole_blocks() -> None:
    text = "x" * (TEXT_BLOCK_CHARS * 2 + 10)
    chain = prompt_fingerprints(text)
    assert len(chain) == 2
    held = frozenset(answered_fingerprints(text[: TEXT_BLOCK_CHARS + 5], "y", []))
    assert matched_units(chain, held) == 1
    ids = TokenIds(tuple(range(130)))
    assert len(prompt_fingerprints(ids)) == 2
    longer = prompt_fingerprints(TokenIds(tuple(range(200))))
    assert matched_units(longer, frozenset(answered_fingerprints(ids, "", [128, 129]))) == 2


def test_a_prefix_the_tiers_hold_counts_for_every_worker() -> None:
    turn_one = [SYSTEM, {"role": "user", "content": "Hi"}]
    turn_two = [*turn_one, {"role": "assistant", "content": "Hello."}]
    turn_two.append({"role": "user", "content": "Bye"})
    held = answered_fingerprints(turn_one, "Hello.", [])
    tiers = frozenset(held)
    # Without the tiers a busy holder within the slack takes it into its batch...
    busy_holder, idle = worker(2, running=PREFIX_LOAD_SLACK, held=held), worker(1)
    [(_, chosen)] = assign([request(turn_two)], [busy_holder, idle])
    assert chosen is busy_holder
    # ...with them the idle worker restores the same prefix and starts it now.
    [(_, chosen)] = assign([request(turn_two)], [busy_holder, idle], tier_fingerprints=tiers)
    assert chosen is idle
    # At equal load a worker's own hit (memory) beats a restore from the tiers.
    holder = worker(2, held=held)
    [(_, chosen)] = assign([request(turn_two)], [worker(1), holder], tier_fingerprints=tiers)
    assert chosen is holder


def test_a_worker_holding_more_than_the_tiers_still_wins_within_the_slack() -> None:
    turn_one = [SYSTEM, {"role": "user", "content": "Hi"}]
    turn_two = [*turn_one, {"role": "assistant", "content": "Hello."}]
    turn_two.append({"role": "user", "content": "Bye"})
    only_system = frozenset(prompt_fingerprints([SYSTEM]))
    busier = worker(
        2, running=PREFIX_LOAD_SLACK, held=answered_fingerprints(turn_one, "Hello.", [])
    )
    [(_, chosen)] = assign([request(turn_two)], [worker(1), busier], tier_fingerprints=only_system)
    assert chosen is busier
    # Beyond the slack, neither the tiers nor its own hit draw a request to it.
    loaded = worker(
        2, running=PREFIX_LOAD_SLACK + 1, held=answered_fingerprints(turn_one, "Hello.", [])
    )
    idle = worker(1)
    [(_, chosen)] = assign([request(turn_two)], [loaded, idle], tier_fingerprints=only_system)
    assert chosen is idle


def test_the_tiers_hold_a_prefix_only_for_the_partition_that_wrote_it() -> None:
    turn_one = [SYSTEM, {"role": "user", "content": "Hi"}]
    turn_two = [*turn_one, {"role": "assistant", "content": "Hello."}]
    turn_two.append({"role": "user", "content": "Bye"})
    tenant_a, tenant_b = partition_of({"cache_salt": "a"}), partition_of({"cache_salt": "b"})
    held = answered_fingerprints(turn_one, "Hello.", [], tenant_a)
    tiers = frozenset(held)
    salted = request(turn_two)
    salted.prefix_fingerprints = prompt_fingerprints(turn_two, tenant_a)
    # The partition's own unit, then the three messages.
    assert tier_held(salted, tiers) == 4
    other = request(turn_two, 2)
    other.prefix_fingerprints = prompt_fingerprints(turn_two, tenant_b)
    shared = request(turn_two, 3)
    assert tier_held(other, tiers) == tier_held(shared, tiers) == 0
    # So another tenant's request still goes to the busy worker holding its own prefix.
    busy_holder = worker(2, running=PREFIX_LOAD_SLACK, held=prompt_fingerprints(turn_one, tenant_b))
    [(_, chosen)] = assign([other], [busy_holder, worker(1)], tier_fingerprints=tiers)
    assert chosen is busy_holder
