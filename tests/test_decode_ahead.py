"""Decode steps run back to back (`serving.decode_steps`): the tokens, texts and finish reasons
of one step at a time, whatever finishes mid-run; blocks accounted exactly; a run only where
the host need not see each token first; the knob's bounds. On the tiny model, CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.config import ConfigError
from kvguard.engine.scheduler import runs_ahead
from kvguard.engine.sequence import Sequence


def _engine(tiny_dir: Path, steps: int, **knobs: object) -> LLMEngine:
    knobs.setdefault("max_num_seqs", 8)
    cfg = EngineConfig(
        model=str(tiny_dir), device="cpu", max_model_len=256, decode_steps=steps, **knobs
    )
    return LLMEngine.from_config(cfg, progress=False)


def _outcome(outs: list) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def _drive(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Step by hand, auditing every block between steps; the finished outputs by request."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.audit_blocks()
    assert eng.scheduler.bm.num_used == 0  # every block back, the ahead ones included
    return [done[i] for i in ids]


def test_runs_give_the_tokens_of_single_steps(tiny_dir: Path) -> None:
    """Sequences ending mid-run (max_tokens, EOS, a stop string, the length limit) take just
    the tokens single steps give them; the rest of the run is dropped with its blocks."""
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    params = [
        SamplingParams(max_tokens=13, ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True),  # ends inside the second run
        SamplingParams(max_tokens=40),  # EOS where the model draws it
        SamplingParams(max_tokens=40, ignore_eos=True, stop=["e"]),
        SamplingParams(max_tokens=1, ignore_eos=True),  # its prompt's token is all it gets
        SamplingParams(max_tokens=300, ignore_eos=True),  # stopped by max_model_len
    ]
    one = _drive(_engine(tiny_dir, 1), prompts, params)
    eng = _engine(tiny_dir, 4)
    ahead = _drive(eng, prompts, params)
    assert _outcome(ahead) == _outcome(one)
    assert one[-1].finish_reason == "length" and len(one[-1].token_ids) > 40
    assert eng.snapshot().counters["steps_ahead"] > 0


def test_runs_draw_temperature_rows_as_single_steps_do(tiny_dir: Path) -> None:
    """Rows sampled with only a temperature are drawn inside a run as `sample` draws them (one
    uniform a row from the global generator, by inverse CDF): from the same global seed, a
    batch of them, greedy rows beside, gets the single steps' tokens, also where a row reaches
    its max_tokens inside a run (it draws no more once single steps would have ended it)."""
    prompts = [[5 + i] * (4 + 5 * i) for i in range(4)]
    params = [
        SamplingParams(max_tokens=m, temperature=t, ignore_eos=True)
        for m, t in ((17, 0.7), (3, 1.0), (17, 1.3), (10, 0.9))
    ]
    outs = []
    for steps in (1, 4):
        eng = _engine(tiny_dir, steps)
        torch.manual_seed(11)
        outs.append(_outcome(eng.generate(prompts, params)))
    assert outs[0] == outs[1]
    assert eng.snapshot().counters["steps_ahead"] > 0
    again = _engine(tiny_dir, 4)
    torch.manual_seed(12)
    assert _outcome(again.generate(prompts, params)) != outs[0]  # the draws are draws

    mixed = [params[0], SamplingParams(max_tokens=17, ignore_eos=True), params[2]]
    got = []
    for steps in (1, 4):
        eng = _engine(tiny_dir, steps)
        torch.manual_seed(5)
        got.append(_outcome(eng.generate(prompts[:3], mixed)))
    assert got[0] == got[1]  # greedy rows beside: the drawn rows take the same uniforms


def test_a_run_never_passes_the_limits_it_must_stop_at(tiny_dir: Path) -> None:
    eng = _engine(tiny_dir, 16)
    out = eng.generate([[7] * 250], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"  # 256 - 250
    eng.audit_blocks()


def test_sampled_requests_and_waiting_ones_keep_single_steps(tiny_dir: Path) -> None:
    """A batch with a seeded, top-p, penalised or log-probability request runs step by step;
    so does a batch with room while a request waits (it waits on something a step may free)."""
    for odd in (
        SamplingParams(max_tokens=12, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9),
        SamplingParams(max_tokens=12, presence_penalty=1.0),
        SamplingParams(max_tokens=12, logprobs=2),
    ):
        eng = _engine(tiny_dir, 4)
        plain = SamplingParams(max_tokens=12, ignore_eos=True)
        eng.generate([[5, 6, 7], [8, 9]], [plain, odd])
        assert eng.snapshot().counters["steps_ahead"] == 0, odd

    eng = _engine(tiny_dir, 4, max_num_seqs=2)
    eng.add_request([5] * 4, SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()  # its prompt
    batch = eng.scheduler.schedule()
    assert eng.scheduler.run_ahead(batch, 4) == 4  # alone, nothing queued
    eng.scheduler.bm.trim(batch.seqs[0])
    batch = eng.scheduler.schedule()
    eng.scheduler.waiting.append(Sequence("queued", [1, 2], SamplingParams(), 1, 0, 64))
    assert eng.scheduler.run_ahead(batch, 4) == 1  # a slot is free: it waits on something else


def _started_at(eng: LLMEngine, prompts: list, params: list) -> tuple[list, int]:
    """Outcomes, and the engine step at which the last request left the queue."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done, started = {}, None
    while eng.has_unfinished():
        done |= {o.request_id: o for o in eng.step() if o.finished}
        if started is None and not eng.scheduler.waiting:
            started = eng.snapshot().step
    return _outcome([done[i] for i in ids]), started


