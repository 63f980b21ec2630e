"""The paged KV pools: per layer K and V `[num_blocks, block_size, kv_heads, head_dim]`.

An fp8 pool carries one fp32 scale per block per KV head for K and for V. A second, host-side
pool (pinned on CUDA) holds swapped-out sequences. Both pools can change dtype while serving:
the conversion runs layer by layer, so at any moment at most one layer exists twice.

A dtype switch holds the engine (it runs between two steps, every stream waiting), so it costs
what the live blocks cost and no more: on a CPU each new layer is zero pages the kernel maps
untouched (not a zeroed allocation, which wrote every free block), its pages taken as blocks
fill after the switch, and the live blocks go through one C pass a layer
(`cpu_ops.convert_blocks`). A shrink in the same dtype is zero pages too (only its live blocks
written: the host-mem rule's remedy must not take memory); a pool grown back is zeroed, taking
its memory when it grows, while the room checked for it (`grow_bytes`) is there.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import mmap
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvguard.engine.config import ConfigError
from kvguard.engine.distributed.errors import PoolTorn
from kvguard.engine.model_config import ModelConfig
from kvguard.kernels import cpu_ops
from kvguard.kernels.fp8 import FP8_DTYPE, FP8_MAX, as_bytes, as_rows, dequantize, quantize

KV_TORCH_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": FP8_DTYPE,
}
SCALE_BYTES = 4
# what running out of device memory raises (a step, a pool conversion)
OOM_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)
# torch's CPU allocator reports a failed allocation (ENOMEM under `LimitAS=`/`prlimit --as`,
# strict overcommit) as a plain RuntimeError carrying this text
CPU_ALLOC_FAILED = "DefaultCPUAllocator: can't allocate memory"


class KVMapRefused(MemoryError):
    """The system would not map the pages of a KV layer (`zero_pages`: a `LimitAS=`, strict
    overcommit): out of memory, as a refused allocation is. A MemoryError of its own so that
    `is_oom` counts this one, not every MemoryError a step may raise."""


def is_oom(error: BaseException) -> bool:
    """Whether `error` is running out of memory, on the device or on the host.

    A CPU step that cannot allocate its workspace is the same fault as a GPU one that cannot:
    a smaller step fits, so it is requeued and the budget halved rather than failing the
    step's requests. Only the allocator's own message counts (and KVMapRefused: pages the
    system would not map, `zero_pages`): any other RuntimeError or MemoryError is a bug."""
    if isinstance(error, (*OOM_ERRORS, KVMapRefused)):
        return True
    return isinstance(error, RuntimeError) and CPU_ALLOC_FAILED in str(error)


LayerKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def kv_dtype_name(name: str, model_dtype: torch.dtype) -> str:
    """Resolve `auto` to the model's compute dtype."""
    if name != "auto":
        return name
    return {v: k for k, v in KV_TORCH_DTYPES.items()}[model_dtype]


def element_size(dtype: str) -> int:
    if dtype not in KV_TORCH_DTYPES:
        raise ConfigError(f"kv_cache_dtype={dtype!r}: expected one of {', '.join(KV_TORCH_DTYPES)}")
    return torch.tensor([], dtype=KV_TORCH_DTYPES[dtype]).element_size()


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: str) -> int:
    """K+V bytes of one block across all layers, fp8 scales included."""
    data = block_size * cfg.kv_bytes_per_token(element_size(dtype))
    scales = 2 * cfg.num_layers * cfg.num_kv_heads * SCALE_BYTES if dtype == "fp8_e4m3" else 0
    return data + scales


@dataclass(slots=True)
class Pool:
    """One tier (device or host): its layers, block count and dtype."""

    layers: list[LayerKV]
    num_blocks: int
    dtype: str
    device: torch.device

    @property
    def nbytes(self) -> int:
        return sum(_layer_bytes(layer) for layer in self.layers)


def _layer_bytes(layer: LayerKV) -> int:
    return sum(t.numel() * t.element_size() for t in layer if t is not None)


