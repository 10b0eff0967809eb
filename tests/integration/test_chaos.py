"""The chaos harness in CI: a short seeded run must end with zero violations.

The run is a subprocess (``python -m <CHAOS_MODULE>``), as ``scripts/chaos``
runs it: the harness checks that its own process has no child left after
``close()``, which only means something in a process of its own. Every check
the harness makes, per request and at the end (full strength, counters,
release checks, leftover processes, groups and frozen workers, RSS growth),
is fed a failing input here, and a real run with a violation exits 1, so a
harness that stopped checking would not pass silently.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The harness, imported here alone (re-point this line if it moves again).
from benchmarks import chaos
from modelpool.supervisor.stats import GpuStats, PoolStats, ReleaseStats, WorkerStats

CHAOS_MODULE = chaos.__name__  # what `python -m` runs, as scripts/chaos does
Record = chaos.Record

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

REQUESTS, SEED = 300, 1


@pytest.mark.slow
@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_short_seeded_chaos_run_has_no_violation(tmp_path: Path, max_batch_size: int) -> None:
    report_path, log_path = tmp_path / "chaos.json", tmp_path / "chaos.log"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            CHAOS_MODULE,
            "--requests",
            str(REQUESTS),
            "--seed",
            str(SEED),
            "--report",
            str(report_path),
            "--log",
            str(log_path),
            "--max-batch-size",
            str(max_batch_size),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[2],
    )
    wall = time.monotonic() - started
    tail = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, tail
    summary = [line for line in proc.stdout.splitlines() if line.startswith("chaos ")]
    assert len(summary) == 1 and summary[0].endswith("violations=0"), tail

    report = json.loads(report_path.read_text())
    assert report["ok"] and report["violations"] == [], report["violations"][:20]
    figures = report["figures"]
    assert figures["requests"] == REQUESTS
    # Not vacuous: faults were injected and gave what they should.
    by_kind = figures["by_kind"]
    assert by_kind["hang"].get("DeadlineExceeded"), by_kind
    crashed = ("WorkerCrashed", "PoisonRequest")
    for kind in ("segfault", "exit"):  # each of them, not one or the other
        assert any(by_kind[kind].get(name) for name in crashed), by_kind
    assert by_kind["raise"].get("BackendError"), by_kind
    assert by_kind["normal"].get("ok", 0) > 50, by_kind
    assert figures["agent_kills"] > 0
    assert figures["agent_stops"] > 0, "no SIGSTOP was injected"
    assert figures["counters_final"]["respawns"] > 0
    assert figures["releases"]["checked"] >= figures["spawned_workers"]
    assert report["rss_samples"], "RSS was not sampled"
    assert wall < 120, f"the short chaos run took {wall:.0f}s"
    if max_batch_size > 1:
        # Batches were lost to the faults beside innocent requests, which were retried.
        counters = figures["counters_final"]
        assert counters["collateral_retries"] > 0 and counters["poison_requests"] > 0


# ---- the checker ---------------------------------------------------------------------------


def record(kind: str, outcome: str, **fields: object) -> Record:
    values: dict[str, object] = {
        "index": 1,
        "kind": kind,
        "api": "submit",
        "cancel_how": None,
        "deadline_s": 20.0,
        "latency": 0.1,
        "outcome": outcome,
        "callbacks": 1,
    }
    values.update(fields)
    return Record(**values)  # type: ignore[arg-type]


def test_checker_accepts_what_each_fault_should_give() -> None:
    assert chaos.check_request(record("normal", "ok", text="id-1"), "id-1", set(), 3) is None
    assert (
        chaos.check_request(
            record("hang", "DeadlineExceeded", attempts=[(5, "timeout")]), None, set(), 3
        )
        is None
    )
    crashes = [(5, "crash"), (6, "crash"), (7, "crash")]
    assert (
        chaos.check_request(record("segfault", "WorkerCrashed", attempts=crashes), None, set(), 3)
        is None
    )
    assert (
        chaos.check_request(
            record(
                "raise", "BackendError", attempts=[(5, "error")], message="RuntimeError: chaos-1"
            ),
            None,
            set(),
            3,
        )
        is None
    )
    assert (
        chaos.check_request(record("crash_once", "ok", text="ok", n_attempts=2), "ok", set(), 3)
        is None
    )
    assert (
        chaos.check_request(
            record("cancel", "cancelled", text="t0 t1 ", cancel_how="pool"),
            chaos.tokens(150),
            set(),
            3,
        )
        is None
    )
    assert chaos.check_request(record("invalid", "rejected:InvalidRequest"), None, set(), 3) is None


def test_checker_flags_wrong_lost_doubled_and_late_requests() -> None:
    def problem(rec: Record, expected: str | None = None, struck: set[int] | None = None) -> str:
        found = chaos.check_request(rec, expected, struck or set(), 3)
        assert found is not None
        return found

    assert "wrong result" in problem(record("normal", "ok", text="id-2"), "id-1")
    assert "resolved 2 times" in problem(record("normal", "ok", text="id-1", callbacks=2), "id-1")
    assert "unresolved" in problem(record("normal", None))  # type: ignore[arg-type]
    assert "late" in problem(record("normal", "ok", text="id-1", latency=30.0), "id-1")
    assert "wrong partial" in problem(
        record("cancel", "cancelled", text="t1 ", cancel_how="pool"), chaos.tokens(150)
    )
    assert "expected DeadlineExceeded" in problem(record("hang", "ok", text=""))
    assert "expected 3 crash attempts" in problem(
        record("exit", "WorkerCrashed", attempts=[(5, "crash"), (6, "crash")])
    )
    assert "untyped" in problem(record("normal", "PoolError", message="dispatcher failed"))
    assert "not rejected" in problem(record("invalid", "ok", text="x"))


def test_digested_records_keep_the_verdict_not_the_text() -> None:
    good = record("normal", "ok", text="id-1")
    chaos.digest(good, "id-1")
    assert good.text is None and good.text_match == "full" and good.text_len == 4
    assert chaos.check_request(good, "id-1", set(), 3) is None
    bad = record("normal", "ok", text="id-2")
    chaos.digest(bad, "id-1")
    assert bad.text == "id-2" and bad.text_match == "wrong"
    found = chaos.check_request(bad, "id-1", set(), 3)
    assert found is not None and "wrong result" in found
    partial = record("cancel", "cancelled", text="t0 t1 ", cancel_how="pool")
    chaos.digest(partial, chaos.tokens(150))
    assert partial.text_match == "prefix" and chaos.check_request(partial, None, set(), 3) is None


def test_checker_lets_struck_attempts_fail_but_only_those() -> None:
    crashed = record("normal", "WorkerCrashed", attempts=[(5, "crash"), (6, "timeout")])
    assert chaos.check_request(crashed, "id-1", {5, 6}, 3) is None
    found = chaos.check_request(crashed, "id-1", {5}, 3)
    assert found is not None and "not every attempt was struck" in found
    stream = record("stream", "WorkerCrashed", text="t0 t1 ", attempts=[(5, "crash")])
    assert chaos.check_request(stream, chaos.tokens(10), {5}, 3) is None
    assert (
        chaos.check_request(record("hang", "WorkerCrashed", attempts=[(5, "crash")]), None, {5}, 3)
        is None
    )


def test_specs_are_a_function_of_seed_and_index() -> None:
    first = [chaos.make_spec(7, i, "/tmp/x", {"normal": 1, "hang": 1}) for i in range(50)]
    again = [chaos.make_spec(7, i, "/tmp/x", {"normal": 1, "hang": 1}) for i in range(50)]
    assert first == again
    assert {s.kind for s in first} == {"normal", "hang"}
    assert all(s.expected == s.prompt.partition(":")[2] for s in first if s.kind == "normal")


def test_rss_slope_is_least_squares_over_the_second_half() -> None:
    # flat for a minute, then +10 MB/min for a minute: the second half sees only the growth
    samples = [(float(t), 100 * 2**20) for t in range(0, 60)]
    samples += [(float(t), 100 * 2**20 + int((t - 60) / 60 * 10 * 2**20)) for t in range(60, 121)]
    slope, growth = chaos.rss_slope_mb_per_min(samples)
    assert slope == pytest.approx(10.0, rel=0.05)
    assert growth == pytest.approx(10.0, rel=0.05)
    flat = [(float(t), 50 * 2**20) for t in range(100)]
    assert chaos.rss_slope_mb_per_min(flat) == (0.0, 0.0)


def test_scripts_chaos_runs_this_module() -> None:
    """The CI test runs the module; the documented entry point must run the same one."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "chaos").read_text()
    assert f"-m {CHAOS_MODULE} " in script


