"""Both LoRA benchmarks (benchmarks/lora.py, benchmarks/lora_gguf.py) run end to end at
tiny sizes and report what they promise, so that they keep running; and their pairing of
mixed and base runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import lora, lora_gguf


def test_mixed_and_base_take_turns_and_the_ratio_is_paired() -> None:
    calls: list[str] = []
    values = iter([4.0, 2.0, 2.0, 2.0, 3.0, 1.0])

    def measure(name: str) -> float:
        calls.append(name)
        return next(values)

    mixed, base = lora.interleaved(3, lambda: measure("mixed"), lambda: measure("base"))
    assert calls == ["mixed", "base", "base", "mixed", "mixed", "base"]
    assert mixed == [4.0, 2.0, 3.0] and base == [2.0, 2.0, 1.0]
    assert lora.ratio_summary(mixed, base) == {"median": 2.0, "min": 1.0, "max": 3.0}


@pytest.mark.slow
def test_the_hf_benchmark_runs_mixed_against_base(tmp_path: Path) -> None:
    # Without the merged copies: their five pools cost minutes on a loaded machine.
    sizes = ["--batch", "2", "--tokens", "3", "--rank", "2", "--repeats", "1", "--threads", "1"]
    report = lora.main([*sizes, "--workdir", str(tmp_path), "--no-merged"])
    assert report["mixed_tok_s"] > 0 and report["base_tok_s"] > 0
    ratio = report["mixed_vs_base"]
    assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    assert report["new_adapter_first_token_s"] > 0


@pytest.mark.slow
def test_the_gguf_benchmark_runs() -> None:
    report = lora_gguf.main(
        ["--batch", "2", "--tokens", "2", "--adapters", "2", "--repeats", "1", "--threads", "1"]
    )
    assert report["base_tok_s"] > 0 and report["mixed_tok_s"] > 0
    assert report["mixed_over_base"]["median"] > 0
