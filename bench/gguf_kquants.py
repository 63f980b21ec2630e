"""GGUF K-quant files on CPU: kvguard packed vs OpenVINO GenAI on the same file, per layout.

The default model's GGUF (SmolLM2-135M, Q4_1 projections, a tied Q8_0 embedding) and three
files `bench/gguf_encode.py` rewrites from it in the layouts llama.cpp's users download:
`Q4_K_M`, `Q5_K_M` and `IQ4_XS`, each tensor in the type `llama-quantize` (no importance
matrix) gives it. SmolLM2's 576-wide rows are no whole number of 256-weight super-blocks, so,
as in llama.cpp's own files of this model, every projection but `ffn_down` takes the layout's
32-weight fallback (Q5_0, Q5_1, IQ4_NL) and the lm_head Q8_0; `ffn_down` (1536 wide) holds the
K-quants (Q4_K, Q5_K, IQ4_XS, and Q6_K in the layers llama.cpp gives more bits). The type mix
of each file is printed. The rewritten files are kept under `--work` and reused while the
source file and the encoder are unchanged.

Each file is served by:

- `kvguard packed`: `model_quantization: auto` (4-bit codes for Q4_0/Q4_1/Q4_K, 8-bit codes for
  the rest; the kernels that serve are printed);
- `OpenVINO GenAI`: `ContinuousBatchingPipeline` loading the very same .gguf file with its CPU
  plugin's defaults (bench/quantized.py's `OpenVINO`). Where it refuses the file, its row says
  so, with its error, and which of the file's types it refuses: each one is tried alone, in one
  tensor of a two-layer copy of the source file;
- `kvguard fp32`: the file's weights dequantised (`model_quantization: none`), the reference.

Measured as bench/quantized.py measures (its classes): resident weight bytes (kvguard's loaded
model; OpenVINO does not say), decode tokens/s at batch 1 and 32 (prompts of 32 ordinary
tokens, greedy, EOS ignored, timed once every sequence has its first token), and the shared
trace (bench/trace.py, 32 requests by default). Greedy-token agreement: the trace outputs of
each engine against kvguard fp32's on the same file, as whole outputs that are the same and as
the share of tokens before each output first differs. Each figure is the median of `--rounds`
rounds (1), the engines of a file taking turns. No goal is stated: the table is reported.
`--quick` keeps the first 2 layers (`--layers`), 4 requests of 8 tokens out, 8 decode tokens.

    python bench/gguf_kquants.py [--quick] [--json FILE] [--threads 2] [--requests 32]
        [--rounds 1] [--gguf FILE] [--work DIR] [--layers N]
"""

from __future__ import annotations

import gc
import hashlib
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: import siblings as bench.*, never shadow the stdlib `trace`
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from bench import gguf_encode  # noqa: E402
from bench.common import MiB, load_line, section, token_prompts  # noqa: E402
from bench.quantized import Kvguard, OpenVINO, gguf_path, measure  # noqa: E402
from bench.trace import (  # noqa: E402
    LengthDist,
    TraceSpec,
    common_args,
    format_table,
    make_trace,
    ordinary_token_ids,
    resolve_model_dir,
    spec_from_args,
    write_json,
)

LAYOUTS = ("Q4_K_M", "Q5_K_M", "IQ4_XS")  # after the source file's own
PROBE_LAYERS = 2
HEADERS = [
    "layout",
    "engine",
    "file MiB",
    "weights MiB",
    "bs1 tok/s",
    "bs32 tok/s",
    "trace tok/s",
    "same outputs",
    "same tokens",
]


def _types(path: Path) -> Counter[str]:
    return Counter(t.tensor_type.name for t in gguf_encode.read(path).tensors)


def _source_layout(path: Path) -> str:
    """The source file's layout by its `general.file_type` (Q4_1 for the default model)."""
    import gguf

    field = gguf_encode.read(path).fields.get("general.file_type")
    if field is None:
        return "source"
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")


