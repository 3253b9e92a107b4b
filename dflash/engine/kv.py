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

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


class KVCache:
    # A snapshot of any prefix can be taken later: appending never changes the rows before it.
    snapshots_any_prefix = True

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
        self.keys[:, :, :n] = snap.keys
        self.values[:, :, :n] = snap.values
        self.length = n
