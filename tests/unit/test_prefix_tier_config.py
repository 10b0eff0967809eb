"""The prefix cache tiers' configuration (PoolConfig), their specs and owned host
directory (supervisor.prefix_tiers), their Prometheus families and the registry's
estimate of a model's memory with a host tier."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from modelpool import ModelPool, PoolConfig
from modelpool.server.metrics import PoolCollector
from modelpool.shared.config import ModelSpec
from modelpool.shared.prefix_tier import TierStats
from modelpool.supervisor.prefix_tiers import remove_host_tier, tier_specs, with_host_tier
from modelpool.supervisor.registry.needs import estimate


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prefix_cache_host_bytes", -1),
        ("prefix_cache_host_bytes", "1GiB"),
        ("prefix_cache_dir_bytes", 1.5),
        ("prefix_cache_dir", ""),
        ("prefix_cache_host_dir", 3),
    ],
)
def test_bad_tier_settings_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PoolConfig(model="m", **{field: value})


def test_the_pool_makes_and_removes_its_host_tier_and_keeps_a_given_one(tmp_path: Path) -> None:
    off = PoolConfig(model="m")
    assert with_host_tier(off) == (off, None) and tier_specs(off) == ()
    config, made = with_host_tier(PoolConfig(model="m", prefix_cache_host_bytes=1 << 20))
    assert made is not None and os.path.isdir(made)
    assert config.prefix_cache_host_dir == made
    (host,) = tier_specs(config)
    assert (host.name, host.directory, host.limit_bytes) == ("host", made, 1 << 20)
    remove_host_tier(made)
    assert not os.path.exists(made)
    given = PoolConfig(
        model="m",
        prefix_cache_host_bytes=1 << 20,
        prefix_cache_host_dir=str(tmp_path / "kept"),
        prefix_cache_dir=str(tmp_path / "disk"),
    )
    assert with_host_tier(given) == (given, None)
    names = [(spec.name, Path(spec.directory).parent) for spec in tier_specs(given)]
    assert names == [("host", tmp_path), ("disk", tmp_path / "disk")]
    other = tier_specs(given.replace(model="another"))[1]
    assert other.directory != tier_specs(given)[1].directory, "a subdirectory per model"


def test_the_tiers_are_exported_as_metrics() -> None:
    stats = dataclasses.replace(
        ModelPool(PoolConfig(model="none", backend="testing")).stats(),
        prefix_tiers=[
            TierStats("host", bytes=300, limit_bytes=1000, hits=4, restores=4, rejected=1),
            TierStats("disk", bytes=20, limit_bytes=5000, misses=2),
        ],
    )
    registry = CollectorRegistry()
    registry.register(PoolCollector(lambda: stats))
    text = generate_latest(registry).decode()
    assert 'modelpool_prefix_tier_bytes{tier="host"} 300.0' in text
    assert 'modelpool_prefix_tier_limit_bytes{tier="disk"} 5000.0' in text
    assert 'modelpool_prefix_tier_hits_total{tier="host"} 4.0' in text
    assert 'modelpool_prefix_tier_rejected_total{tier="host"} 1.0' in text
    assert 'modelpool_prefix_tier_misses_total{tier="disk"} 2.0' in text


def test_the_registry_estimate_counts_the_host_tier(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"0" * 1000)
    pool = PoolConfig(model=str(tmp_path), backend="hf", workers=1)
    plain = estimate(ModelSpec("m", pool))
    tiered = estimate(ModelSpec("m", pool.replace(prefix_cache_host_bytes=1 << 20)))
    assert plain is not None and tiered is not None
    assert tiered["memory"] - plain["memory"] == 1 << 20
