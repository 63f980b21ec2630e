"""The default batch cut holds under sustained load and is undone once the load falls. KV usage
counts device blocks only, and the cut moves half the batch off the device (swapped, or waiting
to be recomputed): under unchanged load usage falls to about half of what made the cut. With
the undo on usage under 0.80 the ladder had, the cut restored the batch a minute later, the
pool filled again and the batch was cut again, every 95 s, each time preempting half the batch
(a hunt saw it on a live daemon). An undo on usage under 0.40 stopped that, but held the batch
halved under any steady load over 0.40 of the pool, though the whole batch fitted. The
shipped rule reads the KV demand (`kv_cache_demand_ratio`: what the configured batch would
hold), which the cut does not move: it holds the cut while the load lasts and undoes it once
the whole batch fits under 0.80.

The real evaluator runs the shipped rules file on a fake clock, closed over a model of the load
whose KV usage follows the batch limit the rules set and whose demand is what the load needs
at the configured batch (the replay of `kvguard rules test` cannot: its series are fixed); the
shipped scenarios say the same in `rules test`'s terms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvguard.engine.control import ActionResult
from kvguard.rules.evaluator import Decision, Evaluator
from kvguard.rules.scenario import load_scenario, run_scenario
from kvguard.rules.schema import RuleSet, Signal, default_rules_path, load_rules

POOL_BLOCKS = 256
SEQ_BLOCKS = 30  # each request's blocks: the full batch of 8 fills 240 of 256, 0.94
CONFIGURED_SEQS = 8  # serving.max_num_seqs
SCENARIOS = default_rules_path().parent / "scenarios"
SCENARIO = SCENARIOS / "default-sustained-load.yaml"


@dataclass
class Load:
    """`demand` requests want to run; the batch limit the rules set decides how many do, and
    the others wait off the device, where KV usage does not count them. The KV demand counts
    those the configured batch would run, whatever the limit in force."""

    demand: int
    limit: int = CONFIGURED_SEQS
    clock: list[float] = field(default_factory=lambda: [0.0])

    def usage(self) -> float:
        return min(self.demand, self.limit) * SEQ_BLOCKS / POOL_BLOCKS

    def kv_demand(self) -> float:
        return min(self.demand, CONFIGURED_SEQS) * SEQ_BLOCKS / POOL_BLOCKS

    def read(self, name: str, _sig: Signal) -> float | None:
        values = {"kv_usage": self.usage(), "kv_demand": self.kv_demand()}
        return values.get(name)  # no GPU, host memory unknown

    def execute(self, action: str, params: dict[str, Any]) -> ActionResult:
        """The batch actions as the engine applies them; the others change nothing here."""
        before = {"max_num_seqs": self.limit}
        if action == "reduce_batch":
            cut = math.floor(self.limit * params.get("factor", 0.5))
            self.limit = min(self.limit, max(params.get("min", 1), cut))
        elif action == "restore_batch":
            self.limit = CONFIGURED_SEQS
        return ActionResult(action, before, {"max_num_seqs": self.limit}, "modelled", True)


def run(rules: RuleSet, demand: list[tuple[float, int]], until_s: float) -> list[Decision]:
    """The rules' decisions over `until_s` seconds of the load, whose demand changes at the
    given times, each evaluation every `interval` as the daemon's ticker runs them."""
    load = Load(demand[0][1])
    ev = Evaluator(
        rules, load.read, load.execute, clock=lambda: load.clock[0], wall_clock=lambda: 0.0
    )
    steps = sorted(demand)
    for k in range(math.floor(until_s / rules.interval) + 1):
        now = k * rules.interval
        load.clock[0] = now
        load.demand = [n for at, n in steps if at <= now][-1]
        ev.tick()
    return ev.decisions


def batch_actions(decisions: list[Decision]) -> list[tuple[float, str]]:
    return [(d.time, d.action) for d in decisions if d.rule == "reduce-batch"]


