"""The CPU step kernels of `cpu_ops.c`: paged decode attention over the pool in place, the
K/V write into a pool of any element type (fp8 with its growing per-block scales), RMSNorm
(with the residual add folded in), RoPE and the gated MLP's SiLU-and-multiply, for fp32
activations; and the live KV dtype switch's conversion of whole blocks between pools.

They live in the library `cpu_lowbit` builds (one compile on first use). `enabled(x)` says
whether a tensor takes them: fp32 on the CPU, the library built, and `KVGUARD_CPU_OPS` not
off (0/false/off/no, `env.env_flag`: the switch that keeps torch's ops, for comparison). Where they do not apply the callers
keep their torch code, which stays the reference the tests hold these kernels to.
"""

from __future__ import annotations

import torch

from kvguard.kernels import cpu_lowbit
from kvguard.kernels.env import env_flag
from kvguard.kernels.fp8 import FP8_DTYPE

ENV = "KVGUARD_CPU_OPS"
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, FP8_DTYPE: 3}
_state: dict[str, bool] = {}


def _on() -> bool:
    on = _state.get("on")
    if on is None:
        on = _state["on"] = env_flag(ENV, True) and cpu_lowbit.available()
    return on


def enabled(x: torch.Tensor) -> bool:
    """Whether `x` (an activation) is served by these kernels."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _on()


def reset() -> None:
    """Read `KVGUARD_CPU_OPS` again (tests switch it)."""
    _state.clear()


# the attention kernel's limits (cpu_ops.c: MAX_GROUP, MAX_DIM, MAX_BLOCK)
MAX_GROUP, MAX_DIM, MAX_BLOCK = 16, 256, 64


def decode_shape_supported(heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether `paged_decode` serves these shapes: head_dim a multiple of 8 up to 256, at most
    16 query heads per KV head, blocks of at most 64 tokens."""
    return (
        heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and head_dim % 8 == 0
        and head_dim <= MAX_DIM
        and block_size <= MAX_BLOCK
    )