def layout_file(
    src: Path, work: Path, layout: str | None, layers: int | None
) -> tuple[Path, Counter[str]]:
    """`src` in `layout` (None: its own types) under `work`, written once: reused while the
    source file, the layer count and the encoder (its source text) are the same."""
    if layout is None and layers is None:
        return src, _types(src)
    st = src.resolve().stat()
    key = {
        "source": str(src.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "layout": layout,
        "layers": layers,
        "encoder": hashlib.sha256(Path(gguf_encode.__file__).read_bytes()).hexdigest(),
    }
    name = f"{src.stem}.{layout or 'copy'}{f'.{layers}l' if layers else ''}.gguf"
    dst, note = work / name, work / f"{name}.json"
    if dst.is_file() and note.is_file() and json.loads(note.read_text()).get("key") == key:
        return dst, Counter(json.loads(note.read_text())["types"])
    work.mkdir(parents=True, exist_ok=True)
    print(f"writing {dst} ({layout or 'the source types'})", flush=True)
    types = gguf_encode.requantise(src, dst, layout, layers)
    note.write_text(json.dumps({"key": key, "types": dict(types)}, indent=2) + "\n")
    return dst, types


def _error_line(e: Exception) -> str:
    """The last line of a peer's error (OpenVINO's first lines are its build paths)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


class PeerProbe:
    """Which GGUF types OpenVINO GenAI reads: each tried alone, in one tensor of a two-layer
    copy of the source file (a `blk.0` projection whose rows fit every type), once a run."""

    def __init__(self, src: Path, work: Path, threads: int) -> None:
        self.src, self.work, self.threads = src, work, threads
        self.refused: dict[str, str] = {}  # type -> the peer's error; "" where it reads it
        self.tensor = next(
            t.name
            for t in gguf_encode.read(src).tensors
            if t.name.startswith("blk.0.") and len(t.shape) == 2 and int(t.shape[0]) % 256 == 0
        )  # GGUF lists a tensor's dimensions innermost first: shape[0] is a row's length

    def error(self, qtype: str) -> str:
        """The peer's error on a `qtype` tensor; empty where it reads it."""
        import gguf

        if qtype not in self.refused:
            probe = self.work / f".probe-{qtype}.gguf"
            self.work.mkdir(parents=True, exist_ok=True)
            override = {self.tensor: gguf.GGMLQuantizationType[qtype]}
            gguf_encode.requantise(self.src, probe, None, PROBE_LAYERS, override)
            try:
                peer = OpenVINO(probe, self.threads)
                del peer
                self.refused[qtype] = ""
            except RuntimeError as e:
                self.refused[qtype] = _error_line(e)
            finally:
                probe.unlink(missing_ok=True)
        return self.refused[qtype]


def agreement(outs: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    """(outputs the same as the reference's, share of tokens before each output differs)."""
    same, before, total = 0, 0, 0
    for a, b in zip(outs, ref, strict=True):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        before, total = before + n, total + len(b)
    return same, before / max(total, 1)


def measure_layout(
    layout: str, path: Path, types: Counter[str], args: Any, trace: Any, probe: PeerProbe
) -> dict[str, Any]:
    """Every engine on one file: the figures, the peer's refusal where it refuses."""
    print(f"{layout}: {path.name}, " + ", ".join(f"{k} x{n}" for k, n in types.most_common()))
    out: dict[str, Any] = {
        "layout": layout,
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "types": dict(types),
    }
    engines: list[Any] = [Kvguard(str(path), "auto", args.threads)]
    try:
        engines.append(OpenVINO(path, args.threads))
    except ImportError as e:
        out["peer_missing"] = f"openvino-genai not installed ({e}): pip install openvino-genai"
    except RuntimeError as e:
        quantised = sorted(t for t in types if t not in ("F32", "F16"))
        out["peer_refused"] = {
            "error": _error_line(e),
            "types_refused": {t: why for t in quantised if (why := probe.error(t))},
            "types_read": [t for t in quantised if not probe.error(t)],
        }
    engines.append(Kvguard(str(path), "none", args.threads))
    out["kernels"] = engines[0].kernels()
    rows: list[dict[str, Any]] = [{"engine": e.name} for e in engines]
    for eng, r in zip(engines, rows, strict=True):
        if isinstance(eng, Kvguard):
            r["weight_bytes"] = eng.weight_bytes()
        eng.decode_tok_s(token_prompts(args.vocab_model, 2, 32, 7), 8)  # warm-up, untimed
    samples, outputs = measure(engines, args.rounds, args.vocab_model, args.tokens, trace)
    ref = outputs[-1]  # kvguard fp32
    for r, got, outs in zip(rows, samples, outputs, strict=True):
        r |= {k: statistics.median(v) for k, v in got.items()}
        r["rounds"] = got
        r["same_outputs"], r["same_tokens"] = agreement(outs, ref)
    if "peer_refused" in out or "peer_missing" in out:  # its row, with no figures
        rows.insert(1, {"engine": OpenVINO.name, "refused": "peer_refused" in out})
    out["engines"] = rows
    del engines
    gc.collect()
    return out


def table_rows(layouts: list[dict[str, Any]], requests: int) -> list[list[str]]:
    rows = []
    for lay in layouts:
        for r in lay["engines"]:
            if "bs1_tok_s" not in r:  # the peer refused the file, or is missing
                cells = ["refused" if r["refused"] else "missing"] * 6
            else:
                cells = [
                    f"{r['weight_bytes'] / MiB:.1f}" if "weight_bytes" in r else "-",
                    f"{r['bs1_tok_s']:.1f}",
                    f"{r['bs32_tok_s']:.1f}",
                    f"{r['trace_tok_s']:.1f}",
                    f"{r['same_outputs']}/{requests}",
                    f"{100 * r['same_tokens']:.1f}%",
                ]
                if r is lay["engines"][-1]:  # kvguard fp32: what the others are compared with
                    cells[-2:] = ["reference"] * 2
            rows.append([lay["layout"], r["engine"], f"{lay['file_bytes'] / MiB:.1f}", *cells])
    return rows


def main() -> None:
    p = common_args(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1, help="rounds each figure is the median of")
    p.add_argument("--gguf", type=Path, help="the source GGUF (default: the default model's)")
    p.add_argument("--work", type=Path, help="where the rewritten files are kept")
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (quick: 2)")
    args = p.parse_args()
    from kvguard.engine.config import kvguard_home

    args.requests = args.requests or (4 if args.quick else 32)
    args.tokens = 8 if args.quick else 64
    layers = args.layers or (2 if args.quick else None)
    src = args.gguf or gguf_path()
    work = args.work or kvguard_home() / "bench" / "gguf_kquants"
    before = load_line()
    section(f"GGUF K-quant layouts, {args.threads} threads ({before})")
    source = _source_layout(src)
    files = [(source, *layout_file(src, work, None, layers))]
    files += [(lay, *layout_file(src, work, lay, layers)) for lay in LAYOUTS]
    args.vocab_model = str(files[0][1])  # prompts of ordinary tokens: one vocabulary for all
    spec = spec_from_args(args)
    if args.quick:  # the quick trace's prompts, 8 tokens out: a smoke run of every engine
        spec = TraceSpec(spec.num_requests, spec.prompt, LengthDist(8, 0.0, 8, 8), spec.seed)
    trace = make_trace(spec, ordinary_token_ids(resolve_model_dir(args.vocab_model)))
    probe = PeerProbe(src, work, args.threads)
    layouts = [measure_layout(lay, path, types, args, trace, probe) for lay, path, types in files]
    print(format_table(HEADERS, table_rows(layouts, len(trace))))
    print(
        f"medians of {args.rounds} round(s); same outputs / same tokens: trace outputs equal to "
        "kvguard fp32's on the same file, and the share of tokens before each output first "
        "differs from it"
    )
    if any(
        r["engine"] == OpenVINO.name and "bs1_tok_s" in r for x in layouts for r in x["engines"]
    ):
        print(f"{OpenVINO.name} defaults here: {OpenVINO.defaults()}")
    for lay in layouts:
        print(f"{lay['layout']} packed kernels: {lay['kernels']}")
        if "peer_missing" in lay:
            print(lay["peer_missing"])
        if "peer_refused" in lay:
            ref = lay["peer_refused"]
            refused = ", ".join(
                t if why == ref["error"] else f"{t} ({why})"
                for t, why in ref["types_refused"].items()
            )
            print(
                f"{lay['layout']}: {OpenVINO.name} refused the file ({ref['error']}); tried alone "
                f"in one tensor, it refuses {refused or 'none of its types'} and reads "
                f"{', '.join(ref['types_read']) or 'none of them'}"
            )
    after = load_line()
    print(f"load: {before} before, {after} after")
    write_json(
        args.json,
        {
            "layouts": layouts,
            "threads": args.threads,
            "rounds": args.rounds,
            "requests": len(trace),
            "layers": layers,
            "load_before": before,
            "load_after": after,
        },
    )


if __name__ == "__main__":
    main()