def on_usage(rules: RuleSet, below: float) -> RuleSet:
    """The rules with the batch cut on KV usage as before, undone under `below` (the ladder's
    0.80, or 0.40)."""
    changed = [
        r.model_copy(update={"signal": "kv_usage", "recover_below": below})
        if r.name == "reduce-batch"
        else r
        for r in rules.rules
    ]
    return rules.model_copy(update={"rules": changed})


def test_the_model_flaps_with_an_undo_on_usage_under_0_80() -> None:
    """The model reproduces the flap: with the ladder's old undo on usage under 0.80, ten
    requests that never let up are restored 65 s after each cut (the next tick's reading
    under 0.80, then 60 s of `recover_for`) and cut again 30 s later (the rule's cooldown),
    each cut preempting half the batch."""
    old = on_usage(load_rules(default_rules_path()), 0.80)
    got = batch_actions(run(old, [(0, 10)], 600))
    cuts = [t for t, a in got if a == "reduce_batch"]
    restores = [t for t, a in got if a == "restore_batch"]
    assert cuts[:3] == [10.0, 105.0, 200.0] and restores[:3] == [75.0, 170.0, 265.0], got
    assert len(cuts) >= 7, got


def test_the_default_cut_holds_while_the_heavy_load_lasts_and_undoes_once_it_falls() -> None:
    """The shipped rules cut once and hold the cut for the ten minutes the ten requests last
    (usage at 0.47 with four of them running, the demand at 0.94); when only three are left
    (0.35, nothing waiting) the batch is restored 60 s later, and stays."""
    rules = load_rules(default_rules_path())
    got = batch_actions(run(rules, [(0, 10), (600, 3)], 900))
    assert got == [(10.0, "reduce_batch"), (660.0, "restore_batch")]


def test_a_moderate_steady_load_gets_the_whole_batch_back() -> None:
    """Five requests after the ten: the whole batch would hold 0.59 of the pool, so the
    shipped rule restores it 60 s after the load fell, and the five run together with nothing
    cut again. An undo on usage under 0.40 held the batch halved for as long as the five
    lasted (four running, 0.47, one waiting behind the cut)."""
    rules = load_rules(default_rules_path())
    load = [(0, 10), (300, 5)]
    assert batch_actions(run(rules, load, 1200)) == [
        (10.0, "reduce_batch"),
        (360.0, "restore_batch"),
    ]
    assert batch_actions(run(on_usage(rules, 0.40), load, 1200)) == [(10.0, "reduce_batch")]


def test_the_shipped_sustained_load_scenario_holds_the_cut_and_undoes_it() -> None:
    """`kvguard rules test rules/default.yaml rules/scenarios/default-sustained-load.yaml`
    passes; it fails with an undo on usage under 0.80, which restored the batch at 75 s while
    the load was unchanged, and with one under 0.40, which never restored it."""
    rules = load_rules(default_rules_path())
    assert run_scenario(rules, load_scenario(SCENARIO, rules)).ok
    for below, want in (
        (0.80, [(10.0, "reduce_batch"), (75.0, "restore_batch")]),
        (0.40, [(10.0, "reduce_batch")]),
    ):
        old = on_usage(rules, below)
        out = run_scenario(old, load_scenario(SCENARIO, old))
        assert batch_actions(out.decisions) == want and not out.ok, below


def test_the_demand_cut_is_a_rung_of_the_kv_usage_ladder() -> None:
    """The batch cut reads the KV demand and the halt the KV usage, but both measure the
    device pool, so they are one ladder: on a spike that halts admission before the cut's
    10 s `for` runs out, the halt still comes off first, 10 s after usage falls, not after
    the cut's minute of recovery (rules/scenarios/default-spike.yaml)."""
    rules = load_rules(default_rules_path())
    assert rules.ladder_of("kv_demand") == rules.ladder_of("kv_usage")
    assert rules.ladder_of("gpu_mem") != rules.ladder_of("kv_usage")
    out = run_scenario(rules, load_scenario(SCENARIOS / "default-spike.yaml", rules))
    undos = [(d.time, d.rule) for d in out.decisions if d.undo]
    assert out.ok and undos[:3] == [(70.0, "halt"), (90.0, "fp8-kv"), (120.0, "reduce-batch")]