def decode_supported(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """`decode_shape_supported` for these tensors, a known pool dtype in a contiguous pool (the
    kernels address its rows by shape alone), and query heads of unit stride laid side by
    side."""
    _nb, bs, hkv, d = cache.shape
    return (
        cache.dtype in KV_TYPES
        and cache.is_contiguous()
        and q.dim() == 3
        and q.shape[2] == d
        and decode_shape_supported(q.shape[1], hkv, d, bs)
        and q.stride(2) == 1
        and q.stride(1) == d
    )


def pool_supported(cache: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether `write_kv` stores into this pool: a known element type, an fp8 pool with its
    fp32 `[blocks, kv_heads]` scales and a head_dim of whole 8-value vectors, all contiguous."""
    if cache.dtype not in KV_TYPES or not cache.is_contiguous():
        return False
    if cache.dtype != FP8_DTYPE:
        return scales is None
    return (
        scales is not None
        and scales.dtype == torch.float32
        and scales.is_contiguous()
        and scales.shape == cache.shape[:1] + cache.shape[2:3]
        and cache.shape[3] % 8 == 0
    )


def write_supported(
    cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor
) -> bool:
    """Whether `write_kv` takes these arguments: a supported pool, fp32 rows `[T, kv_heads,
    head_dim]` whose heads sit side by side (the rows themselves may be strided), int64 slots
    one per row."""
    _nb, _bs, hkv, d = cache.shape
    return (
        pool_supported(cache, scales)
        and x.dtype == torch.float32
        and x.shape[1:] == (hkv, d)
        and x.stride(2) == 1
        and x.stride(1) == d
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and slots.numel() == x.shape[0]
    )


def write_kv(
    cache: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store `x` `[T, kv_heads, head_dim]` (rows may be strided, each row's heads side by side)
    at flat `slots` (int64) of `cache`, as `kvguard.kernels.paged_attention.write_kv` does and
    bit for bit (tests): a cast to the pool's type, or fp8 with `scales` grown, and the block
    requantised, as `kvguard.kernels.fp8.write_kv_fp8` grows them. A sequence's tokens must be
    consecutive rows (as a step lays them out)."""
    nb, bs, hkv, d = cache.shape
    if not (
        write_supported(cache, scales, x, slots) and cache.is_cpu and x.is_cpu and slots.is_cpu
    ):
        raise ValueError(
            f"write_kv: unsupported arguments: pool {tuple(cache.shape)} {cache.dtype}, rows "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}, slots {slots.dtype} "
            f"{tuple(slots.shape)}"
        )
    rc = cpu_lowbit.library().kvg_write_kv(
        cache.data_ptr(), None if scales is None else scales.data_ptr(), KV_TYPES[cache.dtype],
        x.data_ptr(), x.stride(0), slots.data_ptr(), x.shape[0], nb * bs, bs, hkv, d,
    )  # fmt: skip
    if rc == -3:
        raise IndexError(f"write_kv: a KV slot outside the pool of {nb * bs} slots")
    if rc:
        raise ValueError(f"write_kv: unsupported pool {tuple(cache.shape)} {cache.dtype}")


# Threads of a conversion call: one. It streams memory (a few MiB a layer for a default pool),
# so a second thread gains little, and it is called twice a layer: on a host whose cores other
# processes also want, each parallel region waited for a descheduled worker. 56 live blocks of
# the default pool (30 layers, fp32 -> fp8, 2 cores at a load average of 7.5): 76 ms on one
# thread, 558 ms on two.
CONVERT_THREADS = 1


def convert_blocks(
    src: torch.Tensor,
    src_scales: torch.Tensor | None,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_scales: torch.Tensor | None,
    dst_ids: torch.Tensor,
) -> bool:
    """Blocks `src_ids` of pool `src` into blocks `dst_ids` of `dst`, another element type
    (fp8 with its per-block, per-KV-head scales), in one pass over the blocks: what
    `kvguard.engine.kv_cache`'s read_blocks then write_blocks store, bit for bit (tests),
    without their temporaries and a dozen passes over each layer's live K/V. False, nothing
    written, where these kernels do not serve the pools (off, not built, another device or
    shape): the caller converts with torch's ops. The pools are checked before the kernels
    are asked for: a CUDA pool's live switch must not build them (seconds of compiling on a
    cold cache) inside the engine's pause, for nothing."""
    if src.dtype == dst.dtype or not (src.is_cpu and dst.is_cpu):
        return False
    _nb, bs, hkv, d = src.shape
    if not (
        pool_supported(src, src_scales)
        and pool_supported(dst, dst_scales)
        and dst.shape[1:] == src.shape[1:]
        and d % 8 == 0
        and d <= MAX_DIM
        and bs <= MAX_BLOCK
        and _on()
    ):
        return False
    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        _vector("convert_blocks", name, ids, torch.int64, src_ids.numel())
    rc = cpu_lowbit.library().kvg_convert_blocks(
        src.data_ptr(), None if src_scales is None else src_scales.data_ptr(),
        KV_TYPES[src.dtype], src.shape[0],
        dst.data_ptr(), None if dst_scales is None else dst_scales.data_ptr(),
        KV_TYPES[dst.dtype], dst.shape[0],
        src_ids.data_ptr(), dst_ids.data_ptr(), src_ids.numel(), bs, hkv, d, CONVERT_THREADS,
    )  # fmt: skip
    if rc == -3:
        raise IndexError(
            f"convert_blocks: a block id outside its pool ({src.shape[0]} / {dst.shape[0]} blocks)"
        )
    if rc == -1:
        raise MemoryError("convert_blocks: no memory for the threads' rows")
    if rc:
        raise ValueError(f"convert_blocks: unsupported pools {tuple(src.shape)} {src.dtype}")
    return True


def _bad(fn: str, name: str, want: str, t: torch.Tensor) -> ValueError:
    return ValueError(
        f"{fn}: `{name}` must be {want} (got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
        f" on {t.device})"
    )


def _vector(fn: str, name: str, t: torch.Tensor, dtype: torch.dtype, n: int) -> None:
    """`t` must be `n` values of `dtype`, contiguous, on the CPU (the kernel reads t[0..n))."""
    if not (
        t.dtype == dtype and t.dim() == 1 and t.numel() == n and t.is_contiguous() and t.is_cpu
    ):
        raise _bad(fn, name, f"a contiguous CPU {dtype} vector of {n}", t)


def _attention_args(
    fn: str,
    q: torch.Tensor,
    out: torch.Tensor,
    n: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    tables: torch.Tensor,
    scale: float,
) -> tuple:
    """The attention kernels' common arguments, from the pools to the thread count, after
    checking what the kernel takes on trust (it reads raw pointers by shape): each a ValueError
    naming the argument. O(1): no look at the values, which is the callers' part (lengths
    within the tables, rows within q)."""
    if k_cache.dim() != 4 or not (k_cache.is_contiguous() and k_cache.is_cpu):
        raise _bad(
            fn, "k_cache", "a contiguous CPU pool [blocks, block_size, kv_heads, d]", k_cache
        )
    nb, bs, hkv, d = k_cache.shape
    if k_cache.dtype not in KV_TYPES:
        raise _bad(fn, "k_cache", f"of {', '.join(map(str, KV_TYPES))}", k_cache)
    if not (
        v_cache.shape == k_cache.shape
        and v_cache.dtype == k_cache.dtype
        and v_cache.is_contiguous()
        and v_cache.is_cpu
    ):
        raise _bad(fn, "v_cache", "contiguous, of k_cache's shape and dtype", v_cache)
    if not (
        q.dtype == torch.float32
        and q.dim() == 3
        and q.shape[2] == d
        and q.stride(2) == 1
        and q.stride(1) == d
        and q.is_cpu
    ):
        raise _bad(fn, "q", f"CPU float32 [rows, heads, {d}], each row's heads side by side", q)
    if not (
        out.dtype == torch.float32 and out.shape == q.shape and out.is_contiguous() and out.is_cpu
    ):
        raise _bad(fn, "out", f"a contiguous CPU float32 tensor of q's shape {tuple(q.shape)}", out)
    if not (
        tables.dtype == torch.int32
        and tables.dim() == 2
        and tables.shape[0] >= n
        and tables.stride(1) == 1
        and tables.is_cpu
    ):
        raise _bad(fn, "tables", f"CPU int32 [>= {n}, width] with unit stride along a row", tables)
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None or not (
                sc.dtype == torch.float32
                and sc.shape == (nb, hkv)
                and sc.is_contiguous()
                and sc.is_cpu
            ):
                raise ValueError(
                    f"{fn}: an fp8 pool needs `{name}`, contiguous CPU float32 [{nb}, {hkv}]"
                    f" (got {None if sc is None else (sc.dtype, tuple(sc.shape), sc.stride())})"
                )
    return (
        k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if fp8 else None, v_scale.data_ptr() if fp8 else None,
        KV_TYPES[k_cache.dtype], bs, hkv, q.shape[1], d, tables.data_ptr(), tables.stride(0),
        scale, torch.get_num_threads(),
    )  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Single-token attention for the sequences whose query is row `rows[b]` of `q`
    `[T, heads, d]` (rows may be strided), written to the same rows of `out` (contiguous).
    Sequence b attends to `lens[b]` (int32) cached tokens through `tables[b]` (int32 block
    table rows). An fp8 pool needs its per-block, per-KV-head fp32 scales. Arguments of the
    wrong dtype, layout or size raise ValueError (the kernel would read them as raw memory)."""
    n = rows.numel()
    _vector("paged_decode", "rows", rows, torch.int64, n)
    _vector("paged_decode", "lens", lens, torch.int32, n)
    args = _attention_args(
        "paged_decode", q, out, n, k_cache, v_cache, k_scale, v_scale, tables, scale
    )
    rc = cpu_lowbit.library().kvg_paged_decode(
        q.data_ptr(), q.stride(0), out.data_ptr(), rows.data_ptr(), lens.data_ptr(), n, *args
    )
    if rc == -1:
        raise MemoryError("paged_decode: no memory for the split-K partial sums")
    if rc:
        raise ValueError(
            f"paged_decode: unsupported shape q={tuple(q.shape)} kv={tuple(k_cache.shape)}"
        )


def paged_prefill(
    q: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    qlens: torch.Tensor,
    lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Causal attention of prompt chunks: chunk s's `qlens[s]` queries are rows `rows[s]`.. of
    `q` `[T, heads, d]` (rows may be strided), at the last positions of its `lens[s]` cached
    tokens (this step's already written); outputs to the same rows of `out` (contiguous).
    `qlens`, `lens` and `tables` (block table rows, unit stride) are int32, `rows` int64. An fp8
    pool needs its per-block, per-KV-head fp32 scales. Arguments of the wrong dtype, layout or
    size raise ValueError (the kernel would read them as raw memory)."""
    n = rows.numel()
    _vector("paged_prefill", "rows", rows, torch.int64, n)
    _vector("paged_prefill", "qlens", qlens, torch.int32, n)
    _vector("paged_prefill", "lens", lens, torch.int32, n)
    args = _attention_args(
        "paged_prefill", q, out, n, k_cache, v_cache, k_scale, v_scale, tables, scale
    )
    rc = cpu_lowbit.library().kvg_paged_prefill(
        q.data_ptr(), q.stride(0), out.data_ptr(), rows.data_ptr(), qlens.data_ptr(),
        lens.data_ptr(), n, *args,
    )  # fmt: skip
    if rc == -1:
        raise MemoryError("paged_prefill: no memory for the work list")
    if rc:
        raise ValueError(
            f"paged_prefill: unsupported shape q={tuple(q.shape)} kv={tuple(k_cache.shape)}"
            f" or a chunk longer than its sequence"
        )


def _is_rows(x: torch.Tensor) -> bool:
    """CPU float32 rows `[M, N]`, N > 0, unit stride along a row."""
    return (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] > 0
        and x.stride(1) == 1
        and x.is_cpu
    )


