"""Worker device groups: the configuration, their resolution against NVML, the worker's
environment. Against the scripted fake NVML; no GPU."""

from __future__ import annotations

import pytest

from fake_nvml import FakeGpu, FakeNvml
from modelpool import PoolConfig
from modelpool.supervisor.devices import group_devices, resolve_worker_devices, worker_env_for
from modelpool.supervisor.gpu import GpuProbe

UUIDS = [f"GPU-{n}{n}{n}{n}0000-0000-0000-0000-000000000000" for n in range(4)]
NO_CVD: dict[str, str] = {}


def four_gpus() -> GpuProbe:
    return GpuProbe(FakeNvml([FakeGpu(uuid=uuid) for uuid in UUIDS]))


# ----------------------------------------------------------------------------- configuration


def test_groups_are_read_from_nested_lists_as_in_toml() -> None:
    config = PoolConfig.from_dict(
        {
            "model": "m",
            "workers": 1,
            "spares": 1,
            "devices": [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]],
        }
    )
    assert config.devices == (("cuda:0", "cuda:1"), ("cuda:2", "cuda:3"))


@pytest.mark.parametrize(
    ("settings", "key", "words"),
    [
        ({"devices": [["cuda:0", "cuda:1"], ["cuda:1", "cuda:2"]]}, "devices", "cuda:1"),
        ({"devices": [["cuda:0", "cuda:1"]], "workers": 1, "spares": 1}, "devices", "2 workers"),
        ({"devices": [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], "workers": 3}, "devices", "3"),
        ({"devices": [["cuda:0", "cpu"]]}, "devices", "'cpu'"),
        ({"devices": [[]]}, "devices", "non-empty"),
        ({"devices": ["cuda:0", ["cuda:1", "cuda:2"]], "workers": 1}, "devices", "every entry"),
        ({"devices": ["cuda:0", "cuda:1", "cuda:2"], "gpus_per_worker": 2}, "gpus_per_worker", "3"),
        ({"devices": ["cpu"], "gpus_per_worker": 2}, "gpus_per_worker", "cpu"),
        ({"devices": [["cuda:0", "cuda:1"]], "gpus_per_worker": 2}, "gpus_per_worker", "not both"),
        ({"gpus_per_worker": 0}, "gpus_per_worker", ">= 1"),
        ({"devices": ["cuda:0", "cuda:1"], "gpus_per_worker": 2, "workers": 2}, "devices", "1 GPU"),
    ],
)
def test_bad_layouts_are_value_errors_naming_the_key(
    settings: dict[str, object], key: str, words: str
) -> None:
    with pytest.raises(ValueError) as caught:
        PoolConfig.from_dict({"model": "m", "workers": 1, **settings})
    message = str(caught.value)
    assert message.startswith(key), message
    assert words in message, message


def test_one_gpu_per_worker_may_still_be_shared_by_several_workers() -> None:
    assert PoolConfig(model="m", workers=3, devices=["cuda:0"]).devices == ("cuda:0",)


# ----------------------------------------------------------------------------- resolution


