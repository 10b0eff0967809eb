"""The budget's rule for the host tiers the registry keeps for out models: a load takes
their room before it evicts a loaded model, least recently used tier first and only as
many as it needs; a loaded model is evicted only when the tiers are not enough, and the
tiers that still fit then stay; a model is never judged too large because of them."""

from __future__ import annotations

import pytest

from modelpool.shared.config import ModelSpec, PoolConfig
from modelpool.supervisor.registry.budget import Budgets
from modelpool.supervisor.registry.host_tiers import HostTiers
from modelpool.supervisor.registry.records import MEMORY, Entry, RegistryConfig
from modelpool.supervisor.registry.swaps import SwapLedger

GIB = 2**30


def entries() -> dict[str, Entry]:
    def entry(name: str, **fields: object) -> Entry:
        made = Entry(ModelSpec(name, PoolConfig(model="none", backend="testing")))
        for key, value in fields.items():
            setattr(made, key, value)
        return made

    return {
        "loaded": entry(
            "loaded", state="loaded", held={MEMORY: 4 * GIB}, need={MEMORY: 4 * GIB}, last_used=1.0
        ),
        "out_old": entry("out_old", tier_bytes=GIB, last_used=2.0),
        "out_new": entry("out_new", tier_bytes=GIB, last_used=3.0),
        "new": entry(
            "new", state="loading", need={MEMORY: 4 * GIB}, need_source="measured", loads=1
        ),
    }


def plan(budget: int) -> tuple[list[str], list[str]]:
    """The models ``new``'s load evicts and the out models whose tiers it drops."""
    models = entries()
    config = RegistryConfig(tuple(e.spec for e in models.values()), memory_budget_bytes=budget)
    budgets = Budgets(config, models, [], SwapLedger(3.0, 0.2), [], HostTiers())
    found = budgets.plan(models["new"])
    assert found is not None
    victims, _, drops = found
    return [v.spec.name for v in victims], [d.spec.name for d in drops]


@pytest.mark.parametrize(
    ("budget_gib", "evicted", "dropped"),
    [
        (10, [], []),  # fits beside everything
        (9, [], ["out_old"]),  # the least recently used tier is enough
        (8, [], ["out_old", "out_new"]),  # both tiers, and the loaded model stays
        (5, ["loaded"], ["out_old"]),  # tiers not enough: out_new still fits beside
    ],
)
def test_a_load_takes_the_out_models_tiers_before_a_loaded_model(
    budget_gib: int, evicted: list[str], dropped: list[str]
) -> None:
    assert plan(budget_gib * GIB) == (evicted, dropped)


def test_the_tiers_count_in_what_the_models_hold_but_never_make_a_model_too_large() -> None:
    models = entries()
    config = RegistryConfig(tuple(e.spec for e in models.values()), memory_budget_bytes=5 * GIB)
    budgets = Budgets(config, models, [], SwapLedger(3.0, 0.2), [], HostTiers())
    assert budgets.held_total() == {MEMORY: 6 * GIB}
    models["loaded"].spec = ModelSpec("loaded", models["loaded"].spec.pool, pin=True)
    # Beside the pinned model (4 GiB) there is 1 GiB: a 1 GiB need fits once the tiers go.
    models["new"].need = {MEMORY: GIB}
    assert budgets.too_large(models["new"], {MEMORY: GIB}) is None
    assert budgets.too_large(models["new"], {MEMORY: GIB + 1}) is not None
