"""The chaos harness in CI: a short seeded run must end with zero violations.

The run is a subprocess (``python -m benchmarks.chaos``), as ``scripts/chaos``
runs it: the harness checks that its own process has no child left after
``close()``, which only means something in a process of its own. The checker
itself is tested on hand-made records, so a harness that stopped checking would
not pass silently.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.chaos import (
    Record,
    check_request,
    digest,
    make_spec,
    rss_slope_mb_per_min,
    tokens,
)

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
            "benchmarks.chaos",
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
    assert any(by_kind[kind].get(name) for kind in ("segfault", "exit") for name in crashed)
    assert by_kind["raise"].get("BackendError"), by_kind
    assert by_kind["normal"].get("ok", 0) > 50, by_kind
    assert figures["agent_kills"] > 0
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
    assert check_request(record("normal", "ok", text="id-1"), "id-1", set(), 3) is None
    assert (
        check_request(record("hang", "DeadlineExceeded", attempts=[(5, "timeout")]), None, set(), 3)
        is None
    )
    crashes = [(5, "crash"), (6, "crash"), (7, "crash")]
    assert (
        check_request(record("segfault", "WorkerCrashed", attempts=crashes), None, set(), 3) is None
    )
    assert (
        check_request(
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
        check_request(record("crash_once", "ok", text="ok", n_attempts=2), "ok", set(), 3) is None
    )
    assert (
        check_request(
            record("cancel", "cancelled", text="t0 t1 ", cancel_how="pool"), tokens(150), set(), 3
        )
        is None
    )
    assert check_request(record("invalid", "rejected:InvalidRequest"), None, set(), 3) is None


def test_checker_flags_wrong_lost_doubled_and_late_requests() -> None:
    def problem(rec: Record, expected: str | None = None, struck: set[int] | None = None) -> str:
        found = check_request(rec, expected, struck or set(), 3)
        assert found is not None
        return found

    assert "wrong result" in problem(record("normal", "ok", text="id-2"), "id-1")
    assert "resolved 2 times" in problem(record("normal", "ok", text="id-1", callbacks=2), "id-1")
    assert "unresolved" in problem(record("normal", None))  # type: ignore[arg-type]
    assert "late" in problem(record("normal", "ok", text="id-1", latency=30.0), "id-1")
    assert "wrong partial" in problem(
        record("cancel", "cancelled", text="t1 ", cancel_how="pool"), tokens(150)
    )
    assert "expected DeadlineExceeded" in problem(record("hang", "ok", text=""))
    assert "expected 3 crash attempts" in problem(
        record("exit", "WorkerCrashed", attempts=[(5, "crash"), (6, "crash")])
    )
    assert "untyped" in problem(record("normal", "PoolError", message="dispatcher failed"))
    assert "not rejected" in problem(record("invalid", "ok", text="x"))


def test_digested_records_keep_the_verdict_not_the_text() -> None:
    good = record("normal", "ok", text="id-1")
    digest(good, "id-1")
    assert good.text is None and good.text_match == "full" and good.text_len == 4
    assert check_request(good, "id-1", set(), 3) is None
    bad = record("normal", "ok", text="id-2")
    digest(bad, "id-1")
    assert bad.text == "id-2" and bad.text_match == "wrong"
    found = check_request(bad, "id-1", set(), 3)
    assert found is not None and "wrong result" in found
    partial = record("cancel", "cancelled", text="t0 t1 ", cancel_how="pool")
    digest(partial, tokens(150))
    assert partial.text_match == "prefix" and check_request(partial, None, set(), 3) is None


def test_checker_lets_struck_attempts_fail_but_only_those() -> None:
    crashed = record("normal", "WorkerCrashed", attempts=[(5, "crash"), (6, "timeout")])
    assert check_request(crashed, "id-1", {5, 6}, 3) is None
    found = check_request(crashed, "id-1", {5}, 3)
    assert found is not None and "not every attempt was struck" in found
    stream = record("stream", "WorkerCrashed", text="t0 t1 ", attempts=[(5, "crash")])
    assert check_request(stream, tokens(10), {5}, 3) is None
    assert (
        check_request(record("hang", "WorkerCrashed", attempts=[(5, "crash")]), None, {5}, 3)
        is None
    )


def test_specs_are_a_function_of_seed_and_index() -> None:
    first = [make_spec(7, i, "/tmp/x", {"normal": 1, "hang": 1}) for i in range(50)]
    again = [make_spec(7, i, "/tmp/x", {"normal": 1, "hang": 1}) for i in range(50)]
    assert first == again
    assert {s.kind for s in first} == {"normal", "hang"}
    assert all(s.expected == s.prompt.partition(":")[2] for s in first if s.kind == "normal")


def test_rss_slope_is_least_squares_over_the_second_half() -> None:
    # flat for a minute, then +10 MB/min for a minute: the second half sees only the growth
    samples = [(float(t), 100 * 2**20) for t in range(0, 60)]
    samples += [(float(t), 100 * 2**20 + int((t - 60) / 60 * 10 * 2**20)) for t in range(60, 121)]
    slope, growth = rss_slope_mb_per_min(samples)
    assert slope == pytest.approx(10.0, rel=0.05)
    assert growth == pytest.approx(10.0, rel=0.05)
    flat = [(float(t), 50 * 2**20) for t in range(100)]
    assert rss_slope_mb_per_min(flat) == (0.0, 0.0)