def new_layer(
    cfg: ModelConfig,
    n: int,
    block_size: int,
    dtype: str,
    device: torch.device,
    pin: bool = False,
    fresh_pages: bool = False,
) -> LayerKV:
    """One layer's K and V (and fp8 scales) of `n` blocks, zeroed. `fresh_pages` (a CPU pool
    converted while serving): the K/V as zero pages the kernel maps untouched, so building
    the layer costs nothing per block; pages fill in as blocks are written."""
    shape = (n, block_size, cfg.num_kv_heads, cfg.head_dim)
    tdt = KV_TORCH_DTYPES[dtype]
    lazy = fresh_pages and device.type == "cpu" and not pin

    def buf() -> torch.Tensor:
        if lazy:
            return zero_pages(shape, tdt)
        t = torch.zeros(shape, dtype=tdt, device=device)
        return t.pin_memory() if pin else t

    if dtype != "fp8_e4m3":
        return (buf(), buf(), None, None)
    scales = (n, cfg.num_kv_heads)
    ks = torch.zeros(scales, dtype=torch.float32, device=device)
    vs = torch.zeros(scales, dtype=torch.float32, device=device)
    return (buf(), buf(), ks.pin_memory() if pin else ks, vs.pin_memory() if pin else vs)


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros on an anonymous private mapping: the kernel hands out zero pages
    on first touch, so nothing is written (or faulted in) now, where torch.zeros writes every
    byte. The mapping goes back to the system with the last tensor viewing it. KVMapRefused
    (a MemoryError) where the system refuses it (a `LimitAS=`, strict overcommit), as an allocation would."""
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    if not nbytes:  # no blocks (a host pool of none): nothing to map
        return torch.zeros(shape, dtype=dtype)
    try:
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise KVMapRefused(f"cannot map {nbytes} bytes for a KV layer: {e.strerror}") from e
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def new_pool(cfg: ModelConfig, n: int, block_size: int, dtype: str, device: torch.device) -> Pool:
    pin = device.type == "cpu" and torch.cuda.is_available()
    layers = [new_layer(cfg, n, block_size, dtype, device, pin) for _ in range(cfg.num_layers)]
    return Pool(layers, n, dtype, device)


def read_blocks(layer: LayerKV, ids: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `ids` of K (which=0) or V (1) in `dtype`, dequantised if the pool is fp8."""
    data = layer[which]
    if data.dtype != FP8_DTYPE:
        return data.index_select(0, ids).to(dtype)
    raw = as_bytes(data).index_select(0, ids).view(FP8_DTYPE)
    return dequantize(raw, layer[2 + which].index_select(0, ids)[:, None, :, None], dtype)


def write_blocks(layer: LayerKV, ids: torch.Tensor, which: int, vals: torch.Tensor) -> None:
    """Store whole blocks `vals` at `ids`; fp8 gets a fresh scale per block and head."""
    data = layer[which]
    if data.dtype != FP8_DTYPE:
        data.index_copy_(0, ids, vals.to(data.dtype))
        return
    amax = vals.float().abs().amax(dim=(1, 3))  # [n, kv_heads]
    scale = (amax / FP8_MAX).clamp_min_(1e-12)
    layer[2 + which].index_copy_(0, ids, scale)
    as_rows(data).index_copy_(0, ids, as_rows(quantize(vals, scale[:, None, :, None])))


