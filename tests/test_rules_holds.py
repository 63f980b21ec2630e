"""Rules that share an engine setting: a remedy in force holds the settings it set, and another
rule's undo leaves those alone (it restores only the rest). Also what a reload or a dry-run
switch does to remedies in force, event rules that act again, and alerts that resolve, fire
again or whose undo is refused. The evaluator runs on a fake clock against a model of the
engine's settings, set the way rules/actions.py sets them."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvguard.engine.control import ActionResult
from kvguard.rules.actions import _chain, settings_set
from kvguard.rules.evaluator import Evaluator
from kvguard.rules.schema import load_rules_text

CONFIGURED = {"batch": 32, "kv_dtype": "fp32", "admission": "open", "offload": False}
# what the OOM chain's steps are called in its result (the engine calls that ran them)
OOM_STEPS = ["reduce_max_num_seqs", "evict", "set_kv_cache_dtype"]


class Engine:
    """The settings remedies change, changed as the actions change them."""

    def __init__(self) -> None:
        self.k = dict(CONFIGURED)
        self.calls: list[str] = []
        self.refuse: set[str] = set()
        self.oom_steps = list(OOM_STEPS)

    def __call__(self, action: str, params: dict[str, Any]) -> ActionResult:
        self.calls.append(action)
        before = dict(self.k)
        if action in self.refuse:
            return ActionResult(action, before, before, "refused (scripted)", False)
        k, data = self.k, {}
        if action == "reduce_batch":
            k["batch"] = max(1, int(k["batch"] * params.get("factor", 0.5)))
        elif action == "restore_batch":
            k["batch"] = CONFIGURED["batch"]
        elif action == "set_max_num_seqs":
            k["batch"] = params["n"]
        elif action == "enable_fp8_kv":
            k["kv_dtype"] = "fp8_e4m3"
        elif action == "disable_fp8_kv":
            k["kv_dtype"] = CONFIGURED["kv_dtype"]
        elif action == "halt_admission":
            k["admission"] = "halted"
        elif action == "resume_admission":
            k["admission"] = "open"
        elif action == "disable_cpu_offload":
            k["offload"] = CONFIGURED["offload"]
        elif action == "handle_oom":
            k["batch"], k["kv_dtype"] = max(1, k["batch"] // 2), "fp8_e4m3"
            data = {"steps": self.oom_steps, "applied": self.oom_steps}
        elif action == "recover_from_oom":
            k.update(CONFIGURED)
        # the batch limit as the engine's knobs name it: what a relative cut left
        return ActionResult(action, before, {**k, "max_num_seqs": k["batch"]}, "ok", True, data)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


HEADER = """version: 1
interval: 5s
cooldown: 30s
signals:
  kv: {local: kv_cache_usage_ratio}
  gpu: {local: gpu_memory_used_ratio}
