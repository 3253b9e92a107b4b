"""The KV state of one sequence: a preallocated cache plus a length.

Layout [layers, KV heads, max_ctx, D]: heads-major so each layer's committed keys `[:, :length]` are
one strided view that scaled_dot_product_attention reads without a copy. Rolling back rejected
tokens is moving `length`; a snapshot copies only `[:length]`.
"""

from __future__ import annotations

import math
import mmap
from typing import Callable

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
    """The keys and values of positions `start`..`length`; those before `start` are its base's.

    Why a base: an agent's next turn snapshots a prompt that extends the last turn's by a few dozen
    tokens, and a whole copy of a 20K-token cache is 460 MB, a tenth of a second and more of the
    engine thread, each boundary of each turn. Built on the snapshot of the longest prefix already
    kept, a turn's snapshot copies only its own tokens. Snapshots are never changed once made, so a
    base shared by several is safe; MAX_CHAIN bounds how many a restore walks.
    """

    keys: Tensor  # [layers, KV, length - start, D]
    values: Tensor
    length: int
    key_scales: Tensor | None = None  # [layers, KV, length - start]: an Int8KVCache's
    value_scales: Tensor | None = None
    base: KVSnapshot | None = None

    MAX_CHAIN = 16  # snapshots in a chain, the base's included; a longer one would be copied whole

    @property
    def start(self) -> int:
        return 0 if self.base is None else self.base.length

    def chain(self) -> list[KVSnapshot]:
        """The snapshots that hold this one's positions, the first positions first."""
        links = [] if self.base is None else self.base.chain()
        return links + [self]

    def pieces(self, name: str) -> list[Tensor]:
        """One tensor ("keys", "values", "key_scales", "value_scales") as its chain holds it."""
        return [getattr(link, name) for link in self.chain()]

    @property
    def nbytes(self) -> int:
        """Bytes of this snapshot's own positions (its base's are counted where the base is)."""
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
        rope_switch: int | None = None,
    ):
        shape = (layers, kv_heads, max_ctx, head_dim)
        # Snapshots may be stored narrower than the cache: a bf16 model's keys and values are exact
        # in bf16 even when attention keeps them in fp32, so storing them as bf16 halves the memory.
        self.snapshot_dtype = snapshot_dtype or dtype
        self.keys = lazily_zeroed(shape, dtype, device)
        self.values = lazily_zeroed(shape, dtype, device)
        self.max_ctx = max_ctx
        self.length = 0
        # Where the model's RoPE scaling switches in (model.rope_switch), and whether the keys below
        # it have been rotated to the scaled angles. Rotated keys serve only a sequence past the
        # switch: a state cut back below it is not kept, and no snapshot below it is taken from
        # them. So what the cache holds stays a function of its tokens (rows computed as trained,
        # rotated once past the switch), and a restore or a reuse gives what computing afresh gives.
        self.rope_switch = rope_switch
        self.rope_rotated = False

    def rotated_at(self, length: int) -> bool:
        """Whether the keys of a state of `length` positions are rotated: it lies past the switch."""
        return self.rope_switch is not None and length > self.rope_switch

    def keepable(self, length: int) -> int:
        """How many of the first `length` positions a crop keeps: all, or none where rotated keys
        would have to serve a sequence that no longer passes the switch."""
        return 0 if self.rope_rotated and length < self.rope_switch else length

    def can_snapshot(self, length: int) -> bool:
        """Whether a snapshot of the first `length` positions holds what a state of that length
        holds: not where they are rotated and it does not pass the switch."""
        return not self.rope_rotated or self.rotated_at(length)

    def rotate_keys(self, rotate: Callable[[Tensor], Tensor]) -> None:
        """Replace the keys below the switch, a layer at a time, by `rotate` of them ([KV, switch, D]
        in fp32; model._switch_rope's rotation)."""
        if self.rope_rotated or self.rope_switch is None:
            raise ValueError("the KV cache's keys are rotated already, or it has no RoPE switch")
        for layer in range(self.keys.shape[0]):
            self._store_rotated_keys(layer, rotate(self._keys_below_switch(layer)))
        self.rope_rotated = True

    def _keys_below_switch(self, layer: int) -> Tensor:
        """The layer's keys below the switch [KV, switch, D] in fp32."""
        return self.keys[layer, :, : self.rope_switch].float()

    def _store_rotated_keys(self, layer: int, keys: Tensor) -> None:
        self.keys[layer, :, : self.rope_switch] = keys.to(self.keys.dtype)

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k/v [T, KV, D] at start..start+T; return the layer's keys/values [KV, start+T, D]."""
        end = start + k.shape[0]
        self.keys[layer, :, start:end] = k.transpose(0, 1)
        self.values[layer, :, start:end] = v.transpose(0, 1)
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def write_rows(self, start: int, keys: Tensor, values: Tensor) -> None:
        """Store keys/values [layers, T, KV, D] of every layer at start..start+T (a draft tree's
        accepted path: generate.Engine.keep_tree_path), as `write` would have, layer by layer."""
        end = start + keys.shape[1]
        self.keys[:, :, start:end] = keys.transpose(1, 2)
        self.values[:, :, start:end] = values.transpose(1, 2)

    def attention_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype queries of `dtype` are cast to for attention over this cache: the cache's."""
        return self.keys.dtype

    def readable(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """The layer's keys/values [KV, end, D] as torch's attention reads them (explicit masks)."""
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions, or none (`keepable`): `length` says which."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop KV length {self.length} to {length}")
        self.length = self.keepable(length)
        if self.length == 0:
            self.rope_rotated = False

    def snapshot(self, length: int | None = None, base: KVSnapshot | None = None) -> KVSnapshot:
        """A copy of positions 0..length (all committed by default). With `base`, a snapshot of this
        cache's first base.length positions (the caller's word that they still hold what they held
        then), only positions base.length.. are copied and the base is shared."""
        n, base, start = self._span(length, base)
        if not self.can_snapshot(n):
            raise ValueError(f"the keys below position {self.rope_switch} are rotated; a snapshot of {n} positions "
                             "would not hold that state")
        narrow = self.snapshot_dtype
        return KVSnapshot(self.keys[:, :, start:n].to(narrow, copy=True), self.values[:, :, start:n].to(narrow, copy=True),
                          n, base=base)

    def _span(self, length: int | None, base: KVSnapshot | None) -> tuple[int, KVSnapshot | None, int]:
        """(the snapshot's length, the base it is built on or None, its first own position)."""
        n = self.length if length is None else length
        if (base is None or base.length > n or len(base.chain()) >= KVSnapshot.MAX_CHAIN
                or self.rotated_at(base.length) != self.rotated_at(n)):  # the base's keys unrotated, this one's not
            return n, None, 0
        if (base.key_scales is None) != (not self.quantized):
            raise ValueError("a snapshot's base must come from the same kind of KV cache")
        return n, base, base.length

    def restore(self, snap: KVSnapshot, held: int = 0) -> None:
        """Make the cache hold the snapshot's positions. `held`: how many of them the cache holds
        already (the caller's word: the same tokens at the same positions), not copied again."""
        n = snap.length
        if n > self.max_ctx:
            raise ValueError(f"snapshot of {n} tokens does not fit a KV cache of {self.max_ctx}")
        self._check_kind(snap)
        rotated = self.rotated_at(n)
        if rotated != self.rope_rotated:
            held = 0  # the positions held are rotated the other way
        for link in snap.chain():
            self._restore_link(link, min(max(held, link.start), link.length))
        self.length = n
        self.rope_rotated = rotated

    def _check_kind(self, snap: KVSnapshot) -> None:
        if snap.key_scales is not None:
            raise ValueError("an int8 snapshot cannot be restored into a float KV cache")

    def _restore_link(self, link: KVSnapshot, begin: int) -> None:
        """Positions begin..link.length from the snapshot link holding link.start..link.length."""
        skip, end = begin - link.start, link.length
        self.keys[:, :, begin:end] = link.keys[:, :, skip:]
        self.values[:, :, begin:end] = link.values[:, :, skip:]


