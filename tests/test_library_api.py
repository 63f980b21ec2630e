"""kvguard as a Python library: what a step interrupted at any point hands on, how a config
and a request built in Python code are typed, and how a refused prompt of a batch is named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest

from kvguard.daemon.cli import main
from kvguard.engine import EngineConfig, LLMEngine, SamplingParams
from kvguard.engine.config import ConfigError

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


def test_sampling_params_of_the_wrong_type_or_numpy_counts(tiny: LLMEngine) -> None:
    """A dict where a SamplingParams belongs raised AttributeError ('dict' object has no
    attribute 'validate'); numpy integer counts were refused although prompts take them."""
    with pytest.raises(TypeError, match=r"^params=\{'max_tokens': 2\}: expected a SamplingParams"):
        tiny.generate(["hi"], {"max_tokens": 2})  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=numpy.int64(3), logprobs=numpy.int32(2), ignore_eos=True)
    assert type(params.max_tokens) is int and type(params.logprobs) is int
    out = tiny.generate(["hi"], params)[0]
    assert len(out.token_ids) == 3 and len(out.final_logprobs) == 3