# ---- the end checks, each shown to fire ------------------------------------------------------

SLOTS = 4  # 3 workers + 1 spare, as in build_config's defaults


def snapshot(
    *,
    state: str = "ready",
    workers: list[tuple[int | None, str]] | None = None,
    queue_depth: int = 0,
    respawns: int = 2,
    checked: int = 2,
    failed: int = 0,
) -> PoolStats:
    """A pool snapshot after a chaos load: by default back to full strength (4 usable
    workers, 2 respawned, 2 release checks)."""
    if workers is None:
        workers = [(100, "idle"), (101, "idle"), (102, "idle"), (103, "spare")]
    counters = {"submitted": 10, "completed": 7, "failed": 2, "cancelled": 1}
    counters["respawns"] = respawns
    return PoolStats(
        state=state,
        workers=[
            WorkerStats(
                id=i,
                pid=pid,
                state=st,
                role="serving",
                device="cpu",
                requests=0,
                uptime_s=1.0,
                rss_mb=None,
                gpu_mb=None,
            )
            for i, (pid, st) in enumerate(workers)
        ],
        queue_depth=queue_depth,
        counters=counters,
        latency_s={},
        gpu=GpuStats(
            available=False, reason="test", releases=ReleaseStats(checked, checked - failed, failed)
        ),
        uptime_s=10.0,
    )


