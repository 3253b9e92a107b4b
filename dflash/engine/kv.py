"""The KV state of one sequence: a preallocated cache plus a length.

Layout [layers, KV heads, max_ctx, D]: heads-major so each layer's committed keys `[:, :length]` are
one strided view that scaled_dot_product_attention reads without a copy. Rolling back rejected
tokens is moving `length`; a snapshot copies only `[:length]`.
"""

from __future__ import annotations

import math
import mmap

import attrs
import torch
from torch import Tensor


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """A zero tensor whose memory the system provides only as it is written, on the CPU.

    Why: torch.zeros writes every byte, so a server held its whole context's keys and values
    resident from start-up (the embedded model's 32K context: 720 MiB) though a conversation uses a
    part of it. An anonymous mapping is the kernel's zero pages, each made resident on its first
    write, whatever the allocator's state (calloc reuses freed heap, which it must then zero). The
    tensor keeps the mapping alive. Positions past a sequence's length are read only masked
    (torch's attention over padded key counts) or never (ours).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@attrs.frozen
class KVSnapshot:
    keys: Tensor  # [layers, KV, length, D]
    values: Tensor
    length: int
    key_scales: Tensor | None = None  # [layers, KV, length]: an Int8KVCache's
    value_scales: Tensor | None = None

    @property
    def nbytes(self) -> int:
        scales = 0 if self.key_scales is None else self.key_scales.numel() * self.key_scales.element_size() * 2
        return self.keys.numel() * self.keys.element_size() * 2 + scales


class KVCache:
    # A snapshot of any prefix can be taken later: appending never changes the rows before it.
    snapshots_any_prefix = True
    quantized = False

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        max_ctx: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        snapshot_dtype: torch.dtype | None = None,
    ):
        shape = (layers, kv_heads, max_ctx, head_dim)
        # Snapshots may be stored narrower than the cache: a bf16 model's keys and values are exact
        # in bf16 even when attention keeps them in fp32, so storing them as bf16 halves the memory.
        self.snapshot_dtype = snapshot_dtype or dtype
        self.keys = lazily_zeroed(shape, dtype, device)
        self.values = lazily_zeroed(shape, dtype, device)
        self.max_ctx = max_ctx
        self.length = 0

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k/v [T, KV, D] at start..start+T; return the layer's keys/values [KV, start+T, D]."""
        end = start + k.shape[0]
        self.keys[layer, :, start:end] = k.transpose(0, 1)
        self.values[layer, :, start:end] = v.transpose(0, 1)
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def attention_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype queries of `dtype` are cast to for attention over this cache: the cache's."""
        return self.keys.dtype

    def readable(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """The layer's keys/values [KV, end, D] as torch's attention reads them (explicit masks)."""
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop KV length {self.length} to {length}")
        self.length = length

    def snapshot(self, length: int | None = None) -> KVSnapshot:
        n = self.length if length is None else length
        narrow = self.snapshot_dtype
        return KVSnapshot(self.keys[:, :, :n].to(narrow, copy=True), self.values[:, :, :n].to(narrow, copy=True), n)

    def restore(self, snap: KVSnapshot) -> None:
        n = snap.length
        if n > self.max_ctx:
            raise ValueError(f"snapshot of {n} tokens does not fit a KV cache of {self.max_ctx}")
        if snap.key_scales is not None:
            raise ValueError("an int8 snapshot cannot be restored into a float KV cache")
        self.keys[:, :, :n] = snap.keys
        self.values[:, :, :n] = snap.values
        self.length = n


class Int8KVCache(KVCache):
    """Keys and values as int8 codes with one float32 scale per (token, KV head): half a bf16
    cache's bytes, so a decode step at depth reads half as much (native/causal_attention.cpp, section
    "int8 keys and values", which also says how the codes are made; `[model] kv_cache = "int8"`).
    Keys are stored as code + 128 (uint8, as VNNI multiplies them), values as int8. Written and read
    by the native kernels only: quantize_kv on every write, causal_attention_int8 for causal
    attention; an explicit mask (tree verification, tests) reads dequantized copies (`readable`).
    """

    quantized = True

    def __init__(self, layers: int, kv_heads: int, max_ctx: int, head_dim: int, device, native):
        if torch.device(device).type != "cpu" or native is None or not native.int8_kv_available():
            raise ValueError("an int8 KV cache needs the native kernels on a CPU with AVX512-VNNI (`make install`)")
        self.native = native
        self.snapshot_dtype = None
        self.keys = lazily_zeroed((layers, kv_heads, max_ctx, head_dim), torch.uint8, device)
        self.values = lazily_zeroed((layers, kv_heads, max_ctx, head_dim), torch.int8, device)
        self.key_scales = lazily_zeroed((layers, kv_heads, max_ctx), torch.float32, device)
        self.value_scales = lazily_zeroed((layers, kv_heads, max_ctx), torch.float32, device)
        self.max_ctx = max_ctx
        self.length = 0

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Quantize k/v [T, KV, D] into positions start..start+T of the layer."""
        self.native.quantize_kv(k, v, self.keys[layer], self.values[layer], self.key_scales[layer], self.value_scales[layer], start)

    def attention_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # the kernel quantizes each query row itself

    def attend(self, q: Tensor, layer: int, start: int) -> Tensor:
        """Causal attention of q [T, H, D] at positions start.. over the layer: [T, H, D] in q's dtype."""
        return self.native.causal_attention_int8(q, self.keys[layer], self.values[layer], self.key_scales[layer],
                                                 self.value_scales[layer], start)

    def readable(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        return (dequantized(self.keys[layer, :, :end], self.key_scales[layer, :, :end], KEY_OFFSET),
                dequantized(self.values[layer, :, :end], self.value_scales[layer, :, :end], 0))

    def snapshot(self, length: int | None = None) -> KVSnapshot:
        n = self.length if length is None else length
        return KVSnapshot(self.keys[:, :, :n].clone(), self.values[:, :, :n].clone(), n,
                          self.key_scales[:, :, :n].clone(), self.value_scales[:, :, :n].clone())

    def restore(self, snap: KVSnapshot) -> None:
        n = snap.length
        if n > self.max_ctx:
            raise ValueError(f"snapshot of {n} tokens does not fit a KV cache of {self.max_ctx}")
        if snap.key_scales is None or snap.keys.dtype != torch.uint8:
            raise ValueError(f"a {snap.keys.dtype} snapshot cannot be restored into an int8 KV cache")
        self.keys[:, :, :n] = snap.keys
        self.values[:, :, :n] = snap.values
        self.key_scales[:, :, :n] = snap.key_scales
        self.value_scales[:, :, :n] = snap.value_scales
        self.length = n


KEY_OFFSET = 128  # an Int8KVCache key code c is stored as the byte c + 128


def dequantized(codes: Tensor, scales: Tensor, offset: int) -> Tensor:
    """codes [..., D] (stored + offset) times scales [...] as float32."""
    return (codes.to(torch.int32) - offset).to(torch.float32) * scales[..., None]
