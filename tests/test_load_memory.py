"""A converted GGUF's memory: loading and serving take about the weights' size.

A 3.8 GiB Llama-2-7B Q4_K_M had peaked at 15.6 GiB on every start and served at 11 GiB (14 GiB
in the process that converted it): the converted `model.safetensors` stayed mapped and resident
for the life of the process (a few tensors kept were views onto safetensors' mapping), every
module's 4-bit codes were unpacked to a byte each for the whole model before the layers packed
them, and the conversion held every output tensor at once before writing the file.

The model is a llama of a few hundred MiB written here in Q4_K_M's layout (Q4_K, with Q6_K
`attn_v` / `ffn_down` in the layers llama.cpp gives more bits, and a Q6_K `output`) from
random blocks of valid scales, with a small SentencePiece vocabulary. Each measurement runs in
a fresh subprocess: its peak RSS is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

Q = gguf.GGMLQuantizationType
T = gguf.TokenType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 2048, 5632, 8, 16, 4, 512
MIB = 2**20
# What a load may take beyond its weights: one module's temporaries (the largest here, the
# fused gate/up matrix of 23M codes, unpacked and packed again: about 100 MiB), the modules
# and libraries the load imports, a KV pool of 16 MiB and the tokenizer (about 160 MiB in all
# here). The old loader took the converted file's pages (1.24x the weights) and every module's
# unpacked codes (about 0.8x the weights) on top: over 700 MiB.
LOAD_MARGIN = 256 * MIB
# What the process that converted may hold beyond a fresh load's RSS (under 10 MiB here; it had
# held its converted tensors' pages: over 300 MiB)
SERVE_MARGIN = 96 * MIB

PROBE = """
import json, sys
from kvguard.engine import EngineConfig, LLMEngine
from kvguard.engine.model import weight_bytes

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def rss():
    return status("VmRSS")

before = rss()
config = EngineConfig(model=sys.argv[1], home=sys.argv[2], kv_cache_bytes="16MiB", num_threads=1)
engine = LLMEngine.from_config(config, progress=False)
maps = [line.split()[-1] for line in open("/proc/self/maps") if "model.safetensors" in line]
print(json.dumps({
    "before": before,
    # VmHWM, this process's own peak: ru_maxrss keeps the peak of the memory it was forked
    # from across exec (a pytest process of gigabytes)
    "peak": status("VmHWM"),
    "after": rss(),
    "weights": weight_bytes(engine.model),
    "maps": sorted(set(maps)),
}))
"""


def _more_bits(i: int, n: int) -> bool:
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M rule writes as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random codes under small finite fp16 scales (Q6_K: int8 sub-scales of both signs)."""
    n = cols // 256
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (rows, n, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin, then 6-bit scales and minimums, then nibbles
        b[..., 0:2] = _f16_bytes(rng.uniform(1e-4, 2e-4, (rows, n)))
        b[..., 2:4] = _f16_bytes(rng.uniform(2e-4, 4e-4, (rows, n)))
    else:  # Q6_K: low nibbles, high pairs, 16 int8 scales, d
        b[..., 192:208] = rng.integers(-40, 41, (rows, n, 16), dtype=np.int8).view(np.uint8)
        b[..., 208:210] = _f16_bytes(rng.uniform(-1e-5, 1e-5, (rows, n)))
    return b.reshape(rows, -1)


def write_q4_k_m(path: Path) -> None:
    """A Q4_K_M llama, written tensor by tensor (the header first, as llama.cpp does)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    pieces = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + p for p in pieces]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    tokens += [f"\u2581{a}{b}" for a in "etaoinshr" for b in "etaoinshrdlu"]
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    types += [T.NORMAL] * (VOCAB - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(VOCAB)])
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    plan: list[tuple[str, int, int | None, Q | None]] = [
        ("token_embd.weight", VOCAB, HIDDEN, Q.Q4_K)
    ]
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        more = Q.Q6_K if _more_bits(i, LAYERS) else Q.Q4_K
        plan += [
            (f"blk.{i}.attn_norm.weight", HIDDEN, None, None),
            (f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, Q.Q4_K),
            (f"blk.{i}.attn_k.weight", kv, HIDDEN, Q.Q4_K),
            (f"blk.{i}.attn_v.weight", kv, HIDDEN, more),
            (f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, Q.Q4_K),
            (f"blk.{i}.ffn_norm.weight", HIDDEN, None, None),
            (f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, Q.Q4_K),
            (f"blk.{i}.ffn_up.weight", FFN, HIDDEN, Q.Q4_K),
            (f"blk.{i}.ffn_down.weight", HIDDEN, FFN, more),
        ]
    plan += [("output_norm.weight", HIDDEN, None, None), ("output.weight", VOCAB, HIDDEN, Q.Q6_K)]
    for name, rows, cols, qtype in plan:
        if qtype is None:
            w.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
        else:
            per, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = rows * cols // per * size
            shape = (rows, cols // per * size)
            w.add_tensor_info(name, shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, rows, cols, qtype in plan:
        if qtype is None:
            w.write_tensor_data(rng.uniform(0.9, 1.1, rows).astype(np.float32))
        else:
            assert cols is not None
            w.write_tensor_data(_blocks(rng, rows, cols, qtype))
    w.close()


def probe(gguf_path: Path, home: Path) -> dict[str, Any]:
    """A fresh process's engine on the file (converting it first where `home` has no copy):
    RSS before and after, peak RSS, weight bytes, the model files still mapped."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(gguf_path), str(home)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The first start (converting, then serving) and a second (loading the copy)."""
    root = tmp_path_factory.mktemp("load_memory")
    path = root / "llama-q4_k_m.gguf"
    write_q4_k_m(path)
    first = probe(path, root / "home")
    second = probe(path, root / "home")
    return {"first": first, "second": second}


def test_a_loaded_model_keeps_no_mapping_of_its_file(runs: dict[str, dict[str, Any]]) -> None:
    """Nothing served is a view onto the converted file: it is not mapped once loaded."""
    assert runs["second"]["maps"] == []
    assert runs["first"]["maps"] == []


def test_a_load_peaks_at_its_weights_plus_one_modules_temporaries(
    runs: dict[str, dict[str, Any]],
) -> None:
    second = runs["second"]
    assert second["weights"] > 200 * MIB  # the model is the size the margin is set for
    grew = second["peak"] - second["before"]
    assert grew <= second["weights"] + LOAD_MARGIN, (
        f"peak RSS grew {grew / MIB:.0f} MiB loading {second['weights'] / MIB:.0f} MiB of "
        f"weights (margin {LOAD_MARGIN / MIB:.0f} MiB)"
    )


def test_the_process_that_converted_serves_at_a_fresh_loads_rss(
    runs: dict[str, dict[str, Any]],
) -> None:
    first, second = runs["first"], runs["second"]
    extra = (first["after"] - first["before"]) - (second["after"] - second["before"])
    assert extra <= SERVE_MARGIN, (
        f"the converting process holds {extra / MIB:.0f} MiB more than a fresh load "
        f"(margin {SERVE_MARGIN / MIB:.0f} MiB)"
    )