def test_full_strength_check_passes_a_recovered_pool() -> None:
    assert chaos.strength_problem(snapshot(), SLOTS, set()) is None


@pytest.mark.parametrize(
    ("pool", "unusable", "shown"),
    [
        (snapshot(state="degraded"), set(), "state degraded"),
        (snapshot(workers=[(100, "idle"), (101, "idle"), (102, "idle")]), set(), "3 of 4"),
        (
            snapshot(workers=[(100, "idle"), (101, "busy"), (102, "idle"), (103, "spare")]),
            set(),
            "3 of 4",
        ),
        (
            snapshot(workers=[(100, "idle"), (None, "starting"), (102, "idle"), (103, "spare")]),
            set(),
            "3 of 4",
        ),
        (snapshot(), {101}, "3 of 4"),  # a frozen (SIGSTOPped) or zombie worker is not usable
        (snapshot(queue_depth=2), set(), "queue 2"),
        (snapshot(checked=1), set(), "releases checked 1 of 2"),
    ],
    ids=["degraded", "missing", "busy", "starting", "frozen", "queued", "release-pending"],
)
def test_full_strength_check_fires(pool: PoolStats, unusable: set[int], shown: str) -> None:
    problem = chaos.strength_problem(pool, SLOTS, unusable)
    assert problem is not None and shown in problem, problem


def test_counter_check_fires_when_counters_do_not_add_up() -> None:
    good = {"submitted": 10, "completed": 7, "failed": 2, "cancelled": 1}
    assert chaos.counter_problems(good, accepted=10) == []
    [lost] = chaos.counter_problems({**good, "completed": 6}, accepted=10)
    assert "completed+failed+cancelled=9 != submitted=10" in lost
    [unseen] = chaos.counter_problems(good, accepted=11)
    assert "submitted=10 but the clients had 11" in unseen


