"""kvguard as a Python library: what a step interrupted at any point hands on, how a config
and a request built in Python code are typed, how a refused prompt of a batch is named, and
how misuse is refused: two threads driving one engine, control calls after shutdown."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy
import pytest

from kvguard.daemon.cli import main
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.config import ConfigError
from kvguard.engine.sequence import RequestOutput

GREEDY10 = SamplingParams(max_tokens=10, ignore_eos=True)


def make_engine(model: str | Path = "tiny") -> LLMEngine:
    config = EngineConfig(model=model, kv_cache_bytes="32MiB", num_threads=2)
    return LLMEngine.from_config(config, progress=False)


@pytest.fixture(scope="module")
def tiny() -> LLMEngine:
    return make_engine()


def interrupt_snapshot_once(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, at_call: int
) -> None:
    """Ctrl-C landing in the snapshot a step builds after its tokens were sampled and taken
    (where a real one landed, timer-driven, in the bug hunt): once, at the `at_call`th one."""
    real, calls = engine.snapshot, []

    def snapshot():  # noqa: ANN202 - an EngineSnapshot
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(engine, "snapshot", snapshot)


def step_to_end(engine: LLMEngine) -> list[Any]:
    """Step as a notebook user does after Ctrl-C: carry on until nothing is left."""
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def assert_whole_stream(outs: list[Any], request_id: str, n: int) -> None:
    """The request's deltas, joined, are its final output: no token missing from the stream."""
    mine = [o for o in outs if o.request_id == request_id]
    assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
    whole = [t for o in mine for t in o.new_token_ids]
    assert len(mine[-1].token_ids) == n and whole == mine[-1].token_ids
    assert mine[-1].num_output_tokens == n


