"""``scripts/chaos --embeddings`` in CI: the embedding pool beside the generation one, its
kills, hangs and crashes, must end with zero violations; and its checker must flag an
embedding request that deviates where no worker of it was struck."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import chaos
from benchmarks.chaos_embeddings import EMBEDDING_MIX, make_embedding_spec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


@pytest.mark.slow
def test_chaos_with_embeddings_has_no_violation(tmp_path: Path) -> None:
    report_path = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", chaos.__name__, "--requests", "60", "--seed", "3",
         "--embeddings", "--embedding-requests", "120", "--report", str(report_path),
         "--log", str(tmp_path / "chaos.log")],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "embeddings requests=120" in proc.stdout and "violations=0" in proc.stdout
    figures = json.loads(report_path.read_text())["figures"]["embeddings"]
    assert figures["requests"] == 120
    # Faults happened and were answered as their kinds say.
    assert set(figures["by_kind"]["invalid"]) <= {"InvalidRequest"}
    assert "ok" not in figures["by_kind"]["segfault"]
    assert figures["counters_final"]["crashes"] > 0


def test_embedding_specs_are_a_function_of_seed_and_index(tmp_path: Path) -> None:
    first = [make_embedding_spec(5, index, str(tmp_path)) for index in range(200)]
    again = [make_embedding_spec(5, index, str(tmp_path)) for index in range(200)]
    assert first == again
    assert {spec.kind for spec in first} == set(EMBEDDING_MIX)
    assert all((spec.expected is None) == (spec.expected_error is not None) for spec in first)
