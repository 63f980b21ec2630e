"""The lm_head reaches the tokenizer's highest token id, not its count of tokens.

A tokenizer's ids may have gaps: one whose 259 tokens run to id 300 writes id 300. The head's
width (`token_vocab`, `Tokenizer.vocab_size`) was the count, 259, so the top ids were never
computed: never generated, never scored, refused in a `logit_bias`, silently; with the eos
token among them, no answer could end but by its length. The width is the highest id + 1 now
(at most config.json's vocab_size), and an eos id past it, which the model could never write,
refuses the load (ModelLoadError) naming the ids and the files that set them.

The tiny model, its tokenizer renumbered: `<|im_end|>`, its eos token, moved from id 2 to id
300 (a row of its padded 320, which transformers computes as any other), leaving a gap at 2.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvguard.engine.config import EngineConfig
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.model_runner import token_vocab
from kvguard.engine.sampling_params import SamplingParams

EOS, TOP = "<|im_end|>", 300  # the eos token and the id it is moved to
TOKENS = 259  # the tiny tokenizer's count of tokens, the same after the move
PROMPT = "The quick brown fox"


def engine_of(folder: Path) -> LLMEngine:
    config = EngineConfig(model=str(folder), kv_cache_bytes="8MiB", max_model_len=256)
    return LLMEngine.from_config(config, progress=False)


def copy_of(tiny_dir: Path, to: Path) -> Path:
    shutil.copytree(tiny_dir, to)
    return to


def move_token(folder: Path, text: str, new_id: int) -> None:
    """Renumber `text` in tokenizer.json (its vocabulary and added tokens) to `new_id`."""
    file = folder / "tokenizer.json"
    spec = json.loads(file.read_text())
    spec["model"]["vocab"][text] = new_id
    for added in spec["added_tokens"]:
        if added["content"] == text:
            added["id"] = new_id
    file.write_text(json.dumps(spec))


@pytest.fixture(scope="module")
def gap_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model whose eos token is its tokenizer's highest id, 300, past a gap."""
    folder = copy_of(tiny_dir, tmp_path_factory.mktemp("gap") / "model")
    move_token(folder, EOS, TOP)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": TOP}))
    return folder


@pytest.fixture(scope="module")
def gap(gap_dir: Path) -> Iterator[LLMEngine]:
    eng = engine_of(gap_dir)
    yield eng
    eng.shutdown()


def test_the_head_is_as_wide_as_the_highest_id(gap: LLMEngine, gap_dir: Path) -> None:
    """259 tokens up to id 300: the head computes ids [0, 301), the tokenizer says 301, and the
    logit of id 300 is transformers' (the head stopped at 259, the count)."""
    from transformers import AutoModelForCausalLM

    assert gap.tokenizer.eos_token_ids == {TOP}
    assert gap.tokenizer.vocab_size == TOP + 1 == token_vocab(gap_dir, gap.model_config)
    assert gap.runner.vocab == TOP + 1 and gap.biasable_ids() == TOP + 1
    ids = gap.tokenizer.encode(PROMPT)
    got = gap.score(ids)
    assert got.shape[1] > TOP
    hf = AutoModelForCausalLM.from_pretrained(gap_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got[:, TOP], want[:, TOP], atol=1e-4, rtol=0)


def test_the_eos_token_at_the_highest_id_ends_an_answer(gap: LLMEngine) -> None:
    """The eos token at id 300, raised by a `logit_bias`, is drawn and ends the answer at once,
    greedy and sampled (the bias was refused, "name no token", and the eos could never be
    drawn: every answer ran to its length)."""
    for fields in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        params = SamplingParams(max_tokens=8, logit_bias={TOP: 100.0}, **fields)
        [out] = gap.generate([PROMPT], [params])
        assert (out.token_ids, out.finish_reason, out.text) == ([TOP], "stop", ""), fields


def test_an_eos_id_past_the_tokenizers_ids_refuses_the_load(tiny_dir: Path, tmp_path: Path) -> None:
    """generation_config.json naming id 300 as an eos id, past the tiny tokenizer's 259 ids (a
    row of the model, but no token): the model could never write it, so the load stops before
    the weights, naming the id, the bounds and the files (it loaded, and no answer could end
    with that id)."""
    folder = copy_of(tiny_dir, tmp_path / "model")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, TOP]}))
    with pytest.raises(ModelLoadError) as e:
        engine_of(folder).shutdown()
    said = str(e.value)
    assert f"eos token ids [{TOP}] are past the ids the model can write, [0, {TOKENS})" in said
    assert f"the tokenizer's ids end at {TOKENS - 1}, config.json's vocab_size is 320" in said
    assert "correct eos_token_id in config.json and generation_config.json" in said