def test_a_step_interrupted_at_its_end_hands_its_outputs_to_the_next_step(
    tiny: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step interrupted after its tokens were taken used to put back only the finished
    outputs (and none at all when the interrupt hit its snapshot): a running request's delta
    was lost, so its stream had 9 of the final output's 10 tokens."""
    rid = tiny.add_request("hello world", GREEDY10)
    interrupt_snapshot_once(tiny, monkeypatch, at_call=3)
    outs = [*tiny.step(), *tiny.step()]
    with pytest.raises(KeyboardInterrupt):
        tiny.step()
    outs += step_to_end(tiny)
    assert_whole_stream(outs, rid, 10)
    tiny.audit_blocks()


def test_generate_interrupted_hands_other_requests_outputs_on(
    tiny: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: an exception while generate() runs aborts its own requests, and a request
    added before with add_request gets its outputs of generate's steps from the next step().
    An interrupt in the snapshot of generate's step used to drop them (a token missing)."""
    rid = tiny.add_request("Once upon a time", GREEDY10)
    outs = tiny.step()
    interrupt_snapshot_once(tiny, monkeypatch, at_call=3)
    with pytest.raises(KeyboardInterrupt):
        tiny.generate(["The capital of France is"], GREEDY10)
    outs += step_to_end(tiny)
    assert {o.request_id for o in outs} == {rid}  # generate's aborted request: not handed out
    assert_whole_stream(outs, rid, 10)
    assert tiny.snapshot().blocks_used == 0


@pytest.mark.parametrize(
    ("field", "bad", "expected"),
    [
        ("max_num_seqs", "4", "an int"),
        ("max_num_seqs", 4.5, "an int"),
        ("max_num_seqs", True, "an int"),
        ("num_gpu_blocks", 1.5, "an int or None"),
        ("enable_prefix_caching", "false", r"a bool \(True or False\)"),
        ("gpu_memory_utilization", "0.9", "a number"),
        ("kv_cache_dtype", 8, "a string"),
    ],
)
def test_a_config_built_in_python_refuses_a_wrong_type_by_name(
    field: str, bad: Any, expected: str
) -> None:
    """Not typed by the file loader, these failed with a TypeError naming no field, or passed
    quietly: 4.5 sequences, and `enable_prefix_caching="false"` kept the cache on."""
    with pytest.raises(ConfigError, match=rf"^{field}={bad!r}: expected {expected}, got "):
        EngineConfig(model="tiny", **{field: bad})


def test_a_config_takes_a_path_model_and_numpy_counts(tiny_dir: Path) -> None:
    """A Path is the natural type for a model directory (it raised "object of type
    'PosixPath' has no len()"); a numpy integer count is read as the int it is."""
    config = EngineConfig(model=tiny_dir, max_num_seqs=numpy.int64(4))
    assert config.model == str(tiny_dir) and type(config.max_num_seqs) is int
    engine = make_engine(tiny_dir)
    assert len(engine.generate(["hi"], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_a_refused_prompt_of_a_batch_is_named_by_its_index(tiny: LLMEngine) -> None:
    """In a batch of hundreds, "prompt is empty" alone did not say which prompt; the
    refusal keeps its type (an AdmissionRejected keeps its decision)."""
    vocab = tiny.model_config.vocab_size
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt is empty") as got:
        tiny.generate(["ok", "", "fine"], SamplingParams(max_tokens=2))
    assert got.value.prompt_index == 1
    with pytest.raises(ValueError, match=rf"^prompts\[2\]: prompt token ids \[{vocab}\] are"):
        tiny.generate(["ok", [5], [vocab]], SamplingParams(max_tokens=2))
    assert not tiny.has_unfinished() and tiny.snapshot().blocks_used == 0


def test_kvguard_generate_names_the_refused_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """The command line counts its prompts from 1."""
    assert main(["generate", "--model", "tiny", "--max-tokens", "2", "ok", ""]) == 2
    err = capsys.readouterr().err
    assert "kvguard: error: prompt 2 of 2: prompt is empty" in err, err


@pytest.mark.parametrize(
    ("flag", "value", "refused"),
    [
        ("--max-tokens", "0", "--max-tokens 0: expected an integer >= 1"),
        ("--temperature", "-1", "--temperature -1.0: expected a finite number >= 0"),
        ("--top-p", "2", "--top-p 2.0: expected a number in [0, 1]"),
        ("--top-k", "-1", "--top-k -1: expected an integer >= 0 (0 disables)"),
    ],
)
def test_kvguard_generate_names_the_flag_it_refuses(
    flag: str, value: str, refused: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--max-tokens 0` was refused as `max_tokens=0`, the library's field, which the command
    line never showed the user: the flag is named as it is typed."""
    assert main(["generate", "--model", "tiny", flag, value, "hi"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvguard: error: {refused}\n", err


def test_sampling_params_of_the_wrong_type_or_numpy_counts(tiny: LLMEngine) -> None:
    """A dict where a SamplingParams belongs raised AttributeError ('dict' object has no
    attribute 'validate'); numpy integer counts were refused although prompts take them."""
    with pytest.raises(TypeError, match=r"^params=\{'max_tokens': 2\}: expected a SamplingParams"):
        tiny.generate(["hi"], {"max_tokens": 2})  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=numpy.int64(3), logprobs=numpy.int32(2), ignore_eos=True)
    assert type(params.max_tokens) is int and type(params.logprobs) is int
    out = tiny.generate(["hi"], params)[0]
    assert len(out.token_ids) == 3 and len(out.final_logprobs) == 3


@contextmanager
def first_forward_held(engine: LLMEngine) -> Iterator[threading.Event]:
    """Hold the engine's first forward pass until the block ends: yields an Event set once a
    thread is inside it (a step under way, its batch scheduled). Later forwards run freely."""
    real, inside, release = engine.runner.execute, threading.Event(), threading.Event()

    def execute(*args: Any) -> list[list[int]]:
        if not inside.is_set():
            inside.set()
            assert release.wait(60), "the test never let the held forward go"
        return real(*args)

    engine.runner.execute = execute  # type: ignore[method-assign]
    try:
        yield inside
    finally:
        release.set()
        engine.runner.execute = real  # type: ignore[method-assign]


def test_a_second_thread_driving_the_engine_is_refused_and_the_step_goes_on() -> None:
    """Two threads stepping one engine at once got no error: the second step ran the same
    sequences again and every request ended with finish_reason `error`. The second call now
    raises at once, naming the thread in the step, and touches nothing."""
    engine = make_engine()
    done: list[list[RequestOutput]] = []
    driver = threading.Thread(
        target=lambda: done.append(engine.generate(["hello world", "Once upon"], GREEDY10)),
        name="notebook-driver",
    )
    with first_forward_held(engine) as inside:
        driver.start()
        assert inside.wait(60), "the driving thread never reached its forward pass"
        busy = r"^{}\(\) called while generate\(\) is already running in thread 'notebook-driver'; "
        for call, name in ((engine.step, "step"), (lambda: engine.generate(["x"]), "generate")):
            with pytest.raises(RuntimeError, match=busy.format(name) + "one thread drives"):
                call()
        with pytest.raises(RuntimeError, match=busy.format("score")):
            engine.score([1, 2, 3])
        queues = engine.snapshot().queues  # the refused generate added nothing
        assert sum(queues["waiting"].values()) == 0 and sum(queues["running"].values()) == 2
    driver.join(60)
    assert not driver.is_alive() and len(done) == 1
    assert [(o.finish_reason, len(o.token_ids)) for o in done[0]] == [("length", 10)] * 2
    engine.audit_blocks()
    assert len(engine.generate(["free again"], GREEDY10)[0].token_ids) == 10


CONTROL_CALLS: dict[str, Callable[[LLMEngine], Future]] = {
    "set_kv_cache_dtype": lambda e: e.set_kv_cache_dtype("fp8_e4m3"),
    "set_max_num_seqs": lambda e: e.set_max_num_seqs(2),
    "reduce_max_num_seqs": lambda e: e.reduce_max_num_seqs(0.5),
    "evict": lambda e: e.evict(1),
    "set_kv_pool_share": lambda e: e.set_kv_pool_share(0.5),
    "reconfigure": lambda e: e.reconfigure({"serving.max_num_seqs": 8}),
    "set_offload": lambda e: e.set_offload(False),
    "set_max_new_tokens_cap": lambda e: e.set_max_new_tokens_cap(5),
    "halt_admission": lambda e: e.halt_admission(),
    "resume_admission": lambda e: e.resume_admission(),
}


def test_control_calls_after_shutdown_fail_at_once() -> None:
    """A control call after shutdown() returned a Future that never resolved (no step would
    come to apply it), so a caller waiting on it hung; one posted before shutdown() too. Each
    Future now fails with EngineShutDown, a RuntimeError saying the engine is shut down."""
    engine = make_engine()
    before = engine.set_max_num_seqs(3)
    engine.shutdown()
    futures = {"posted before shutdown": before}
    futures |= {name: call(engine) for name, call in CONTROL_CALLS.items()}
    for name, fut in futures.items():
        with pytest.raises(RuntimeError, match="^engine is shut down: it takes no more"):
            fut.result(timeout=10)  # generous: it has already failed
        assert fut.done(), name


def test_kvguard_generate_reads_stdin_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvguard generate - -` read stdin to its end for the first '-' and gave the second an
    empty prompt (refused as "prompt 3 of 3: prompt is empty", naming no stdin; where the
    tokenizer adds a BOS, served as that alone, silently); it is refused before the model
    loads, naming the problem. One '-' reads stdin."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    assert main(["generate", "--model", "tiny", "--max-tokens", "2", "-", "ok", "-"]) == 2
    err = capsys.readouterr().err
    assert (
        "kvguard: error: '-' (stdin) is given as 2 prompts, but stdin (-) can be read once: pass"
        in err
    ), err
    assert main(["generate", "--model", "tiny", "--max-tokens", "2", "--json", "-", "ok"]) == 0
    assert [row["prompt"] for row in json.loads(capsys.readouterr().out)] == [
        "Once upon a time",
        "ok",
    ]
