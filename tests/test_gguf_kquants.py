"""GGUF files in the types llama.cpp's users mostly have (`Q4_K_M`, `Q5_K_M`, `Q5_0`, ...)
served packed by the `auto` conversion, where every layer tensor of those types was refused:

- Q4_K becomes 4-bit codes per 32 weights, Q5_0 / Q5_1 / Q5_K 8-bit codes (the code value
  itself), all as the `gguf` package dequantises them; of the types with a scale per 16
  weights, Q3_K becomes 8-bit codes per 32 exactly, Q6_K is requantised to them within an
  eighth of its step and Q2_K within half a level of 256 over its pair's range, with one
  warning per type;
- a fused q/k/v or gate/up group mixing 4-bit and 8-bit codes (Q4_K q/k beside a Q6_K
  `attn_v`: a Q4_K_M file's every other layer) is served at 8 bits, where it was dequantised;
- the packed model gives the tokens the fp32 one (`model_quantization: none`) gives, and that
  one transformers' logits on the same file;
- other quantised types (IQ1-IQ3, TQ*) are still refused, by name.

The files are small llama models (hidden 256, two layers: K-quants need rows of 256) with the
default model's tokenizer. The gguf package cannot quantise K-quants, so their blocks are
written byte by byte from float weights (bench/gguf_encode.py's `encode`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from bench import gguf_encode
from bench.gguf_encode import f16_bytes
from kvguard.engine import LLMEngine, gguf_convert, gguf_packed
from kvguard.engine import model_registry as reg
from kvguard.engine.gguf_convert import convert_gguf, unpack_blocks
from kvguard.engine.layers.quant_spec import QuantSpec
from kvguard.engine.model import weight_bytes
from kvguard.engine.model_config import ModelLoadError
from kvguard.engine.sampling_params import SamplingParams
from tests.test_gguf_variants import engine
from tests.test_loader_kernel_edges import llama_writer

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
STEPS = 8
# Q6_K requantised about zero: half a level, a level at most 32 of the pair's coarser steps / 127
Q6_K_BOUND = 32 / 254
# w = d * (q - z): the same fp32 products as gguf's
EXACT = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.Q3_K)
REFUSED = (Q.IQ3_S, Q.IQ2_XS, Q.TQ1_0)  # quantised types with no packed form


# -- blocks written from float weights (bench/gguf_encode.py's encoders) ---------------------
def encode(w: np.ndarray, qtype: Q) -> np.ndarray:
    """`w [rows, cols]` in `qtype`'s raw blocks `[rows, bytes]`; a refused type as zero blocks."""
    if qtype in REFUSED:  # zero blocks: valid, every weight 0 (they are refused unread)
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // per * size), np.uint8)
    return gguf_encode.encode(w, qtype)


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Blocks of random bytes (every code, 6-bit scale and minimum, int8 Q6_K scale, zeros
    among them), their fp16 `d`/`dmin`/`m` set to finite values of a weight's magnitude, a
    few of them zero."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    shape = data.shape[:2]

    def value(scale: float) -> np.ndarray:
        v = rng.normal(0, scale, shape)
        return f16_bytes(np.where(rng.random(shape) < 0.02, 0, v))

    if qtype == Q.Q6_K:
        data[..., 208:210] = value(0.02 / 32 / 64)
    elif qtype == Q.Q3_K:
        data[..., 108:110] = value(0.02 / 32 / 4)
    elif qtype == Q.Q2_K:
        data[..., 80:82], data[..., 82:84] = np.abs(value(0.02 / 15 / 3)), np.abs(value(0.02 / 15))
    elif qtype in (Q.Q4_K, Q.Q5_K):
        data[..., 0:2], data[..., 2:4] = np.abs(value(0.02 / 63 / 8)), np.abs(value(0.02 / 63))
    else:
        data[..., 0:2] = value(0.02 / 8)
        if qtype in (Q.Q4_1, Q.Q5_1):
            data[..., 2:4] = value(0.02)
    return data.reshape(rows, -1)


