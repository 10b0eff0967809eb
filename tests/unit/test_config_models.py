"""[models.NAME] tables: each a pool of its own over the top-level keys, with the
registry's keys (ttl_s, pin, preload, aliases, load_timeout_s); a file without them is
read exactly as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelpool.shared.config import ConfigError, ModelSpec, PoolConfig, layered_config

CONFIG = """
workers = 3
devices = ["cpu"]
deadline_s = 20.0

[generation_defaults]
max_new_tokens = 32

[server]
memory_budget_bytes = 8000000000

[models.chat]
model = "embedded:smollm2-135m-instruct"
pin = true
preload = true
aliases = ["gpt-4o-mini", "default"]

[models.coder]
model = "./coder"
backend = "llama_cpp"
workers = 1
ttl_s = 300
backend_options = { n_ctx = 2048 }
generation_defaults = { temperature = 0.2 }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "modelpool.toml"
    path.write_text(text)
    return path


def test_model_tables_layer_over_the_top_level_keys(tmp_path: Path) -> None:
    effective = layered_config(write(tmp_path, CONFIG), environ={"MODELPOOL_DEADLINE_S": "15"})
    chat, coder = effective.models
    assert (chat.name, chat.pin, chat.preload, chat.aliases) == (
        "chat",
        True,
        True,
        ("gpt-4o-mini", "default"),
    )
    assert chat.pool.workers == 3 and chat.pool.deadline_s == 15.0
    # backend "auto": its pool's start() adds the embedded float32 if it chooses hf.
    assert chat.pool.backend == "auto" and chat.pool.backend_options == {}
    assert coder.pool.workers == 1 and coder.ttl_s == 300 and coder.pool.backend == "llama_cpp"
    assert coder.pool.backend_options == {"n_ctx": 2048}
    # Tables merge key by key: the top level's max_new_tokens stays.
    assert coder.pool.generation_defaults == {"max_new_tokens": 32, "temperature": 0.2}
    assert effective.server.memory_budget_bytes == 8_000_000_000
    assert "[models.coder]" in effective.to_toml() and effective.values()["models"]["chat"]["pin"]


def test_a_file_without_models_reads_as_before(tmp_path: Path) -> None:
    effective = layered_config(write(tmp_path, 'model = "./m"\nworkers = 1\n'), environ={})
    assert effective.models == () and effective.pool.model == "./m"
    assert "models" not in effective.values()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[models.x]\nworkers = 1\n", "missing key 'model'"),
        ('[models.x]\nmodel = "m"\nttl_s = -1\n', "models.x.ttl_s must be >= 0"),
        ('[models.x]\nmodel = "m"\nwrokers = 1\n', "unknown key 'wrokers'"),
        ('[models.x]\nmodel = "m"\npin = "yes"\n', "models.x.pin must be true or false"),
        (
            '[models.x]\nmodel = "m"\naliases = ["y"]\n[models.y]\nmodel = "n"\n',
            "the name 'y' is used by both 'x' and 'y'",
        ),
        ("models = 3\n", "[models] must hold tables"),
    ],
)
def test_a_bad_model_table_is_one_line_naming_it(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        layered_config(write(tmp_path, table), environ={})
    assert message in str(error.value)


def test_a_spec_takes_the_pool_startup_bound_plus_a_margin_as_its_load_deadline() -> None:
    pool = PoolConfig(model="m", startup_timeout_s=60)
    assert ModelSpec("m", pool).load_deadline_s == 90.0
    assert ModelSpec("m", pool, load_timeout_s=5).load_deadline_s == 5