def test_requests_waiting_on_a_full_batch_start_when_single_steps_start_them(
    tiny_dir: Path,
) -> None:
    """With the batch full and a request queued, runs go on but end where the first sequence
    reaches max_tokens: the queued request starts at the very step it starts with single
    steps, and every answer is the same."""
    prompts = [[5 + i] * 4 for i in range(3)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 20, 20)]
    one = _started_at(_engine(tiny_dir, 1, max_num_seqs=2), prompts, params)
    eng = _engine(tiny_dir, 4, max_num_seqs=2)
    ahead = _started_at(eng, prompts, params)
    assert ahead == one
    assert eng.snapshot().counters["steps_ahead"] > 0


def test_a_pool_without_room_for_a_run_steps_one_at_a_time(tiny_dir: Path) -> None:
    """Later steps of a run take only free blocks: with none to spare the batch runs single
    steps (or shorter runs), never preempting anyone, and gives the same tokens."""
    prompts = [[9] * 15, [10] * 15]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    one = _engine(tiny_dir, 1, num_gpu_blocks=6).generate(prompts, params)
    eng = _engine(tiny_dir, 8, num_gpu_blocks=6)
    tight = eng.generate(prompts, params)
    assert _outcome(tight) == _outcome(one)
    assert eng.scheduler.num_preemptions == 0
    assert eng.snapshot().counters["steps_ahead"] > 0  # runs where the blocks were there


def test_each_token_of_a_run_is_timed_when_its_step_was_ready(tiny_dir: Path) -> None:
    """Time per output token stays a step's time: the tokens of a run are not all stamped
    with the moment the host read them."""
    eng = _engine(tiny_dir, 8)
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=33, ignore_eos=True))
    gaps = list(eng._tpot)  # noqa: SLF001 - what the snapshot's median is taken over
    assert len(gaps) == 32 and min(gaps) > 0.0
    assert eng.snapshot().tpot_p50_s > 0.0


def test_which_sequences_may_run_ahead() -> None:
    def seq(**kw: object) -> Sequence:
        return Sequence("r", [1, 2, 3], SamplingParams(**kw), 1, 0, 64)

    assert runs_ahead(seq())
    assert runs_ahead(seq(temperature=0.7, top_k=1))  # greedy all the same
    assert runs_ahead(seq(temperature=0.7))  # drawn on the device
    seeded = seq(temperature=0.7, seed=1)
    seeded.generator = torch.Generator().manual_seed(1)
    assert not runs_ahead(seeded)
    for kw in (
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0.7, "top_k": 5},
        {"frequency_penalty": 0.5},
        {"logit_bias": {3: 1.0}},
        {"logprobs": 0},
        {"prompt_logprobs": 1},
    ):
        assert not runs_ahead(seq(**kw)), kw
    drafted = seq()
    drafted.draft = [4]
    assert not runs_ahead(drafted)


@pytest.mark.parametrize("bad", [0, 17, -1])
def test_decode_steps_out_of_range_is_refused(bad: int) -> None:
    with pytest.raises(ConfigError, match="decode_steps"):
        EngineConfig(model="tiny", decode_steps=bad)