def test_release_check_fires_when_one_is_missing_or_failed() -> None:
    assert chaos.release_problems(ReleaseStats(checked=6, ok=6), spawned_workers=6) == []
    [missing] = chaos.release_problems(ReleaseStats(checked=5, ok=5), spawned_workers=6)
    assert "5 of 6" in missing
    [failed] = chaos.release_problems(ReleaseStats(checked=6, ok=5, failed=1), spawned_workers=6)
    assert "failed: 1" in failed


def test_leftover_checks_fire_for_processes_zombies_groups_and_frozen_workers() -> None:
    assert chaos.leftover_problems([], [], [], "closed") == []
    [process] = chaos.leftover_problems([(4242, "sleeping")], [], [], "closed")
    assert "processes left" in process and "4242" in process
    [zombie] = chaos.leftover_problems([(4243, "zombie")], [], [], "closed")
    assert "zombie" in zombie
    [group] = chaos.leftover_problems([], [4244], [], "closed")
    assert "process groups left" in group and "4244" in group
    [frozen] = chaos.leftover_problems([], [], [4245], "closed")
    assert "SIGSTOPped" in frozen and "4245" in frozen
    [state] = chaos.leftover_problems([], [], [], "ready")
    assert "state after close(): ready" in state


def test_rss_check_fires_on_growth_only_over_both_limits() -> None:
    over_slope = chaos.RSS_SLOPE_LIMIT_MB_MIN + 1
    over_growth = chaos.RSS_GROWTH_FLOOR_MB + 1
    problem = chaos.rss_problem(over_slope, over_growth)
    assert problem is not None and "supervisor RSS grows" in problem
    assert chaos.rss_problem(over_slope, chaos.RSS_GROWTH_FLOOR_MB / 2) is None  # warm-up noise
    assert chaos.rss_problem(chaos.RSS_SLOPE_LIMIT_MB_MIN / 2, over_growth) is None
    # from samples, as the run computes it: +10 MB/min for two minutes
    samples = [(float(t), 100 * 2**20 + int(t / 60 * 10 * 2**20)) for t in range(0, 121)]
    assert chaos.rss_problem(*chaos.rss_slope_mb_per_min(samples)) is not None


FORCED_VIOLATION = """
import importlib, sys
chaos = importlib.import_module(sys.argv[1])
chaos.MIX = {"normal": 1, "raise": 1}
chaos.rss_problem = lambda slope, growth: "forced: supervisor RSS grows"
sys.exit(chaos.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_run_with_a_violation_exits_1(tmp_path: Path) -> None:
    """A real (short, agent-less) run whose RSS check fires: summary says so, exit 1."""
    report_path = tmp_path / "chaos.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            FORCED_VIOLATION,
            CHAOS_MODULE,
            "--requests",
            "20",
            "--seed",
            "3",
            "--agent-interval",
            "0",
            "--threads",
            "2",
            "--tasks",
            "2",
            "--report",
            str(report_path),
            "--log",
            str(tmp_path / "chaos.log"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    tail = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 1, tail
    assert "violation: forced: supervisor RSS grows" in proc.stderr, tail
    assert proc.stdout.strip().endswith("violations=1"), tail
    report = json.loads(report_path.read_text())
    assert report["ok"] is False and report["violations"] == ["forced: supervisor RSS grows"]
    assert report["figures"]["requests"] == 20


def test_a_lost_step_may_time_out_only_beside_a_fault_that_stalls_its_batch() -> None:
    """A batch_raise shared a batch with a hang: its attempt there timed out with the batch
    (a CI run's seed 1 at batch 4), which is no violation; the same timeout on a worker
    where only lost steps ran is one."""
    attempts = [(10, "timeout"), (11, "collateral"), (12, "error")]
    suspect = record("batch_raise", "PoisonRequest", attempts=attempts)
    beside_a_hang = {10: {"hang"}, 11: {"batch_raise"}, 12: {"batch_raise"}}
    assert chaos.check_request(suspect, None, set(), 3, beside_a_hang) is None
    alone = {10: {"batch_raise"}, 11: {"batch_raise"}, 12: {"batch_raise"}}
    found = chaos.check_request(suspect, None, set(), 3, alone)
    assert found is not None and "suspect had attempts" in found
