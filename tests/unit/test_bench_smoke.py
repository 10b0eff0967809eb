"""The benchmark harness's pure parts on synthetic samples, and one real --quick dispatch run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench


def test_percentile_interpolates_between_ranks() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]
    assert bench.percentile(samples, 0) == 1.0
    assert bench.percentile(samples, 100) == 4.0
    assert bench.percentile(samples, 50) == pytest.approx(2.5)
    assert bench.percentile(samples, 90) == pytest.approx(3.7)
    assert bench.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    with pytest.raises(ValueError):
        bench.percentile(samples, 101)


def test_summarize_and_ratio() -> None:
    summary = bench.summarize([0.1 * i for i in range(1, 11)])
    assert summary["n"] == 10
    assert summary["p50"] == pytest.approx(0.55)
    assert summary["min"] == pytest.approx(0.1)
    assert summary["max"] == pytest.approx(1.0)
    assert summary["mean"] == pytest.approx(0.55)
    assert bench.summarize([]) == {"n": 0}
    assert bench.ratio(3.0, 2.0) == pytest.approx(1.5)
    assert bench.ratio(None, 2.0) is None
    assert bench.ratio(1.0, 0.0) is None
    assert bench.ratio(1.0, None) is None


def test_formatting() -> None:
    assert bench.fmt_seconds(None) == "-"
    assert bench.fmt_seconds(250e-6) == "250 µs"
    assert bench.fmt_seconds(0.0123) == "12.3 ms"
    assert bench.fmt_seconds(0.456) == "456 ms"
    assert bench.fmt_seconds(2.5) == "2.50 s"
    assert bench.fmt_ratio(1.234) == "1.23x"
    assert bench.fmt_ratio(None) == "-"


def test_markdown_table_escapes_and_checks_widths() -> None:
    table = bench.markdown_table(["a", "b"], [["1", "x|y"]])
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x\\|y |"]
    with pytest.raises(ValueError):
        bench.markdown_table(["a", "b"], [["only one"]])


def test_dispatch_ratios_are_against_modelpool() -> None:
    result = bench.build_dispatch(
        {"modelpool": [2e-4] * 9 + [1e-3], "pebble": [4e-4] * 10, "pipe": [2e-5] * 10}, block=5
    )
    contenders = result["contenders"]
    assert contenders["modelpool"]["p50_vs_modelpool"] == pytest.approx(1.0)
    assert contenders["pebble"]["p50_vs_modelpool"] == pytest.approx(2.0)
    assert contenders["pipe"]["p50_vs_modelpool"] == pytest.approx(0.1)
    assert len(contenders["pebble"]["samples_s"]) == 10


def _naive_phase(total: float) -> dict[str, Any]:
    return {
        "spawn": 0.2,
        "import": 2.0,
        "load": 3.0,
        "generate": 1.0,
        "return": 0.01,
        "exit": 0.1,
        "total": total,
        "tokens": 16,
        "text": "t",
        "peak_rss_mb": 1000.0,
    }


def test_latency_and_naive_limit() -> None:
    samples = {"inprocess": [1.0, 1.0, 1.0], "modelpool": [1.02, 1.03, 1.01], "naive": [6.2, 6.4]}
    texts = {"inprocess": "same", "modelpool": "same", "naive": "different"}
    block = bench.build_latency(
        16, samples, texts, {"modelpool": {"workers": 1}}, [_naive_phase(6.2), _naive_phase(6.4)]
    )
    assert block["modelpool_vs_inprocess"] == pytest.approx(1.02)
    assert block["naive_vs_modelpool"] == pytest.approx(6.3 / 1.02)
    contenders = block["contenders"]
    assert contenders["modelpool"]["same_text_as_inprocess"] is True
    assert contenders["naive"]["same_text_as_inprocess"] is False
    assert contenders["modelpool"]["workers"] == 1
    phases = block["naive_phases"]
    assert phases["limit"] == pytest.approx(6.3)
    gpu = next(p for p in phases["seven_b"]["projections"] if p["device"] == "GPU")
    generate = bench.SEVEN_B_GPU_STEP_S * 16
    assert gpu["limit_low"] == pytest.approx((2.2 + 15.0 + generate) / generate)


def test_throughput_two_vs_one() -> None:
    result = bench.build_throughput(
        {
            "modelpool": {1: {"requests_per_s": 1.0}, 2: {"requests_per_s": 1.8}},
            "pebble": {1: {"requests_per_s": 0.9}, 2: {"requests_per_s": 1.2}},
        }
    )
    contenders = result["contenders"]
    assert contenders["modelpool"]["two_vs_one"] == pytest.approx(1.8)
    assert contenders["pebble"]["runs"]["2"]["vs_modelpool"] == pytest.approx(1.2 / 1.8)
    combined = bench.combine_rounds(
        [
            {
                "wall_s": 2.0,
                "requests": 4,
                "callers": 8,
                "latencies_s": [1.0] * 4,
                "errors": [],
                "requests_per_s": 2.0,
            },
            {
                "wall_s": 6.0,
                "requests": 4,
                "callers": 8,
                "latencies_s": [1.0] * 3,
                "errors": ["boom"],
                "requests_per_s": 0.5,
            },
        ],
        torch_threads=1,
    )
    assert combined["requests_per_s"] == pytest.approx(7 / 8.0)
    assert combined["errors"] == ["boom"]


def synthetic_report() -> dict[str, Any]:
    """A report with every scenario filled from synthetic samples, shaped as main() builds it."""
    latency = {
        str(tokens): bench.build_latency(
            tokens,
            {
                "inprocess": [1.0, 1.1],
                "modelpool": [1.02, 1.12],
                "pebble": [1.1, 1.2],
                "naive": [6.5],
            },
            {"inprocess": "x", "modelpool": "x", "pebble": "x"},
            {},
            [_naive_phase(6.5)] if tokens == 16 else (),
        )
        for tokens in (16, 64)
    }
    hung = {
        "timeout_s": 2.0,
        "normal_request": "1 new token",
        "contenders": {
            "modelpool s1 graces 0": {
                "raised": "DeadlineExceeded",
                "timeout_error_s": 2.0,
                "baseline_next_s": 0.1,
                "wedged": False,
                "next_done_after_error_s": 0.15,
                "next_started_after_error_s": 0.0004,
                "spares": 1,
                "reloads": False,
                "restored_after_error_s": 3.0,
                "how": "killed and replaced",
            },
            "ppe": {
                "raised": "TimeoutError",
                "timeout_error_s": 2.0,
                "baseline_next_s": 0.1,
                "wedged": True,
                "waited_s": 3.0,
                "wedge_cap_s": 3.0,
                "reloads": None,
                "worker_alive_after_shutdown": True,
                "how": "cannot stop it",
            },
            "loky": {"error": "Traceback ...\nRuntimeError: broke"},
            "inprocess": {"cannot": True, "how": "no timeout at all"},
        },
        "retry_on_spare": {
            "attempt_timeout_s": 0.3,
            "samples_s": [0.002, 0.004],
            "summary": bench.summarize([0.002, 0.004]),
        },
        "timeline": [
            {"lane": "ppe: request", "start": 0.0, "end": 2.0, "kind": "hung"},
            {"lane": "ppe: request", "start": 2.0, "end": 5.0, "kind": "wedged"},
            {"lane": "modelpool s1 graces 0 worker 7", "start": 0.0, "end": 2.0, "kind": "busy"},
        ],
    }
    cancel = {
        "step_s": 0.05,
        "cancel_after_s": 0.5,
        "first_chunk_s": 0.3,
        "step_samples_s": [0.05],
        "contenders": {
            "modelpool": {"can_cancel": True, "cancel_s": 0.04, "next_s": 0.1, "how": "flag"},
            "loky": {"can_cancel": False, "ran_on_s": 2.0, "how": "refuses"},
            "naive": {"can_cancel": None, "how": "kill only"},
        },
    }
    throughput = bench.build_throughput(
        {
            "modelpool": {
                1: {"requests_per_s": 1.0, "callers": 8, "requests": 8, "errors": []},
                2: {"requests_per_s": 1.9, "callers": 8, "requests": 8, "errors": []},
            },
        }
    )
    memory = {
        "note": "VmHWM",
        "contenders": {
            "modelpool": {
                "label": "modelpool",
                "supervisor_mb": 30.0,
                "workers_mb": [900.0],
                "helpers_mb": [],
                "total_mb": 930.0,
            },
            "inprocess": {
                "label": "in-process",
                "supervisor_mb": 900.0,
                "workers_mb": [],
                "helpers_mb": [],
                "total_mb": 900.0,
            },
        },
    }
    scenarios = {
        "a": {"by_tokens": latency},
        "b": bench.build_dispatch({"modelpool": [2e-4, 3e-4], "pebble": [4e-4, 5e-4]}, 1),
        "c": hung,
        "d": cancel,
        "e": throughput,
        "f": memory,
    }
    return {
        "command": "scripts/bench --quick",
        "wall_s": 123.0,
        "machine": {
            "cpu": "Test CPU",
            "cores": 2,
            "python": "3.11",
            "versions": {"torch": "2.13.0", "transformers": "5"},
            "git": {"commit": "abcdef1234567890", "dirty": True},
        },
        "load_average": {"start": [0.5, 0.4, 0.3], "end": [2.0, 1.0, 0.5]},
        "shared_machine": True,
        "settings": {"model": "embedded:smollm2-135m-instruct", "dtype": "float32"},
        "scenarios": scenarios,
        "targets": bench.evaluate_targets(scenarios),
    }


def test_targets_follow_the_measurements() -> None:
    targets = {t["name"].split(":")[0] + t["target"]: t for t in synthetic_report()["targets"]}
    assert targets["a< 1.05"]["met"] is True  # 1.02 / 1.0 (medians of two samples)
    assert targets["a>= 5x slower"]["met"] is True
    assert targets["b<= 450 µs"]["met"] is True
    assert targets["b<= 0.2 ms"]["met"] is False  # p50 of 0.2 ms and 0.3 ms is 0.25 ms
    assert targets["c< 100 ms"]["met"] is True
    assert targets["c< 10 ms"]["met"] is True
    assert targets["e>= 1.7x"]["met"] is True
    assert bench.evaluate_targets({})[0]["met"] is None


def test_markdown_has_every_table_and_marks_what_cannot_be_done() -> None:
    text = bench.render_markdown(synthetic_report())
    for heading in (
        "(a) Per-request latency",
        "### 16 new tokens",
        "(b) Dispatch round trip",
        "(c) A hung request",
        "(d) Cancel",
        "(e) Throughput",
        "(f) Peak memory",
        "## Targets",
    ):
        assert heading in text
    assert "Test CPU, 2 cores" in text
    assert "abcdef123456 + uncommitted changes" in text
    assert "shared machine" in text
    assert "| in-process direct call | cannot | cannot |" in text
    assert "wedged (not served in 3.00 s)" in text
    assert "RuntimeError: broke" in text  # a failed part shows as such, the rest still renders
    assert "| loky reusable executor | cannot |" in text
    assert "kill only" in text
    assert "For a 7B model" in text
    assert "| modelpool | 1.00 | 1.90 | 1.90x |" in text


def test_writers_round_trip(tmp_path: Path) -> None:
    report = synthetic_report()
    report["path"] = tmp_path  # Paths are written as strings
    bench.write_json(tmp_path / "bench.json", report)
    loaded = json.loads((tmp_path / "bench.json").read_text())
    assert loaded["scenarios"]["b"]["contenders"]["pebble"]["samples_s"] == [4e-4, 5e-4]
    assert loaded["path"] == str(tmp_path)
    text = bench.write_markdown(tmp_path / "bench.md", report)
    assert (tmp_path / "bench.md").read_text() == text
    assert bench.render_plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not bench.render_plot({"scenarios": {}}, tmp_path / "empty.png")


def test_arguments_are_checked() -> None:
    assert bench.parse_args(["--quick", "--scenarios", "ab"]).scenarios == "ab"
    with pytest.raises(SystemExit):
        bench.parse_args(["--scenarios", "xyz"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--dispatch-calls", "0"])


def test_a_failed_part_fails_the_run() -> None:
    assert bench._has_error({"contenders": {"loky": {"error": "Traceback ..."}}})
    assert not bench._has_error({"contenders": {"loky": {"raised": "TimeoutError"}}})


@pytest.mark.slow
def test_quick_dispatch_run_end_to_end(tmp_path: Path) -> None:
    """A real run of scenario (b) only: every contender starts, answers, and is cleaned up."""
    calls = 60
    source = str(Path(bench.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench",
            "--quick",
            "--scenarios",
            "b",
            "--dispatch-calls",
            str(calls),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    contenders = report["scenarios"]["b"]["contenders"]
    assert set(contenders) == {"pipe", "pebble", "loky", "ppe", "modelpool"}
    for entry in contenders.values():
        assert len(entry["samples_s"]) == calls
        assert 0 < entry["summary"]["p50"] < 0.5
    assert report["leftover_children"] == []
    assert report["machine"]["cores"] >= 1
    assert "(b) Dispatch round trip" in (tmp_path / "bench.md").read_text()
    assert "| modelpool |" in done.stdout
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_batching_pools_rounds_and_prints_ratios_against_the_first_contender() -> None:
    from benchmarks import batching

    def level(wall: float, tokens: int, latencies: list[float]) -> dict[str, Any]:
        return {
            "concurrency": 8,
            "wall_s": wall,
            "tokens": tokens,
            "errors": [],
            "latencies_s": latencies,
            "first_tokens_s": [0.1 for _ in latencies],
        }

    pooled = batching.summarize([level(10.0, 640, [9.0, 10.0]), level(10.0, 640, [8.0, 11.0])])
    assert pooled["tokens_per_s"] == pytest.approx(64.0)
    assert pooled["requests"] == 4 and pooled["rounds"] == 2
    assert pooled["latency_p99_s"] == 11.0
    faster = batching.summarize([level(5.0, 960, [4.0, 5.0])])
    report = {
        "new_tokens": 64,
        "rounds": 2,
        "concurrencies": [8],
        "contender_names": ["1x1", "1x8"],
        "contenders": {"1x1": {"8": pooled}, "1x8": {"8": faster}},
        "hang_in_batch": {
            "batch": 8,
            "tokens": 40,
            "step_s": 0.02,
            "stall_timeout_s": 0.5,
            "innocents": 7,
            "innocents_correct": 7,
            "re_prefills_max": 1,
            "re_prefills_total": 7,
            "hang_latency_p50_s": 3.5,
            "clean_latency_p50_s": 0.8,
            "culprit": "PoisonRequest",
        },
    }
    text = batching.markdown(report)
    assert "| 8 | 64.0 | 192.0 | 3.00x |" in text
    assert "at most 1 re-prefill each" in text and "PoisonRequest" in text
    assert batching.Contender.parse("2x8") == batching.Contender(2, 8)