def test_a_run_launches_every_step_before_reading_any(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """Without the CPU kernels (the GPU's path), a run's steps feed each other on the device:
    every step is launched before the host reads the first one's tokens, then the host takes
    them step by step (on a GPU while the later steps run), not by a read between steps."""
    from kvguard.engine.model_runner import ModelRunner, RunTokens
    from kvguard.kernels import cpu_ops

    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    monkeypatch.setattr(cpu_ops, "rows_served", lambda t: False)
    monkeypatch.setattr(cpu_ops, "enabled", lambda t: False)
    one = _engine(tiny_dir, 1).generate(prompts, params)
    eng = _engine(tiny_dir, 4)
    ids = [eng.add_request(p, params) for p in prompts]
    done = {o.request_id: o for o in eng.step() if o.finished}  # the prompts
    order: list[str] = []
    forward, step = ModelRunner.forward, RunTokens.step
    monkeypatch.setattr(
        ModelRunner, "forward", lambda self, inp: (order.append("F"), forward(self, inp))[1]
    )
    monkeypatch.setattr(RunTokens, "step", lambda self, j: (order.append("R"), step(self, j))[1])
    eng.step()  # a run of 4 steps
    assert order == ["F"] * 4 + ["R"] * 4
    assert eng.snapshot().counters["steps_ahead"] == 3
    while eng.has_unfinished():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert eng.scheduler.bm.num_used == 0
    assert _outcome([done[i] for i in ids]) == _outcome(one)


def test_a_refused_draw_ends_the_unfinished_requests_of_its_run(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """A drawn row whose probabilities are not finite fails its run as it fails a single step:
    the requests still going end with an error, a request that finished earlier in the run
    keeps its answer, the engine serves on and every block comes back."""
    from kvguard.engine import sampler

    eng = _engine(tiny_dir, 4)
    short = eng.add_request([5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    hot = eng.add_request([7, 8], SamplingParams(max_tokens=30, temperature=1.0))
    outs = {o.request_id: o for o in eng.step() if o.finished}  # the prompts
    real, calls = sampler.run_draws, []

    def poisoned(logits: torch.Tensor, drawn: tuple | None) -> torch.Tensor:
        calls.append(1)  # from the run's third step on, `hot`'s logits are NaN
        return real(torch.full_like(logits, float("nan")) if len(calls) > 2 else logits, drawn)

    monkeypatch.setattr("kvguard.engine.model_runner.run_draws", poisoned)
    for o in eng.step():  # one run: `short` ends at its second step, `hot` fails at the third
        outs[o.request_id] = o
    assert len(calls) == 4
    monkeypatch.undo()
    assert outs[short].finish_reason == "length" and len(outs[short].token_ids) == 3
    assert outs[hot].finish_reason == "error"
    assert not eng.has_unfinished() and eng.scheduler.bm.num_used == 0
    again = eng.generate([[9, 9]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(again[0].token_ids) == 5


def test_a_greedy_row_of_nan_logits_fails_its_run(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """A greedy row whose logits turn NaN inside a run ends with an error, as in a single
    step (its argmax answered the NaN's index, token 0, and the run went on with it)."""
    from kvguard.engine import sampler

    eng = _engine(tiny_dir, 4)
    hot = eng.add_request([7, 8], SamplingParams(max_tokens=30, ignore_eos=True))
    outs = {o.request_id: o for o in eng.step() if o.finished}  # the prompt
    real, calls = sampler.run_draws, []

    def poisoned(logits: torch.Tensor, drawn: tuple | None) -> torch.Tensor:
        calls.append(1)  # from the run's third step on, the logits are NaN
        return real(torch.full_like(logits, float("nan")) if len(calls) > 2 else logits, drawn)

    monkeypatch.setattr("kvguard.engine.model_runner.run_draws", poisoned)
    for o in eng.step():
        outs[o.request_id] = o
    monkeypatch.undo()
    assert calls and outs[hot].finish_reason == "error"
    assert not eng.has_unfinished() and eng.scheduler.bm.num_used == 0


def test_remedies_apply_between_runs_and_lose_nothing(tiny_dir: Path) -> None:
    """The live FP8 switch, an eviction and a max-token cap, posted while runs are on, apply
    at a run's boundary: every request ends with its tokens, runs go on in the FP8 pool, and
    the blocks add up after every step."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.common import step_apply

    eng = _engine(tiny_dir, 4)
    ids = [
        eng.add_request([5 + i] * 6, SamplingParams(max_tokens=40, ignore_eos=True), priority=p)
        for i, p in enumerate(("normal", "low", "normal", "low"))
    ]
    done: dict[str, object] = {}

    def steps(n: int) -> None:
        for _ in range(n):
            done.update({o.request_id: o for o in eng.step() if o.finished})
            eng.audit_blocks()

    steps(3)
    before = eng.snapshot().counters["steps_ahead"]
    assert before > 0
    assert step_apply(eng, eng.set_kv_cache_dtype("fp8_e4m3")).ok
    steps(2)
    assert eng.snapshot().counters["steps_ahead"] > before  # runs in the FP8 pool too
    assert step_apply(eng, eng.evict(1)).ok
    assert step_apply(eng, eng.set_max_new_tokens_cap(30)).ok
    while eng.has_unfinished():
        steps(1)
    outs = [done[i] for i in ids]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(len(o.token_ids) == 30 for o in outs)
    assert eng.scheduler.bm.num_used == 0


def test_the_daemon_streams_every_token_of_a_run_in_order(tmp_path: Path) -> None:
    """`serving.decode_steps` from the config file, through `kvguard serve` and the real
    `openai` client: a streamed completion's pieces join to the non-streamed text of the
    same greedy request, and the daemon's metrics count the steps run inside runs. The
    inter-token latency is observed per token, not per run: before, a run of 4 tokens was
    one observation of 4 tokens' time (a quarter of the count, 4x the mean)."""
    import urllib.request

    from tests.test_server import Daemon

    d = Daemon(
        tmp_path,
        debug_hooks=False,
        serving="{model: tiny, kv_cache_bytes: 8MiB, max_model_len: 512, decode_steps: 4}",
    )

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        return {x.rsplit(" ", 1)[0]: float(x.rsplit(" ", 1)[1]) for x in lines if x[:1] != "#"}

    try:
        client = d.client()
        ask = {"model": "tiny", "prompt": "abc", "max_tokens": 23, "temperature": 0}
        whole = client.completions.create(**ask).choices[0]
        pieces = [c.choices[0].text for c in client.completions.create(**ask, stream=True)]
        assert whole.finish_reason == "length"
        assert "".join(pieces) == whole.text and len(pieces) > 1
        metrics = scrape()
        assert metrics["kvguard_engine_steps_ahead_total"] > 0
        # two requests of 23 tokens: 22 gaps each, the first token's latency its TTFT
        hist = 'kvguard_{}_seconds_{}{{priority="normal"}}'
        itl, ttft, e2e = ("inter_token_latency", "time_to_first_token", "request_duration")
        assert metrics[hist.format(ttft, "count")] == 2
        assert metrics[hist.format(itl, "count")] == 2 * 22
        # and the gaps add up to each request's time from its first token to its last
        first_to_last = metrics[hist.format(e2e, "sum")] - metrics[hist.format(ttft, "sum")]
        assert metrics[hist.format(itl, "sum")] == pytest.approx(first_to_last, abs=1e-6)
    finally:
        assert d.stop() == 0


def test_a_runner_of_several_ranks_keeps_single_steps(tiny_dir: Path) -> None:
    """Every step of a distributed runner is one its other ranks are sent: no runs there (the
    engine asks the runner), whatever the knob says."""
    from kvguard.engine.distributed.driver import TensorParallelRunner

    assert TensorParallelRunner.can_run_ahead is False
    eng = _engine(tiny_dir, 4)
    eng.runner.can_run_ahead = False
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].token_ids) == 12
    assert eng.snapshot().counters["steps_ahead"] == 0


def test_a_high_arrival_interrupts_a_run_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """A run is one step to `interrupt_for_high`: set while its second step computes, the run
    stops between layers, its work is dropped with the blocks only its later steps took, and
    the answers are the single steps' all the same."""
    from kvguard.engine.model_runner import ModelRunner

    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    one = _engine(tiny_dir, 1).generate(prompts, params)
    eng = _engine(tiny_dir, 4)
    ids = [eng.add_request(p, params) for p in prompts]
    done = {o.request_id: o for o in eng.step() if o.finished}  # the prompts
    calls, forward = [], ModelRunner.forward

    def second_interrupts(self: ModelRunner, inp: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            eng.interrupt.set()  # as a high request's arrival does, from another thread
        return forward(self, inp)

    monkeypatch.setattr(ModelRunner, "forward", second_interrupts)
    assert eng.step() == []
    monkeypatch.undo()
    assert eng.snapshot().counters["steps_interrupted"] == 1
    eng.audit_blocks()  # the blocks taken for the later steps went back
    while eng.has_unfinished():
        done |= {o.request_id: o for o in eng.step() if o.finished}
        eng.audit_blocks()
    assert _outcome([done[i] for i in ids]) == _outcome(one)
