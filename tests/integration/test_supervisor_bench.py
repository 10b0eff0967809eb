"""``benchmarks.supervisor`` runs end to end on a few requests and reports what the README
quotes: each contender's rate and dispatch p50, the ratios, the dispatcher's profile."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


def test_a_short_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "supervisor.json"
    argv = ["--requests", "200", "--round-trips", "20", "--rounds", "1", "--batch", "4"]
    assert supervisor.main([*argv, "--profile", "--top", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for name in ("modelpool", "ppe", "pebble"):
        assert data[name]["per_s"] > 0 and data[name]["dispatch_p50_ms"] > 0
    assert data["throughput_modelpool_vs_ppe"] > 0
    profile = data["profile"]
    # A request costs the dispatcher thread tens of calls, not thousands.
    assert 10 < profile["calls_per_request"] < 1000
    assert len(profile["top_by_own_time"]) == 3
    assert len(data["load_average_before"]) == 3