# -- (a) every type unpacks to what the gguf package dequantises ----------------------------
def _spec(data: np.ndarray, qtype: Q) -> QuantSpec:
    q, scales, zeros = unpack_blocks(data, qtype)
    return QuantSpec(*(torch.from_numpy(a) for a in (q, scales, zeros)), 32, 8)


def _reference(data: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))


@pytest.mark.parametrize("source", ["random", "encoded"])
@pytest.mark.parametrize(
    "qtype",
    [Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.Q3_K],
    ids=lambda q: q.name,
)
def test_each_type_unpacks_to_the_gguf_packages_weights(qtype: Q, source: str) -> None:
    """Exact: the types of `w = d * (q - z)` to the bit, those with a minimum (Q4_1, Q5_1, the
    K-quants, through `z = m / d`) up to fp32 rounding of `(q - z) * d`; the codes fit their
    bits (4-bit types under 16, 5-bit ones 32 values about 128). Q3_K (a 6-bit scale per 16
    weights, 3-bit codes) is exact on one step per 32: each pair's `(sc - 32) * (q - 4)` span
    at most 253 values."""
    if source == "random":
        data = random_blocks(qtype, 64, 1024, seed=int(qtype))
    else:
        w = np.random.default_rng(1).normal(0, 0.02, (64, 1024)).astype(np.float32)
        data = encode(w, qtype)
    spec, want = _spec(data, qtype), _reference(data, qtype)
    got = spec.dequantize()
    if qtype in EXACT:
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    low, high = {
        Q.Q4_K: (0, 16), Q.Q4_0: (0, 16), Q.Q4_1: (0, 16), Q.Q8_0: (0, 256),
        Q.IQ4_NL: (1, 242), Q.IQ4_XS: (1, 242),  # gguf_encode.IQ4_VALUES + 128
        Q.Q3_K: (0, 256),
    }.get(qtype, (112, 144))  # fmt: skip  # 5-bit codes about 128 (`_centred`)
    assert low <= int(spec.q.min()) and int(spec.q.max()) < high