def test_groups_resolve_to_one_label_per_worker() -> None:
    probe = four_gpus()
    labels = resolve_worker_devices([["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], probe, NO_CVD)
    assert labels == ["cuda:0,cuda:1", "cuda:2,cuda:3"]
    assert group_devices(labels[1]) == ["cuda:2", "cuda:3"]
    assert group_devices("cuda:0") == ["cuda:0"]


def test_gpus_per_worker_splits_every_visible_gpu() -> None:
    probe = four_gpus()
    assert resolve_worker_devices(["auto"], probe, NO_CVD, gpus_per_worker=2, slots=2) == [
        "cuda:0,cuda:1",
        "cuda:2,cuda:3",
    ]
    # Three visible GPUs: the one left over is not used (logged).
    three = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert resolve_worker_devices(["auto"], probe, three, gpus_per_worker=2) == ["cuda:0,cuda:1"]


def test_groups_of_gpus_that_do_not_exist_are_named() -> None:
    probe = four_gpus()
    with pytest.raises(ValueError, match=r"^devices: group \['cuda:3', 'cuda:4'\].*cuda:4"):
        resolve_worker_devices([["cuda:3", "cuda:4"]], probe, NO_CVD)
    with pytest.raises(ValueError, match=r"^devices: .*'cuda:7' does not exist"):
        resolve_worker_devices(["cuda:7"], probe, NO_CVD)


def test_resolution_checks_what_only_nvml_knows() -> None:
    probe = four_gpus()
    with pytest.raises(ValueError, match=r"^gpus_per_worker: 3 workers .* but 2 GPU groups"):
        resolve_worker_devices(["auto"], probe, NO_CVD, gpus_per_worker=2, slots=3)
    with pytest.raises(ValueError, match=r"^gpus_per_worker: 8 GPUs per worker but only 4"):
        resolve_worker_devices(["auto"], probe, NO_CVD, gpus_per_worker=8)
    # "cuda" is cuda:0: the overlap is found once the names are resolved.
    with pytest.raises(ValueError, match=r"^devices: cuda:0 is in more than one place"):
        resolve_worker_devices([["cuda", "cuda:1"], ["cuda:0", "cuda:2"]], probe, NO_CVD)
    no_driver = GpuProbe(FakeNvml(init_error=RuntimeError("no driver")))
    with pytest.raises(ValueError, match=r"^gpus_per_worker: no GPU visible"):
        resolve_worker_devices(["auto"], no_driver, NO_CVD, gpus_per_worker=2)


# ----------------------------------------------------------------------------- environment


def test_a_group_worker_sees_exactly_its_gpus_by_uuid() -> None:
    probe = four_gpus()
    env, device = worker_env_for("cuda:2,cuda:3", probe, NO_CVD)
    assert env == {"CUDA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[3]}"}
    assert device == "cuda:0,cuda:1"
    # The pool's own CUDA_VISIBLE_DEVICES reorders: cuda:0 of the pool is GPU 3.
    env, _ = worker_env_for("cuda:0,cuda:1", probe, {"CUDA_VISIBLE_DEVICES": "3,1"})
    assert env == {"CUDA_VISIBLE_DEVICES": f"{UUIDS[3]},{UUIDS[1]}"}


def test_a_group_worker_without_nvml_gets_the_entries_as_written() -> None:
    no_driver = GpuProbe(FakeNvml(init_error=RuntimeError("no driver")))
    env, device = worker_env_for("cuda:0,cuda:2", no_driver, NO_CVD)
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert device == "cuda:0,cuda:1"
    env, _ = worker_env_for("cuda:0,cuda:1", no_driver, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"})
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}


# ----------------------------------------------------------------------------- stats, metrics


def test_metrics_show_each_gpu_of_a_group_and_what_a_blocked_gpu_holds() -> None:
    from modelpool.server.metrics import PoolMetrics
    from modelpool.supervisor.stats import GpuStats, PoolStats, WorkerStats

    worker = WorkerStats(
        id=3,
        pid=1234,
        state="idle",
        role="serving",
        device="cuda:0,cuda:1",
        requests=0,
        uptime_s=1.0,
        rss_mb=100.0,
        gpu_mb=300.0,
        gpu_mb_method="pid",
        gpu_mb_by_device={"cuda:0": 200.0, "cuda:1": 100.0},
    )
    stats = PoolStats(
        state="degraded",
        workers=[worker],
        queue_depth=0,
        counters={},
        latency_s={"p50": None, "p95": None, "p99": None},
        gpu=GpuStats(
            available=True,
            reason="fake",
            blocked_devices=["cuda:3"],
            blocked_held_mb={"cuda:3": 1024.0},
        ),
        uptime_s=1.0,
    )
    text = PoolMetrics(lambda: stats).render().decode()
    assert 'modelpool_worker_gpu_memory_bytes{device="cuda:0",worker="3"} 2.097152e+08' in text
    assert 'modelpool_worker_gpu_memory_bytes{device="cuda:1",worker="3"} 1.048576e+08' in text
    assert 'modelpool_gpu_blocked_held_bytes{device="cuda:3"} 1.073741824e+09' in text
    assert stats.to_dict()["workers"][0]["gpu_mb_by_device"] == {"cuda:0": 200.0, "cuda:1": 100.0}


def test_an_oom_on_the_second_gpu_of_a_group_is_named_by_the_pools_name() -> None:
    from modelpool.supervisor.records import Worker
    from modelpool.supervisor.worker_manager import pool_device

    group = Worker(id=1, slot=0, device="cuda:2,cuda:3", started_at=0.0)
    assert pool_device(group, "cuda:1") == "cuda:3"
    assert pool_device(group, None) is None  # torch did not say which GPU
    single = Worker(id=2, slot=0, device="cuda:5", started_at=0.0)
    assert pool_device(single, "cuda:0") == "cuda:5"
    assert pool_device(single, None) == "cuda:5"


def test_a_ray_replica_asks_for_every_gpu_its_groups_name() -> None:
    ray_serve = pytest.importorskip("modelpool.ray_serve")
    from modelpool import ServerConfig

    def gpus(**settings: object) -> object:
        config = PoolConfig(model="m", **settings)  # type: ignore[arg-type]
        options = ray_serve.default_deployment_options(config, ServerConfig())
        return options["ray_actor_options"].get("num_gpus")

    assert gpus(workers=1, spares=1, devices=[["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]) == 4
    assert gpus(workers=2, devices=["cuda:0"]) == 1
    assert gpus(devices=["auto"]) is None
