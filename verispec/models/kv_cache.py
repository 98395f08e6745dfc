"""Preallocated, positional KV cache shared by several sequence slots.

Layout per layer: ``k[layer]`` and ``v[layer]`` are ``[num_slots, kv_heads, max_len, head_dim]``.
Each slot holds one sequence; ``lengths[slot]`` counts the committed positions.

* A forward pass writes its T new keys/values at cache indices ``lengths[slot] .. +T`` of its
  slots and then advances ``lengths`` (the decoder does both).
* Rolling back to length L is a pointer move (:meth:`KVCache.truncate`): stale entries stay in
  memory, hidden by the attention mask, until they are overwritten.
* Tree verification writes a whole tree and then keeps one root-to-leaf path with
  :meth:`KVCache.keep` (one gather + copy per layer, no ``torch.cat``).

For a chain (plain decoding, chain speculation) the cache index of a token equals its position.
For a tree the positions fed to RoPE are depths, while the cache indices stay contiguous.

Attention always reduces over ``attend_len(...)`` cache entries, a length rounded up to a
multiple of ``block`` so that the k+1 rows of a verify pass and the single row of a plain decode
step see the same reduction. Masked entries contribute exact zeros, so results are bitwise
independent of how many new rows a pass computes.
"""

from __future__ import annotations

import torch
from torch import Tensor


# The smallest float32 magnitude that rounds to infinity in float16 (65504 is its largest).
HALF_OVERFLOW = 65520.0


def _check_fits_half(k: Tensor, v: Tensor) -> None:
    """Raise if a finite value would become an infinity in a float16 cache (and the attention
    over it NaN); the native one-call layer checks its writes alike. One host read a write."""
    big = torch.maximum(k.abs().amax(), v.abs().amax())
    if bool(torch.isfinite(big) & (big >= HALF_OVERFLOW)):
        raise ValueError(f"a key or value of magnitude {big.item():g} does not fit the float16 KV cache; "
                         "load the model with kv_cache_dtype='float32' (--kv-cache-dtype float32)")


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        block: int = 256,
    ) -> None:
        if max_len <= 0 or num_slots <= 0:
            raise ValueError(f"KVCache needs max_len > 0 and num_slots > 0, got {max_len}, {num_slots}")
        self.max_len = max_len
        self.num_slots = num_slots
        self.block = block
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Host-side lengths: the engine needs them to plan every step anyway, so keeping them on
        # the CPU avoids a device sync per step.
        self.lengths = [0] * num_slots

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def length(self, slot: int = 0) -> int:
        return self.lengths[slot]

    def attend_len(self, needed: int) -> int:
        """Number of cache entries a pass attends over: ``needed`` rounded up to ``block``."""
        padded = -(-needed // self.block) * self.block
        return min(padded, self.max_len)

    def check_room(self, slots: list[int], num_new: int) -> None:
        for s in slots:
            if self.lengths[s] + num_new > self.max_len:
                raise ValueError(
                    f"sequence in slot {s} would reach {self.lengths[s] + num_new} positions, "
                    f"beyond the cache's max_len={self.max_len}"
                )

    def write(self, layer: int, slots: list[int], k_new: Tensor, v_new: Tensor) -> None:
        """Store new keys/values at each slot's current length.

        k_new, v_new: [batch, kv_heads, T, head_dim]; row b goes to slot ``slots[b]`` at cache
        indices ``lengths[slot] .. lengths[slot] + T``. Lengths are advanced by :meth:`advance`.
        """
        t = k_new.shape[2]
        if self.k[layer].dtype == torch.float16 and k_new.dtype != torch.float16:
            _check_fits_half(k_new, v_new)
        for b, s in enumerate(slots):
            start = self.lengths[s]
            self.k[layer][s, :, start : start + t] = k_new[b]
            self.v[layer][s, :, start : start + t] = v_new[b]

    def view(self, layer: int, slots: list[int], length: int) -> tuple[Tensor, Tensor]:
        """Keys and values of ``slots`` over cache indices ``[0, length)``.

        Returns two [batch, kv_heads, length, head_dim] tensors; a contiguous run of slots is a
        view, anything else a gather.
        """
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            sl = slice(first, first + len(slots))
            return self.k[layer][sl, :, :length], self.v[layer][sl, :, :length]
        idx = torch.tensor(slots, device=self.device)
        return self.k[layer][idx, :, :length], self.v[layer][idx, :, :length]

    def advance(self, slots: list[int], num_new: int) -> None:
        for s in slots:
            self.lengths[s] += num_new

    def truncate(self, slot: int, length: int) -> None:
        """Roll slot back to ``length`` committed positions: O(1), a pointer move."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` holds a copy of slot ``src``'s committed entries (one copy per layer)."""
        n = self.lengths[src]
        for layer in range(len(self.k)):
            self.k[layer][dst, :, :n] = self.k[layer][src, :, :n]
            self.v[layer][dst, :, :n] = self.v[layer][src, :, :n]
        self.lengths[dst] = n

    def keep(self, slot: int, start: int, keep_indices: Tensor | list[int]) -> None:
        """Tree-path compaction: of the entries written at ``start..``, keep only ``keep_indices``.

        ``keep_indices`` are offsets relative to ``start``, in the order they should end up.
        Example: a tree of 5 nodes written at cache indices 10..14 whose accepted path is nodes
        (0, 2, 3): ``keep(slot, 10, [0, 2, 3])`` moves entries 10, 12, 13 to 10, 11, 12 and sets
        the slot's length to 13.
        """
        idx = torch.as_tensor(keep_indices, dtype=torch.long, device=self.device) + start
        n = int(idx.numel())
        for layer in range(len(self.k)):
            # index_select copies first, so overlapping source/destination ranges are safe.
            self.k[layer][slot, :, start : start + n] = self.k[layer][slot].index_select(1, idx)
            self.v[layer][slot, :, start : start + n] = self.v[layer][slot].index_select(1, idx)
        self.lengths[slot] = start + n