def _rows(fn: str, x: torch.Tensor) -> None:
    if not _is_rows(x):
        raise _bad(fn, "x", "CPU float32 rows [M, N > 0] with unit stride along a row", x)


def rows_served(x: torch.Tensor) -> bool:
    """Whether `argmax_rows` and `topk_indices` take `x` (`_is_rows`), the kernels on."""
    return enabled(x) and _is_rows(x)


def argmax_rows(x: torch.Tensor) -> list[int]:
    """`x.argmax(-1).tolist()` for fp32 rows `[M, N]` (unit stride along the row): the first
    largest value's index, the first NaN's where a row holds one, as torch answers."""
    lib = cpu_lowbit.library()
    _rows("argmax_rows", x)
    idx = torch.empty(x.shape[0], dtype=torch.int64)
    lib.kvg_argmax_rows(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), idx.data_ptr(), torch.get_num_threads()
    )
    return idx.tolist()


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The indices `[M, k]` of each row's k largest values of fp32 rows `x` `[M, N]` (unit
    stride along the row), largest first, of equal values the lower index; None where a row
    holds a NaN (torch's topk orders those its own way: the caller asks it)."""
    lib = cpu_lowbit.library()
    _rows("topk_indices", x)
    if not 1 <= k <= min(x.shape[1], 256):
        raise ValueError(f"topk_indices: k={k} outside 1..{min(x.shape[1], 256)}")
    idx = torch.empty(x.shape[0], k, dtype=torch.int64)
    rc = lib.kvg_topk_rows(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, idx.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return None if rc else idx


def topp_draw(
    x: torch.Tensor, temps: list[float], top_ps: list[float], u: list[float]
) -> list[int] | None:
    """A token for each fp32 row of logits `x` `[M, N]` (unit stride along the row): drawn
    from softmax(x / temps[r]) within its top_ps[r] nucleus (the fewest likeliest tokens whose
    probability reaches it; of tokens tied at its edge, the lower ids) by inverse CDF with
    the uniform u[r], over the nucleus in id order. None where a row has a NaN, no finite
    largest value or no probability mass."""
    lib = cpu_lowbit.library()
    _rows("topp_draw", x)
    m = x.shape[0]
    if not len(temps) == len(top_ps) == len(u) == m:
        raise ValueError(f"topp_draw: temps, top_ps and u must hold {m} values each")
    t = torch.tensor(temps, dtype=torch.float32)
    p = torch.tensor(top_ps, dtype=torch.float32)
    uu = torch.tensor(u, dtype=torch.float32)
    tok = torch.empty(m, dtype=torch.int64)
    rc = lib.kvg_topp_rows(
        x.data_ptr(), m, x.shape[1], x.stride(0), t.data_ptr(), p.data_ptr(), uu.data_ptr(),
        tok.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc < 0:
        raise MemoryError("topp_draw: no memory for a row's probabilities")
    return None if rc else tok.tolist()


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension; with `residual`, first
    `x += residual` in place (x's rows may be strided, the last dimension must not)."""
    lib = cpu_lowbit.library()
    d = x.shape[-1]
    x2 = x.view(-1, d)
    if not (x.dtype == torch.float32 and x2.stride(-1) == 1 and x.is_cpu):
        raise _bad("rmsnorm", "x", "CPU float32 with unit stride along the last dimension", x)
    if not (
        weight.dtype == torch.float32
        and weight.shape == (d,)
        and weight.is_contiguous()
        and weight.is_cpu
    ):
        raise _bad("rmsnorm", "weight", f"a contiguous CPU float32 vector of {d}", weight)
    out = torch.empty(x2.shape, dtype=x.dtype)
    y = None
    if residual is not None:
        if not (
            residual.dtype == torch.float32 and residual.numel() == x2.numel() and residual.is_cpu
        ):
            raise _bad("rmsnorm", "residual", f"CPU float32 of x's {x2.numel()} values", residual)
        residual = residual.reshape(-1, d).contiguous()
        y = residual.data_ptr()
    lib.kvg_rmsnorm(
        x2.data_ptr(), x2.stride(0), y, x2.shape[0], d, weight.data_ptr(), eps, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out.view(x.shape)


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on the first `heads` heads of each row of `x` `[T, width]`
    (unit stride along the row), with `cos`/`sin` `[T, head_dim]` per row (contiguous)."""
    lib = cpu_lowbit.library()
    if not (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and head_dim % 2 == 0
        and heads * head_dim <= x.shape[1]
        and x.is_cpu
    ):
        raise _bad("rope_", "x", f"CPU float32 [T, >= {heads} x {head_dim}], unit stride", x)
    for name, t in (("cos", cos), ("sin", sin)):
        if not (
            t.dtype == torch.float32
            and t.shape == (x.shape[0], head_dim)
            and t.is_contiguous()
            and t.is_cpu
        ):
            raise _bad("rope_", name, f"contiguous CPU float32 [{x.shape[0]}, {head_dim}]", t)
    lib.kvg_rope(
        x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip


def silu_mul(x: torch.Tensor, inter: int) -> torch.Tensor:
    """`silu(gate) * up` for rows `[gate | up]` of `x` `[T, 2 * inter]` (unit stride along the
    row): `[T, inter]`, contiguous."""
    lib = cpu_lowbit.library()
    if not (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] == 2 * inter
        and x.stride(1) == 1
        and x.is_cpu
    ):
        raise _bad("silu_mul", "x", f"CPU float32 [T, {2 * inter}], unit stride along a row", x)
    out = torch.empty(x.shape[0], inter, dtype=x.dtype)
    lib.kvg_silu_mul(
        x.data_ptr(), x.stride(0), x.shape[0], inter, out.data_ptr(), torch.get_num_threads()
    )
    return out