def copy_blocks(src: LayerKV, src_ids: torch.Tensor, dst: LayerKV, dst_ids: torch.Tensor) -> None:
    """Block copy between pools of the same dtype (swap): raw bytes, scales alongside."""
    for i, t in enumerate(src):
        if t is None:
            continue
        s, d = as_rows(t), as_rows(dst[i])
        d.index_copy_(0, dst_ids.to(d.device), s.index_select(0, src_ids.to(s.device)).to(d.device))


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: str,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.device_pool = new_pool(cfg, num_blocks, block_size, dtype, device)
        self.host_pool = new_pool(cfg, num_host_blocks, block_size, dtype, torch.device("cpu"))
        # The byte budgets stay fixed; the block counts follow the dtype.
        self.budget_bytes = num_blocks * bytes_per_block(cfg, block_size, dtype)
        self.host_budget_bytes = num_host_blocks * bytes_per_block(cfg, block_size, dtype)
        self.last_switch_peak_extra_bytes = 0
        # Called after each layer a conversion builds (or puts back), on the converting thread.
        # A whole conversion is one engine pause that grows with the pool (seconds per GiB on
        # a CPU): the engine loop beats its heartbeat here, so that a conversion making
        # progress is not taken for a stalled engine (the systemd watchdog, /ready).
        self.on_progress: Callable[[], None] = _nothing

    @property
    def layers(self) -> list[LayerKV]:
        return self.device_pool.layers

    @property
    def dtype(self) -> str:
        return self.device_pool.dtype

    @property
    def num_blocks(self) -> int:
        return self.device_pool.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.cfg, self.block_size, self.dtype)

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks

    def blocks_for_budget(self, dtype: str, host: bool = False) -> int:
        budget = self.host_budget_bytes if host else self.budget_bytes
        return budget // bytes_per_block(self.cfg, self.block_size, dtype)

    def grow_bytes(self, pool: Pool, new_n: int) -> int:
        """The memory a rebuild of `pool` as `new_n` blocks of its dtype takes beyond what it
        holds now, over all the model's layers: the grown pool is zeroed, every page of it
        written, and the old one given back, so what counts is the new pool's bytes less the
        old one's resident bytes. After a live dtype switch or a shrink the old pool is zero
        pages, only its written blocks in memory: charging the difference of the block counts
        would miss the rest of the new pool."""
        per_block = self.bytes_per_block
        whole = pool.num_blocks * per_block
        if pool.nbytes and pool.device.type == "cpu":  # this rank's share of its pool in memory
            whole = whole * sum(_resident_bytes(t) for t in _tensors(pool)) // pool.nbytes
        return new_n * per_block - whole

    def swap_out(self, device_ids: list[int], host_ids: list[int]) -> None:
        dev, host = _ids(device_ids, self.device_pool), _ids(host_ids, self.host_pool)
        for d, h in zip(self.device_pool.layers, self.host_pool.layers, strict=True):
            copy_blocks(d, dev, h, host)

    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        dev, host = _ids(device_ids, self.device_pool), _ids(host_ids, self.host_pool)
        for d, h in zip(self.device_pool.layers, self.host_pool.layers, strict=True):
            copy_blocks(h, host, d, dev)

    def convert(self, pool: Pool, dtype: str, new_n: int, moves: dict[int, int]) -> int:
        """Rebuild `pool` as `new_n` blocks of `dtype` (a new dtype, or the same one in a new
        size), live block `old` landing at `moves[old]`.

        Layer by layer: the new layer is built, filled from the old one, and the old one dropped
        before the next layer starts. Returns the peak of bytes held beyond the larger of the
        old and new pool sizes (the price of the switch).

        A layer that cannot be built (out of memory: the switch is a remedy, run under memory
        pressure) undoes the layers already converted, so the pool is whole in its old dtype
        and size again, and the error is raised (those layers' K/V went through `dtype` and
        back: narrowed, they keep its rounding). Should that fail too, PoolTorn: the pool is
        half converted and the engine cannot go on.
        """
        old_dtype, old_n = pool.dtype, pool.num_blocks
        order = sorted(moves)
        src = torch.tensor(order, dtype=torch.long, device=pool.device)
        dst = torch.tensor([moves[o] for o in order], dtype=torch.long, device=pool.device)
        start = current = pool.nbytes
        peak = 0
        for i, layer in enumerate(pool.layers):
            try:
                fresh, held = self._converted(layer, pool, dtype, new_n, src, dst, current)
            except BaseException as e:
                traceback.clear_frames(e.__traceback__)  # the half-built layer goes first
                self._undo(pool, i, old_dtype, old_n, dst, src, e)
                raise
            peak = max(peak, held)
            current += _layer_bytes(fresh) - _layer_bytes(layer)
            pool.layers[i] = fresh
            self.on_progress()
        pool.dtype, pool.num_blocks = dtype, new_n
        return max(0, peak - max(start, current))

    def _converted(
        self,
        layer: LayerKV,
        pool: Pool,
        dtype: str,
        n: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        current: int,
    ) -> tuple[LayerKV, int]:
        """`layer` as `n` blocks of `dtype`, its blocks `src` at `dst`; and the most bytes the
        pool held meanwhile (`current` before)."""
        resize = dtype == _layer_dtype(layer)
        # A grown pool takes its memory now (zeroed: the room was checked, `grow_bytes`); a
        # new dtype, or a pool no larger than before (a shrink, the host-mem rule's remedy),
        # is zero pages: only the live blocks' pages are written, the rest fill as blocks do
        lazy = not resize or n <= layer[0].shape[0]
        fresh = new_layer(self.cfg, n, self.block_size, dtype, pool.device, _pinned(layer), lazy)
        held = peak = current + _layer_bytes(fresh)
        if src.numel() and resize:  # a new size, same dtype: the bytes
            copy_blocks(layer, src, fresh, dst)  # as they are, scales alongside
        elif src.numel():
            for which in (0, 1):
                if cpu_ops.convert_blocks(
                    layer[which], layer[2 + which], src, fresh[which], fresh[2 + which], dst
                ):
                    continue
                vals = read_blocks(layer, src, which, torch.float32)
                peak = max(peak, held + vals.numel() * vals.element_size())
                write_blocks(fresh, dst, which, vals)
                del vals
        return fresh, peak

    def _undo(
        self,
        pool: Pool,
        done: int,
        dtype: str,
        n: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        error: BaseException,
    ) -> None:
        """Put the first `done` layers, converted, back as `n` blocks of `dtype`."""
        try:
            for j in range(done):
                pool.layers[j], _ = self._converted(pool.layers[j], pool, dtype, n, src, dst, 0)
                self.on_progress()
        except BaseException as e:
            raise PoolTorn(
                f"the KV pool is half converted: layer {done} could not be built ({error}) and "
                f"layer {j} could not be put back ({e})"
            ) from e


def _tensors(pool: Pool) -> list[torch.Tensor]:
    return [t for layer in pool.layers for t in layer if t is not None]


def _resident_bytes(t: torch.Tensor) -> int:
    """How many bytes of CPU tensor `t` (contiguous) are in memory: its pages the kernel has
    mapped (`mincore`). 0 where the kernel cannot be asked: a grow is then charged its
    whole new pool, more than it may take, never less."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return 0
    if torch.cuda.is_available() and t.is_pinned():  # page-locked: in memory by definition
        return nbytes
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + nbytes - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    if _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return 0
    pages = torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum().item()
    return min(nbytes, pages * page)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _nothing() -> None:
    pass


def _ids(ids: list[int], pool: Pool) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=pool.device)


def _layer_dtype(layer: LayerKV) -> str:
    return next(name for name, t in KV_TORCH_DTYPES.items() if t == layer[0].dtype)


def _pinned(layer: LayerKV) -> bool:
    return layer[0].device.type == "cpu" and torch.cuda.is_available() and layer[0].is_pinned()
