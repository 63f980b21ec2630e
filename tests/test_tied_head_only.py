"""A tied checkpoint that stores the tied matrix as `lm_head.weight` alone.

With `tie_word_embeddings: true` the embedding and the lm_head are one matrix, and some
exporters write it under the head's name only, with no `model.embed_tokens.weight`.
transformers serves such a file (the head's tensor is the embedding); kvguard refused it as
lacking the embedding. It is served now, as transformers serves it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvguard.engine.config import EngineConfig
from kvguard.engine.llm_engine import LLMEngine
from kvguard.engine.sampling_params import SamplingParams
from tests.test_model_families import SHAPE as FAMILY_SHAPE

STEPS = 6
SHAPE = {
    **FAMILY_SHAPE,
    "vocab_size": 259,  # the tiny model's tokenizer's tokens: no padding rows here
    "tie_word_embeddings": True,
    "initializer_range": 0.5,  # logits far apart: greedy is not tie-prone
}


def head_only_dir(root: Path, tiny_dir: Path) -> Path:
    """A random-weight tied llama saved by transformers, its embedding's tensor renamed
    `lm_head.weight`, with the tiny model's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / "head-only"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SHAPE)).eval()
    model.save_pretrained(path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, path / name)
    return path


def test_a_tied_head_stored_alone_is_served_as_transformers_serves_it(
    tmp_path: Path, tiny_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    path = head_only_dir(tmp_path, tiny_dir)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    assert "model.embed_tokens.weight" not in load_file(path / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head = hf.get_output_embeddings().weight
    assert torch.equal(hf.get_input_embeddings().weight, head)  # transformers ties them
    assert torch.equal(head, load_file(path / "model.safetensors")["lm_head.weight"])
    config = EngineConfig(model=str(path), kv_cache_bytes="8MiB", num_threads=1)
    engine = LLMEngine.from_config(config, progress=False)
    gen = torch.Generator().manual_seed(1)
    for n in (5, 17):
        ids = torch.randint(3, 259, (n,), generator=gen).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
            want = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=STEPS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, n:].tolist()
        torch.testing.assert_close(engine.score(ids).float(), ref, atol=1e-4, rtol=0)
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=0)
        assert list(engine.generate([ids], params)[0].token_ids) == want