def _q6_k_steps(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's Q6_K step (`d * s`), and the coarser of its 32-weight pair's."""
    blocks = data.reshape(data.shape[0], -1, 210)
    d = torch.from_numpy(blocks[..., 208:210].copy().view(np.float16).astype(np.float32))
    s = torch.from_numpy(blocks[..., 192:208].copy().view(np.int8).astype(np.float32))
    own = (d * s).abs().repeat_interleave(16, dim=-1).reshape(data.shape[0], -1)
    pair = (d * s).abs().reshape(*s.shape[:2], 8, 2).amax(-1)
    return own, pair.repeat_interleave(32, dim=-1).reshape(data.shape[0], -1)


@pytest.mark.parametrize("source", ["random", "encoded"])
def test_q6_k_is_requantised_within_an_eighth_of_its_step(source: str) -> None:
    """Q6_K scales every 16 weights; one 8-bit scale per 32 holds a pair exactly where a
    common step does, else 256 levels about zero: off by at most 32/254 (0.126) of the
    pair's coarser step. The error `_unpack` reports is the one measured here. Random scales
    (any sign, any ratio) reach that bound; weights quantised as llama.cpp does (neighbouring
    scales alike) stay far under it."""
    if source == "random":
        data = random_blocks(Q.Q6_K, 64, 1024, seed=6)
    else:
        data = encode(
            np.random.default_rng(1).normal(0, 0.02, (64, 1024)).astype(np.float32), Q.Q6_K
        )
    q, scales, zeros, reported = gguf_convert._unpack(data, Q.Q6_K)
    got = QuantSpec(*(torch.from_numpy(a) for a in (q, scales, zeros)), 32, 8).dequantize()
    want = _reference(data, Q.Q6_K)
    own, pair = _q6_k_steps(data)
    err = (got - want).abs()
    held = pair > 0
    worst = (err[held] / pair[held]).max().item()
    assert worst == pytest.approx(reported, rel=1e-6)
    assert worst <= Q6_K_BOUND * (1 + 1e-5)
    # codes about 128: the 8-bit kernels keep `(128 - zero) * scale` in fp16, exact only at 0
    # (an uncentred exact pair had been served off by up to 0.08 of a step); a zero short of
    # 128 only where the codes could go no higher, past it only where they could go no lower
    qs, zs = torch.from_numpy(q).reshape(*zeros.shape, 32), torch.from_numpy(zeros)
    assert torch.equal(zs, zs.round())
    assert bool((qs.amax(-1)[zs < 128] == 255).all() and (qs.amin(-1)[zs > 128] == 0).all())
    assert (zs == 128).float().mean().item() > 0.99
    assert torch.equal(got[~held], want[~held])  # a pair of zero scales is zeros
    same = (own == pair).reshape(-1, 32).all(-1).reshape(err.shape[0], -1)  # equal halves
    assert torch.equal(
        err.reshape(err.shape[0], -1, 32)[same],
        torch.zeros_like(err.reshape(err.shape[0], -1, 32)[same]),
    )
    print(
        f"\nQ6_K {source}: worst {worst:.4f} of the pair's coarser step, "
        f"{(err[own > 0] / own[own > 0]).max().item():.4f} of the weight's own step"
    )


def _q2_k_pairs(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per 32-weight pair of a Q2_K tensor: its coarser step (`d * max(sc)`), whether its two
    minimums are one, and its range (greatest weight less least)."""
    blocks = data.reshape(data.shape[0], -1, 84)
    d = torch.from_numpy(blocks[..., 80:82].copy().view(np.float16).astype(np.float32))
    sc = torch.from_numpy((blocks[..., :16] & 15).astype(np.float32)).reshape(*d.shape, 8, 2)
    mn = torch.from_numpy((blocks[..., :16] >> 4).astype(np.int16)).reshape(*d.shape, 8, 2)
    want = _reference(data, Q.Q2_K).reshape(*d.shape, 8, 32)
    coarse = (d[..., None] * sc.amax(-1)).abs()
    return coarse, mn[..., 0] == mn[..., 1], want.amax(-1) - want.amin(-1)


@pytest.mark.parametrize("source", ["random", "encoded"])
def test_q2_k_is_requantised_within_half_a_level_of_its_pair(source: str) -> None:
    """Q2_K (`d * sc * q - dmin * m`, scale and minimum per 16 weights): a pair of 16 with one
    minimum is held on one step, exactly (fp32 rounding of `(q - z) * s`); a pair whose
    minimums differ is requantised to 256 levels over its range, off by at most half a level.
    The error `_unpack` reports (in the pair's coarser step) is the one measured here: random
    blocks (a minimum's difference many steps wide) reach whole steps, weights quantised as
    llama.cpp does stay under a hundredth of one."""
    if source == "random":
        data = random_blocks(Q.Q2_K, 64, 1024, seed=2)
    else:
        w = np.random.default_rng(1).normal(0, 0.02, (64, 1024)).astype(np.float32)
        data = encode(w, Q.Q2_K)
    q, scales, zeros, reported = gguf_convert._unpack(data, Q.Q2_K)
    got = QuantSpec(*(torch.from_numpy(a) for a in (q, scales, zeros)), 32, 8).dequantize()
    want = _reference(data, Q.Q2_K)
    coarse, one_min, span = _q2_k_pairs(data)
    err = (got - want).abs().reshape(span.shape + (32,)).amax(-1)
    held = coarse > 0
    assert (err[held] / coarse[held]).max().item() == pytest.approx(reported, rel=1e-5)
    top = want.abs().max().item()
    assert bool((err <= span / 510 + 1e-6 * top).all())
    assert bool((err[one_min] <= 1e-6 * top).all()) and one_min.any()
    if source == "encoded":
        assert reported < 0.01
    print(f"\nQ2_K {source}: worst {reported:.4f} of the pair's coarser step")


# -- small llama files with the default model's tokenizer ------------------------------------
@pytest.fixture(scope="module")
def tokenizer_fields(model_home: Path) -> list[tuple[str, Any, V, V | None]]:
    """The default GGUF's `tokenizer.*` metadata, to write into each file."""
    r = gguf.GGUFReader(reg.smollm2_gguf(model_home, progress=False))
    out = []
    for key, field in r.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == V.ARRAY else None
            out.append((key, field.contents(), field.types[0], sub))
    return out


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """A llama model's float weights by GGUF name (the q/k rows in llama.cpp's rope order,
    as its converter writes them: only the files differ, not the model)."""
    rng = np.random.default_rng(seed)

    def lin(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)

    hd = HIDDEN // HEADS
    out = {"token_embd.weight": rng.standard_normal((49152, HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": (0.5 + rng.random(HIDDEN)).astype(np.float32),
            p + "attn_q.weight": lin(HEADS * hd, HIDDEN),
            p + "attn_k.weight": lin(KV_HEADS * hd, HIDDEN),
            p + "attn_v.weight": lin(KV_HEADS * hd, HIDDEN),
            p + "attn_output.weight": lin(HIDDEN, HEADS * hd),
            p + "ffn_norm.weight": (0.5 + rng.random(HIDDEN)).astype(np.float32),
            p + "ffn_gate.weight": lin(INTER, HIDDEN),
            p + "ffn_up.weight": lin(INTER, HIDDEN),
            p + "ffn_down.weight": lin(HIDDEN, INTER),
        }
    out["output_norm.weight"] = (0.5 + rng.random(HIDDEN)).astype(np.float32)
    out["output.weight"] = lin(49152, HIDDEN)
    return out


def write_model(path: Path, fields: list[Any], types: dict[str, Q], tied: bool = False) -> Path:
    """The `weights()` model as a GGUF, each tensor in `types[name]` (by name, or by its kind:
    `attn_q`, `token_embd`, ...; F32 if none), the lm_head left out when `tied`."""
    w = llama_writer(path, LAYERS, HIDDEN, INTER, HEADS, KV_HEADS)
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub)
    for name, arr in weights().items():
        if tied and name == "output.weight":
            continue
        kind = name.split(".")[-2]
        qtype = types.get(name, types.get(kind, Q.F32))
        if qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, encode(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Q4_K_M as llama-quantize writes it: Q4_K, with Q6_K for attn_v and ffn_down in some layers
# (here layer 0) and for the lm_head
Q4_K_M = {
    "token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K,
    "attn_v": Q.Q4_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K,
    "ffn_down": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K,
}  # fmt: skip
# the 5-bit types, one per projection, and a Q6_K beside them (all 8-bit: fused as they are);
# the lm_head tied to a Q5_K embedding
FIVE_BIT = {
    "token_embd": Q.Q5_K, "attn_q": Q.Q5_0, "attn_k": Q.Q5_1, "attn_v": Q.Q5_K,
    "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q5_1,
}  # fmt: skip


# IQ4_NL and IQ4_XS (8-bit codes: every projection fuses as it is), the lm_head IQ4_XS
IQ4 = {
    "token_embd": Q.IQ4_NL, "output": Q.IQ4_XS, "attn_q": Q.IQ4_XS, "attn_k": Q.IQ4_NL,
    "attn_v": Q.IQ4_XS, "attn_output": Q.IQ4_NL, "ffn_gate": Q.IQ4_XS, "ffn_up": Q.IQ4_NL,
    "ffn_down": Q.IQ4_XS,
}  # fmt: skip


# Q3_K_M and Q2_K as llama-quantize writes them, in one file: Q3_K and Q2_K projections (all
# 8-bit codes, fused as they are), a 4-bit Q4_K `attn_output`, a Q5_K `ffn_down`, a Q3_K
# embedding and a Q6_K lm_head
LOW_BIT = {
    "token_embd": Q.Q3_K, "output": Q.Q6_K, "attn_q": Q.Q2_K, "attn_k": Q.Q3_K,
    "attn_v": Q.Q3_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q3_K, "ffn_up": Q.Q2_K,
    "ffn_down": Q.Q5_K,
}  # fmt: skip


@pytest.fixture(scope="module")
def low_bit(tokenizer_fields: list[Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("low") / "low.gguf", tokenizer_fields, LOW_BIT)


@pytest.fixture(scope="module")
def q4_k_m(tokenizer_fields: list[Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("q4km") / "q4km.gguf", tokenizer_fields, Q4_K_M)


@pytest.fixture(scope="module")
def five_bit(tokenizer_fields: list[Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("five") / "five.gguf"
    return write_model(path, tokenizer_fields, FIVE_BIT, tied=True)


@pytest.fixture(scope="module")
def iq4(tokenizer_fields: list[Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("iq4") / "iq4.gguf", tokenizer_fields, IQ4)


TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def served(
    q4_k_m: Path,
    five_bit: Path,
    iq4: Path,
    low_bit: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[LLMEngine, LLMEngine]]:
    """Each file served packed (`auto`) and in fp32 (`none`)."""
    home = tmp_path_factory.mktemp("home")
    files = (q4_k_m, five_bit, iq4, low_bit)
    return {p.stem: (engine(p, home, "auto"), engine(p, home, "none")) for p in files}


def prompt_ids(eng: LLMEngine) -> list[list[int]]:
    return [list(o.prompt_token_ids) for o in eng.generate(TEXTS, SamplingParams(max_tokens=1))]


def greedy(eng: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = eng.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("name", ["q4km", "five", "iq4", "low"])
def test_a_packed_k_quant_model_gives_the_fp32_models_tokens(
    served: dict[str, tuple[LLMEngine, LLMEngine]], name: str
) -> None:
    """Greedy tokens as `model_quantization: none` gives them, and every logit along them
    within 5% of the logits' spread (1% on average): the packed model's only differences are
    Q6_K's and Q2_K's requantisation (an eighth of a Q6_K step at most, some 0.3% of a
    weight; half a level of 256 over a Q2_K pair's range), the
    kernels' fp16 group scales and their quantised activations. A code in the wrong place, or
    q/k rows in the wrong order, moves logits by their whole spread."""
    packed, fp32 = served[name]
    assert_packed_agrees(packed, fp32)


def assert_packed_agrees(packed: LLMEngine, fp32: LLMEngine) -> None:
    """`packed` gives `fp32`'s greedy tokens for TEXTS, every logit along them within 5% of
    the logits' spread and 1% on average."""
    ids = prompt_ids(fp32)
    want = greedy(fp32, ids)
    assert greedy(packed, ids) == want
    for prompt, out in zip(ids, want, strict=True):
        seq = prompt + out
        ref = fp32.score(seq)
        diff = (packed.score(seq) - ref).abs()
        spread = ref.std().item()
        assert diff.max().item() <= 0.05 * spread
        assert diff.mean().item() <= 0.01 * spread


@pytest.mark.parametrize("name", ["q4km", "five", "iq4", "low"])
def test_transformers_reads_the_file_as_kvguards_fp32_model_does(
    served: dict[str, tuple[LLMEngine, LLMEngine]],
    q4_k_m: Path,
    five_bit: Path,
    iq4: Path,
    low_bit: Path,
    name: str,
) -> None:
    """transformers' GGUF loader (the gguf package's dequantisers, its own q/k row order) on
    the same file: the same logits to fp32 rounding, the same greedy tokens."""
    path = {"q4km": q4_k_m, "five": five_bit, "iq4": iq4, "low": low_bit}[name]
    assert_transformers_agrees(path, served[name][1])


def assert_transformers_agrees(path: Path, fp32: LLMEngine) -> Any:
    """transformers loading the GGUF at `path` gives `fp32`'s greedy tokens for TEXTS, and its
    logits along them to fp32 rounding; the model, for what else a caller checks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = prompt_ids(fp32)
    for prompt, out in zip(ids, greedy(fp32, ids), strict=True):
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            assert gen[0, len(prompt) :].tolist() == out
            want = model(torch.tensor([prompt + out])).logits[0]
        got = fp32.score(prompt + out)
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    return model


def test_a_q4_k_m_file_is_served_with_no_fp32_weight(
    q4_k_m: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Q4_K q/k beside a Q6_K `attn_v` (layer 0) had been dequantised to fp32, and every Q4_K
    or Q6_K tensor refused: now every weight is codes (the mixed group's at 8 bits, the rest
    as their types), the norms alone are fp32, and the model takes about its file's size
    (Q6_K at 8 bits, 4.5-bit Q4_K as 4-bit codes with fp16 scale and minimum per 32). One
    warning gives the Q6_K tensors' error; the widened group is said once."""
    with caplog.at_level(logging.INFO, logger="kvguard.engine"):
        convert_gguf(q4_k_m, tmp_path / "packed", progress=False, packed=True)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1, said
    assert "q4km.gguf: 3 Q6_K tensor(s) are served requantised to 8-bit codes" in said[0]
    widened = [r.getMessage() for r in caplog.records if "4-bit and 8-bit" in r.getMessage()]
    assert len(widened) == 1
    assert "1 fused projection group(s)" in widened[0]
    assert "layer 0: attn_q Q4_K, attn_k Q4_K, attn_v Q6_K" in widened[0]
    qc = json.loads((tmp_path / "packed" / "config.json").read_text())["quantization_config"]
    layers = [f"model.layers.{i}.{p}" for i in range(LAYERS) for p in _PROJECTIONS]
    assert set(qc["modules"]) == {*layers, "model.embed_tokens", "lm_head"}
    for p in ("q_proj", "k_proj", "v_proj"):
        assert qc["bits"][f"model.layers.0.self_attn.{p}"] == 8
        assert qc["bits"][f"model.layers.1.self_attn.{p}"] == 4
    assert qc["modules"]["model.layers.0.self_attn.v_proj"] == "Q6_K"
    assert qc["bits"]["model.layers.0.mlp.down_proj"] == 8
    assert qc["bits"]["model.layers.0.mlp.gate_proj"] == 4
    held = load_file(str(tmp_path / "packed" / "model.safetensors"))
    plain = sorted(n for n in held if n.endswith(".weight"))
    assert plain == sorted(
        [f"model.layers.{i}.{n}_layernorm.weight" for i in range(LAYERS)
         for n in ("input", "post_attention")] + ["model.norm.weight"]
    )  # fmt: skip
    eng = engine(q4_k_m, tmp_path / "home", "auto")
    resident = weight_bytes(eng.model)
    file = sum(int(t.n_bytes) for t in gguf.GGUFReader(q4_k_m).tensors)
    print(
        f"\nQ4_K_M-shaped file: tensors {file / 2**20:.2f} MiB, served {resident / 2**20:.2f} MiB"
    )
    assert file <= resident <= 1.4 * file


_PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


@pytest.mark.parametrize("qtype", REFUSED, ids=lambda q: q.name)
def test_other_quantised_types_are_still_refused_by_name(
    tokenizer_fields: list[Any], tmp_path: Path, qtype: Q
) -> None:
    """A layer tensor of a type with no packed form is refused before anything is written,
    naming the file, the tensor and the type; `none` still serves it."""
    path = write_model(tmp_path / "odd.gguf", tokenizer_fields, {**Q4_K_M, "ffn_up": qtype})
    pattern = (
        rf"odd\.gguf: tensor 'blk\.0\.ffn_up\.weight' is {qtype.name} \(2 tensors.*"
        "model_quantization: none"
    )
    with pytest.raises(ModelLoadError, match=pattern):
        convert_gguf(path, tmp_path / "packed", progress=False, packed=True)
    assert not (tmp_path / "packed").exists()
    out = reg.resolve_model(str(path), tmp_path / "home", progress=False, quantization="none")
    held = load_file(str(out / "model.safetensors"))
    assert not held["model.layers.1.mlp.up_proj.weight"].any()


def test_a_q2_k_q3_k_file_is_served_as_8_bit_codes_with_its_size_said(
    low_bit: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Q2_K and Q3_K layer tensors had been refused: now they are 8-bit codes (no fp32 layer
    weight), with one warning giving their size served against their size in the file, and
    one giving the Q2_K tensors' requantisation error (beside the Q6_K lm_head's). The loader
    reads what the converter writes (its table of types is the converter's)."""
    assert {t.name: b for t, b in gguf_convert.BITS.items()} == gguf_packed.PACKED_BITS
    with caplog.at_level(logging.WARNING, logger="kvguard.engine"):
        convert_gguf(low_bit, tmp_path / "packed", progress=False, packed=True)
    said = [r.getMessage() for r in caplog.records]
    sizes = [m for m in said if "Q2_K/Q3_K tensor(s) are served as 8-bit codes, per 32" in m]
    reader = gguf.GGUFReader(low_bit)
    low = [t for t in reader.tensors if t.tensor_type in (Q.Q2_K, Q.Q3_K)]
    assert len(sizes) == 1 and f": {len(low)} Q2_K/Q3_K tensor(s)" in sizes[0]
    served = sum(int(np.prod(t.shape)) * 9 / 8 for t in low) / 2**20
    assert (
        f"{served:.0f} MiB against {sum(int(t.n_bytes) for t in low) / 2**20:.0f} MiB" in sizes[0]
    )
    q2 = [m for m in said if "Q2_K tensor(s) are served requantised" in m]
    assert len(q2) == 1 and ": 4 Q2_K tensor(s)" in q2[0]
    assert sum("Q6_K tensor(s) are served requantised" in m for m in said) == 1
    qc = json.loads((tmp_path / "packed" / "config.json").read_text())["quantization_config"]
    assert qc["modules"]["model.layers.0.self_attn.q_proj"] == "Q2_K"
    assert qc["modules"]["model.embed_tokens"] == "Q3_K"
    assert qc["bits"]["model.layers.0.self_attn.q_proj"] == 8
    held = load_file(str(tmp_path / "packed" / "model.safetensors"))
    assert not [n for n in held if n.endswith("proj.weight")]


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q5_1, Q.Q4_1], ids=lambda q: q.name)
def test_groups_of_one_value_are_served_exactly_by_the_kernels(qtype: Q) -> None:
    """A group whose weights are all one value (Q2_K: a pair of 16 with both scales 0 and one
    minimum; Q4_1/Q5_1: `d == 0`) had been coded 0 at zero -1: the same weights in fp32, but the
    8-bit kernels keep `(128 - zero) * scale` in fp16, so Q2_K's were served 2.5-11% off (`129 *
    m` rounded) and a centred Q5_1's 0.4% (`17 m`). Served through the C kernels, every row's
    output is the dense product's to the kernels' activation rounding."""
    from kvguard.engine.layers.quantized_linear import QuantizedLinear

    data = random_blocks(qtype, 64, 1024, seed=9).reshape(
        64, 1024 // 256 if qtype == Q.Q2_K else 32, -1
    )
    rng = np.random.default_rng(3)
    if qtype == Q.Q2_K:  # every scale 0, each pair's two minimums alike
        mins = rng.integers(1, 16, data.shape[:2] + (8,), dtype=np.uint8)
        data[..., :16] = np.repeat(mins, 2, axis=-1) << 4
    else:  # d == 0 in every other block, a minimum of a weight's size
        data[:, ::2, 0:2] = 0
        data[:, ::2, 2:4] = f16_bytes(
            rng.normal(0, 0.02, data[:, ::2].shape[:2]).astype(np.float32)
        )
    data = data.reshape(64, -1)
    spec, want = _spec(data, qtype), _reference(data, qtype)
    layer = QuantizedLinear(spec)
    assert layer.kernel in ("w8a8", "w4a8")
    x = torch.from_numpy(rng.normal(0, 1, (4, 1024)).astype(np.float32))
    got, ref = layer(x), x @ want.T
    assert (got - ref).abs().max().item() <= 2e-3 * ref.abs().max().item()