rules:
"""
BATCH = (
    "  - {name: batch, signal: kv, above: 0.92, action: reduce_batch, recover_below: 0.8,"
    " recover_for: 10s, undo: restore_batch}\n"
)
FP8 = (
    "  - {name: fp8, signal: kv, above: 0.97, action: enable_fp8_kv, recover_below: 0.2,"
    " recover_for: 10s, undo: disable_fp8_kv}\n"
)
HALT = (
    "  - {name: halt, signal: kv, above: 0.99, action: halt_admission, recover_below: 0.8,"
    " recover_for: 10s, undo: resume_admission}\n"
)
GPU_HALT = (
    "  - {name: gpu-halt, signal: gpu, above: 0.95, action: halt_admission,"
    " recover_below: 0.9, recover_for: 10s, undo: resume_admission}\n"
)
OOM = (
    "  - {name: oom, on: engine_oom, action: handle_oom, cooldown: 10s,"
    " undo: recover_from_oom, recover_for: 60s}\n"
)
ALERT = "  - {name: am, on: 'alert:GPUNearOOM', action: halt_admission, undo: resume_admission}\n"


class Harness:
    def __init__(self, rules: str, dry_run: bool = False) -> None:
        self.clock = Clock()
        self.engine = Engine()
        self.values: dict[str, float | None] = {"kv": 0.5, "gpu": 0.5}
        self.ev = Evaluator(
            load_rules_text(HEADER + rules, "test.yaml"),
            lambda name, _sig: self.values.get(name),
            self.engine,
            clock=self.clock,
            wall_clock=self.clock,
            dry_run=dry_run,
        )

    def at(self, t: float, **values: float | None) -> list[tuple[str, str, str]]:
        """Tick at `t` with `values` set (they hold until set again)."""
        self.clock.t = t
        self.values.update(values)
        return [(d.rule, d.action, d.outcome) for d in self.ev.tick()]

    def event(self, t: float, kind: str, resolved: bool = False) -> list[tuple[str, str, str]]:
        self.clock.t = t
        return [
            (d.rule, d.action, d.outcome) for d in self.ev.handle_event(kind, resolved=resolved)
        ]

    def run(self, start: float, stop: float, **values: float | None) -> list[tuple]:
        out = []
        for t in range(int(start), int(stop) + 1, 5):
            out += [(t, *d) for d in self.at(t, **values)]
        return out


def test_one_rules_undo_leaves_a_setting_another_remedy_still_holds() -> None:
    """GPU memory halts admission and stays high; KV spikes and halts it too, then recovers:
    its undo must not reopen admission under the GPU rule (which, firing, would never act
    again). Admission opens only once both have recovered."""
    h = Harness(HALT + GPU_HALT)
    assert h.at(0, gpu=0.96) == [("gpu-halt", "halt_admission", "applied")]
    assert h.at(5, kv=0.995) == [("halt", "halt_admission", "applied")]
    h.at(10, kv=0.5)
    assert h.at(20) == [("halt", "resume_admission", "held")]
    assert h.engine.k["admission"] == "halted" and h.engine.calls.count("resume_admission") == 0
    assert "admission (held by gpu-halt)" in h.ev.decisions[-1].detail
    holds = {r["name"]: r["holds"] for r in h.ev.rule_states()}  # /admin/state shows them
    assert holds == {"halt": [], "gpu-halt": ["admission"]}
    h.run(25, 60)
    assert h.engine.k["admission"] == "halted"  # the GPU is still near full
    h.at(65, gpu=0.5)
    assert h.at(75) == [("gpu-halt", "resume_admission", "applied")]
    assert h.engine.k["admission"] == "open" and h.ev.incident is None


def test_an_alert_resolving_keeps_admission_halted_while_kv_is_critical() -> None:
    h = Harness(HALT + ALERT)
    h.at(0, kv=0.995)
    assert h.event(5, "alert:GPUNearOOM") == [("am", "halt_admission", "applied")]
    assert h.event(10, "alert:GPUNearOOM", resolved=True) == [("am", "resume_admission", "held")]
    assert h.engine.k["admission"] == "halted"
    h.at(15, kv=0.5)
    assert h.at(25) == [("halt", "resume_admission", "applied")]
    assert h.engine.k["admission"] == "open"


def test_the_oom_chains_undo_restores_only_what_no_rung_in_force_holds() -> None:
    """The chain halved the batch and switched to FP8; the ladder's batch and FP8 rungs and
    the halt act after it and stay in force: `recover_from_oom` 60s later must not reset
    them (before, it reset all four, and the rungs, firing, never acted again)."""
    h = Harness(BATCH + FP8 + HALT + OOM)
    h.engine.oom_steps = [*OOM_STEPS, "set_offload"]
    assert h.event(0, "engine_oom") == [("oom", "handle_oom", "applied")]
    h.run(5, 20, kv=0.995)  # batch, fp8 and halt act, one a tick
    assert [n for n in h.ev.applied] == ["oom", "batch", "fp8", "halt"]
    h.run(25, 120)
    halted = {"batch": 8, "kv_dtype": "fp8_e4m3", "admission": "halted", "offload": False}
    assert h.engine.k == halted  # 32 halved by the chain, halved again by the rung
    # the chain is the oldest remedy: undone once the rungs above it are, as usage falls;
    # the rungs' undos leave the batch and FP8 to the chain, which still holds them: FP8
    # stays, the batch goes back to the chain's 16 (not to the configured 32)
    h.run(125, 175, kv=0.1)
    undos = [d for d in h.ev.decisions if d.undo]
    assert [(d.rule, d.action, d.outcome) for d in undos] == [
        ("halt", "resume_admission", "applied"),
        ("fp8", "disable_fp8_kv", "held"),
        ("batch", "restore_batch", "applied"),
        ("oom", "recover_from_oom", "applied"),
    ]
    assert "set_max_num_seqs: ok, what oom still holds" in undos[2].detail
    assert h.engine.k == CONFIGURED and h.ev.incident is None


def test_the_oom_chain_undone_first_keeps_the_settings_of_rungs_still_in_force() -> None:
    """An OOM while the batch and FP8 rungs are in force, usage high: the chain's undo (60s
    later) puts back what only it set (offload, admission), leaves FP8 to its rung, and
    puts the batch at the rung's 16: the chain's own 8 was stricter, and the configured 32
    would undo the rung."""
    h = Harness(BATCH + FP8 + OOM)
    assert h.at(0, kv=0.98) == [("batch", "reduce_batch", "applied")]
    assert h.at(5) == [("fp8", "enable_fp8_kv", "applied")]
    assert h.event(6, "engine_oom") == [("oom", "handle_oom", "applied")]
    assert h.ev.applied == ["batch", "fp8", "oom"]
    assert h.engine.k["batch"] == 8
    assert h.run(10, 70) == [(70, "oom", "recover_from_oom", "applied")]
    undo = next(d for d in h.ev.decisions if d.undo)
    assert "set_max_num_seqs: ok, what batch still holds" in undo.detail
    assert "kept: kv_dtype (held by fp8)" in undo.detail
    assert h.engine.k["batch"] == 16 and h.engine.k["kv_dtype"] == "fp8_e4m3"
    assert "restore_batch" not in h.engine.calls and "disable_fp8_kv" not in h.engine.calls


def test_an_event_rule_that_acts_again_goes_back_on_top_of_the_undo_stack() -> None:
    h = Harness(BATCH + OOM)
    h.event(0, "engine_oom")
    h.at(5, kv=0.95)
    assert h.ev.applied == ["oom", "batch"]
    assert h.event(20, "engine_oom") == [("oom", "handle_oom", "applied")]
    assert h.ev.applied == ["batch", "oom"]  # the newest remedy is undone first
    h.run(25, 70, kv=0.5)
    assert not any(d.undo for d in h.ev.decisions)  # batch waits for the chain (60s)
    h.run(75, 100)
    assert [(d.rule, d.outcome) for d in h.ev.decisions if d.undo] == [
        ("oom", "applied"),
        ("batch", "applied"),
    ]


def test_a_chain_that_applied_some_steps_is_in_force_and_undone() -> None:
    """The OOM chain with its FP8 step refused (no room for the FP8 pool beside the old one)
    still halved the batch: it is in force (applied, on the undo stack), not `refused` and
    forgotten with the batch at half for good. An undo chain is ok only whole."""

    def done(ok: bool, action: str) -> Future:
        f: Future = Future()
        f.set_result(ActionResult(action, {}, {}, "refused" if not ok else "ok", ok))
        return f

    steps = [done(True, "reduce_max_num_seqs"), done(False, "set_kv_cache_dtype")]
    res = _chain("handle_oom", steps, in_force=any).result(0)
    assert res.ok and res.data["applied"] == ["reduce_max_num_seqs"]
    assert settings_set("handle_oom", res) == {"batch"}
    undo = _chain("recover_from_oom", [done(True, "set_max_num_seqs"), done(False, "x")])
    assert not undo.result(0).ok


def test_a_reload_undoes_the_remedies_of_rules_it_removes_or_changes() -> None:
    """Renamed: the old rule's halt is undone (held while the renamed rule, acting at once,
    holds admission; the new rule undoes it at recovery). Changed remedy: undone with the
    undo it was applied with. Removed: undone. Nothing stays in force untracked, and the
    incident closes."""
    h = Harness(BATCH + HALT)
    h.at(0, kv=0.995)
    h.at(5)
    assert h.engine.k["admission"] == "halted" and h.engine.k["batch"] == 16
    rules = HEADER + BATCH.replace("undo: restore_batch", "undo: restore_batch, for: 5s")
    rules += HALT.replace("name: halt,", "name: halt-v2,")
    h.ev.replace_rules(load_rules_text(rules, "reloaded.yaml"))
    got = h.at(10)
    assert ("halt-v2", "halt_admission", "applied") in got
    assert ("halt", "resume_admission", "held") in got
    assert h.engine.k["admission"] == "halted" and h.ev.retiring == []
    h.run(15, 60, kv=0.5)
    assert h.engine.k == CONFIGURED and h.ev.incident is None and h.ev.applied == []

    h = Harness(BATCH + HALT)
    h.at(0, kv=0.995)
    h.at(5)
    h.ev.replace_rules(load_rules_text(HEADER + BATCH, "reloaded.yaml"))  # halt removed
    got = h.at(10, kv=0.5)
    assert ("halt", "resume_admission", "applied") in got
    assert h.engine.k["admission"] == "open"
    assert "rule removed by a reload" in h.ev.decisions[-1].detail
    changed = BATCH.replace("reduce_batch,", "reduce_batch, params: {factor: 0.25},")
    h.ev.replace_rules(load_rules_text(HEADER + changed, "reloaded.yaml"))
    assert h.at(15) == [("batch", "restore_batch", "applied")]
    assert h.engine.k == CONFIGURED and h.ev.incident is None


def test_a_reload_loosening_a_firing_alert_rules_remedy_leaves_the_old_undo_held() -> None:
    """The alert fires, its rule sets the batch to 8; a reload gives it 16 instead. The new
    act (its alert still fires) applies 16 at once; the old remedy's undo then has nothing to
    do: `held`, not an `applied` one that sets the 16 already in force (it was counted as a
    change in the audit and kvguard_actions_total)."""
    rule = (
        "  - {name: am, on: 'alert:GPUNearOOM', action: set_max_num_seqs, params: {n: 8},"
        " undo: restore_batch}\n"
    )
    h = Harness(rule)
    assert h.event(0, "alert:GPUNearOOM") == [("am", "set_max_num_seqs", "applied")]
    assert h.engine.k["batch"] == 8
    fresh = h.ev.replace_rules(load_rules_text(HEADER + rule.replace("n: 8", "n: 16"), "r.yaml"))
    assert fresh == ["am"]
    # what the control plane does for an alert rule a reload started afresh while it fires
    acted = h.ev.handle_event("alert:GPUNearOOM", only=fresh, note="its alert still fires")
    assert [(d.action, d.outcome) for d in acted] == [("set_max_num_seqs", "applied")]
    assert h.engine.k["batch"] == 16
    assert h.at(5) == [("am", "restore_batch", "held")]
    undo = h.ev.decisions[-1]
    assert undo.trigger == "reload" and "nothing restored: batch (held by am)" in undo.detail
    assert h.engine.calls == ["set_max_num_seqs", "set_max_num_seqs"]  # nothing set twice
    assert h.ev.retiring == [] and h.engine.k["batch"] == 16
    # the new remedy is the one in force: its undo, when the alert resolves, puts 32 back
    assert h.event(9, "alert:GPUNearOOM", resolved=True) == [("am", "restore_batch", "applied")]
    assert h.engine.k == CONFIGURED and h.ev.incident is None


def test_switching_dry_run_on_undoes_real_remedies_and_off_forgets_simulated_ones() -> None:
    h = Harness(BATCH)
    assert h.at(0, kv=0.95) == [("batch", "reduce_batch", "applied")]
    h.ev.set_dry_run(True)
    # the rule, afresh, acts in the dry run; the real remedy is undone for real (a simulated
    # one holds nothing real)
    assert h.at(5) == [
        ("batch", "reduce_batch", "dry_run"),
        ("batch", "restore_batch", "applied"),
    ]
    assert h.engine.k == CONFIGURED
    assert h.at(10) == []
    h.ev.set_dry_run(False)
    assert h.at(15) == [("batch", "reduce_batch", "applied")]  # acts live at once
    assert h.engine.calls == ["reduce_batch", "restore_batch", "reduce_batch"]


def test_an_alert_that_fires_again_inside_the_cooldown_acts() -> None:
    h = Harness(ALERT)
    assert h.event(0, "alert:GPUNearOOM") == [("am", "halt_admission", "applied")]
    assert h.event(10, "alert:GPUNearOOM", resolved=True)[0][2] == "applied"
    assert h.event(20, "alert:GPUNearOOM") == [("am", "halt_admission", "applied")]
    assert h.engine.k["admission"] == "halted"


def test_a_refused_alert_undo_is_retried_after_the_cooldown() -> None:
    h = Harness(ALERT)
    h.event(0, "alert:GPUNearOOM")
    h.engine.refuse = {"resume_admission"}
    assert h.event(10, "alert:GPUNearOOM", resolved=True) == [("am", "resume_admission", "refused")]
    assert h.ev.incident is not None  # the remedy is still in force
    h.engine.refuse = set()
    assert h.run(15, 35) == []  # cooldown 30s from the refusal
    assert h.at(40) == [("am", "resume_admission", "applied")]
    assert h.engine.k["admission"] == "open" and h.ev.incident is None


def test_the_level_counts_event_and_alert_rules_in_force() -> None:
    """`kvguard_degradation_level` (and an incident's peak) is the file index of the last
    rule in force, the OOM chain and an alert's halt included: before, both left it at 0, so
    the alert on a prolonged degradation never saw them."""
    h = Harness(BATCH + OOM + ALERT)
    assert h.ev.level() == 0
    h.event(0, "engine_oom")
    assert h.ev.level() == 2
    h.event(1, "alert:GPUNearOOM")
    assert h.ev.level() == 3


def test_kvguard_status_names_the_rules_that_halted_admission(capsys) -> None:  # noqa: ANN001
    from kvguard.daemon.cli_serve import _print_state

    state = {
        "model": "tiny",
        "ready": True,
        "draining": False,
        "kv": {
            "dtype": "fp32",
            "device": {"blocks_used": 1, "blocks_total": 10, "usage_ratio": 0.1},
            "host": {"blocks_used": 0, "blocks_total": 0},
        },
        "queues": {s: {"high": 0} for s in ("running", "waiting", "swapped")},
        "admission": {"halted": True, "allow_priority": "high"},
        "knobs": {},
        "preemptions": {},
        "rules": [
            {"name": "halt", "state": "firing", "holds": ["admission"]},
            {"name": "batch", "state": "firing", "holds": ["batch"]},
            {"name": "gpu-halt", "state": "recovering", "holds": ["admission"]},
        ],
    }
    _print_state(state)
    out = capsys.readouterr().out
    assert "admission    halted (allowed: high) by halt, gpu-halt\n" in out
    # an operator's admin action holding it too is named (`manual` in /admin/state)
    _print_state({**state, "manual": {"holds": ["admission"], "asked": {"admission": "high"}}})
    out = capsys.readouterr().out
    assert "admission    halted (allowed: high) by halt, gpu-halt, manual\n" in out


def test_the_oom_chain_acting_again_keeps_holding_what_its_first_run_set() -> None:
    """The chain's second run skips FP8 (on since its first): what it holds must still
    include the KV dtype, or the FP8 rung's undo would switch back under the chain."""
    h = Harness(FP8 + OOM)
    h.event(0, "engine_oom")  # halves the batch, FP8 on
    h.engine.oom_steps = ["reduce_max_num_seqs", "evict"]  # FP8 already on: skipped
    assert h.event(12, "engine_oom") == [("oom", "handle_oom", "applied")]
    assert h.ev.states["oom"].holds == {"batch", "kv_dtype"}
    h.at(15, kv=0.98)  # the FP8 rung acts, on top of the undo stack
    got = h.run(20, 40, kv=0.1)
    assert (30, "fp8", "disable_fp8_kv", "held") in got, got
    assert h.engine.k["kv_dtype"] == "fp8_e4m3"


def test_a_reload_that_changes_a_rules_trigger_undoes_its_remedy() -> None:
    """A reload keeps a rule's name and remedy but changes what it acts on: its state was kept,
    and with it the remedy in force for good. A signal rule made an event rule is no longer
    evaluated on its signal (it never recovered), and an alert rule listening on another
    alert is never told that the old one resolved. The remedy is undone, the rule afresh."""
    h = Harness(BATCH)
    assert h.at(0, kv=0.95) == [("batch", "reduce_batch", "applied")]
    h.at(5, kv=0.5)  # recovering
    event = (
        "  - {name: batch, on: engine_oom, action: reduce_batch, recover_for: 20s,"
        " undo: restore_batch}\n"
    )
    assert h.ev.replace_rules(load_rules_text(HEADER + event, "reloaded.yaml")) == ["batch"]
    assert h.at(10) == [("batch", "restore_batch", "applied")]
    assert "rule given another trigger by a reload" in h.ev.decisions[-1].detail
    assert h.engine.k == CONFIGURED and h.ev.incident is None and h.ev.level() == 0

    h = Harness(ALERT)
    assert h.event(0, "alert:GPUNearOOM") == [("am", "halt_admission", "applied")]
    renamed = ALERT.replace("alert:GPUNearOOM", "alert:GPUMemoryNearOOM")
    assert h.ev.replace_rules(load_rules_text(HEADER + renamed, "reloaded.yaml")) == ["am"]
    assert h.event(5, "alert:GPUNearOOM", resolved=True) == []  # no rule listens on it now
    assert h.at(10) == [("am", "resume_admission", "applied")]
    assert h.engine.k["admission"] == "open" and h.ev.incident is None


def test_the_oom_chain_is_undone_recover_for_after_the_last_oom_one_skipped_included() -> None:
    """`recover_for` after the last OOM: one inside the chain's cooldown does not run it again,
    but the engine ran out of memory then, and the 60s count from it (they counted from the
    chain's last run, and undid it 52s after an OOM)."""
    h = Harness(OOM)
    assert h.event(0, "engine_oom") == [("oom", "handle_oom", "applied")]
    assert h.event(8, "engine_oom") == []  # inside its 10s cooldown: not run again
    assert h.run(5, 65) == []
    assert h.at(70) == [("oom", "recover_from_oom", "applied")]  # 68s: 60s after the last OOM
    assert h.engine.calls == ["handle_oom", "recover_from_oom"] and h.ev.incident is None


def test_an_undo_is_audited_with_its_rules_trigger() -> None:
    """The OOM chain's undo (an event rule's, `on: engine_oom`, no signal) is trigger `event`,
    as its act is; it was `signal`, misfiling every recovery in a report by trigger. A
    signal rule's undo stays `signal` (with its value), an alert rule's `alert`."""
    h = Harness(BATCH + OOM + ALERT)
    h.event(0, "engine_oom")
    h.at(5, kv=0.95)
    h.event(6, "alert:GPUNearOOM")
    h.event(8, "alert:GPUNearOOM", resolved=True)
    h.run(10, 30, kv=0.5)
    h.run(35, 70)
    rows = [(d.rule, d.action, d.trigger, d.value) for d in h.ev.decisions]
    assert rows == [
        ("oom", "handle_oom", "event", None),
        ("batch", "reduce_batch", "signal", 0.95),
        ("am", "halt_admission", "alert", None),
        ("am", "resume_admission", "alert", None),
        ("batch", "restore_batch", "signal", 0.5),
        ("oom", "recover_from_oom", "event", None),
    ]


def test_an_alert_rule_in_force_does_not_act_again_on_another_alert_of_its_name() -> None:
    """GPU 1's GPUNearOOM while GPU 0's holds the rule's remedy (the webhook takes each alert
    once, by fingerprint): the rule acted again past its cooldown, halving a halved batch (or
    halting a second time). It holds until its alerts resolve."""
    cut = "  - {name: am, on: 'alert:GPUNearOOM', action: reduce_batch, undo: restore_batch}\n"
    h = Harness(cut)
    assert h.event(0, "alert:GPUNearOOM") == [("am", "reduce_batch", "applied")]
    assert h.event(40, "alert:GPUNearOOM") == []  # past the 30s cooldown: in force already
    assert h.engine.k["batch"] == 16 and h.engine.calls == ["reduce_batch"]
    assert h.event(50, "alert:GPUNearOOM", resolved=True) == [("am", "restore_batch", "applied")]
    assert h.engine.k == CONFIGURED and h.ev.incident is None
    # calm again, the next alert of its name acts
    assert h.event(55, "alert:GPUNearOOM") == [("am", "reduce_batch", "applied")]