class Int8KVCache(KVCache):
    """Keys and values as int8 codes with one float32 scale per (token, KV head): half a bf16
    cache's bytes, so a decode step at depth reads half as much (native/causal_attention.cpp, section
    "int8 keys and values", which also says how the codes are made; `[model] kv_cache = "int8"`).
    Keys are stored as code + 128 (uint8, as VNNI multiplies them), values as int8. Written and read
    by the native kernels only: quantize_kv on every write, causal_attention_int8 for causal
    attention; an explicit mask (tree verification, tests) reads dequantized copies (`readable`).
    """

    quantized = True

    def __init__(self, layers: int, kv_heads: int, max_ctx: int, head_dim: int, device, native,
                 rope_switch: int | None = None):
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
        self.rope_switch = rope_switch
        self.rope_rotated = False

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Quantize k/v [T, KV, D] into positions start..start+T of the layer."""
        self.native.quantize_kv(k, v, self.keys[layer], self.values[layer], self.key_scales[layer], self.value_scales[layer], start)

    def write_rows(self, start: int, keys: Tensor, values: Tensor) -> None:
        for layer in range(keys.shape[0]):  # each row's codes depend on that row only: as written first
            self.write(layer, start, keys[layer], values[layer])

    def attention_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # the kernel quantizes each query row itself

    def _keys_below_switch(self, layer: int) -> Tensor:
        below = self.rope_switch
        return dequantized(self.keys[layer, :, :below], self.key_scales[layer, :, :below], KEY_OFFSET)

    def _store_rotated_keys(self, layer: int, keys: Tensor) -> None:
        """Quantize the rotated keys again, as every cached row is (quantize_kv); the values it
        quantizes alongside go to scratch rows laid out as the layer's (it takes one stride for both)."""
        below = self.rope_switch
        scratch_values = torch.empty_like(self.values[layer])[:, :below]
        scratch_scales = torch.empty_like(self.value_scales[layer])[:, :below]
        rows = keys.transpose(0, 1)  # [switch, KV, D]
        self.native.quantize_kv(rows, rows, self.keys[layer, :, :below], scratch_values,
                                self.key_scales[layer, :, :below], scratch_scales, 0)

    def attend(self, q: Tensor, layer: int, start: int) -> Tensor:
        """Causal attention of q [T, H, D] at positions start.. over the layer: [T, H, D] in q's dtype."""
        return self.native.causal_attention_int8(q, self.keys[layer], self.values[layer], self.key_scales[layer],
                                                 self.value_scales[layer], start)

    def readable(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        return (dequantized(self.keys[layer, :, :end], self.key_scales[layer, :, :end], KEY_OFFSET),
                dequantized(self.values[layer, :, :end], self.value_scales[layer, :, :end], 0))

    def snapshot(self, length: int | None = None, base: KVSnapshot | None = None) -> KVSnapshot:
        n, base, start = self._span(length, base)
        return KVSnapshot(self.keys[:, :, start:n].clone(), self.values[:, :, start:n].clone(), n,
                          self.key_scales[:, :, start:n].clone(), self.value_scales[:, :, start:n].clone(), base)

    def _check_kind(self, snap: KVSnapshot) -> None:
        if snap.key_scales is None or snap.keys.dtype != torch.uint8:
            raise ValueError(f"a {snap.keys.dtype} snapshot cannot be restored into an int8 KV cache")

    def _restore_link(self, link: KVSnapshot, begin: int) -> None:
        super()._restore_link(link, begin)
        skip, end = begin - link.start, link.length
        self.key_scales[:, :, begin:end] = link.key_scales[:, :, skip:]
        self.value_scales[:, :, begin:end] = link.value_scales[:, :, skip:]


KEY_OFFSET = 128  # an Int8KVCache key code c is stored as the byte c + 128


def dequantized(codes: Tensor, scales: Tensor, offset: int) -> Tensor:
    """codes [..., D] (stored + offset) times scales [...] as float32."""
    return (codes.to(torch.int32) - offset).to(torch.float32) * scales[..., None]
