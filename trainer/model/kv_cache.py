"""A static key/value cache for decoding: each layer's keys and values of every position seen so far,
in buffers allocated once per request, so a new token costs one position's forward, not the prefix's.

Rows of a batch may be padded on either side: a slot holds a real token or padding (`valid`),
and a row's positions count its real tokens only, so a padded prompt gets the positions (learned
or rotary) it would have alone. Every slot attends to the earlier real slots of its row and to
itself (a padding slot then has one key, not none: no softmax over nothing, no NaN that its
value could spread); real slots never attend to padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Keys and values of `n_layer` layers for `batch` rows of up to `max_len` slots."""

    def __init__(self, n_layer: int, batch: int, max_len: int, device: torch.device):
        self.n_layer, self.batch, self.max_len = n_layer, batch, max_len
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.filled = 0  # slots written (the same for every row)
        self.padded = False  # any padding slot so far (attention then needs a mask)

    @property
    def room(self) -> int:
        return self.max_len - self.filled

    def step(self, valid: torch.Tensor | None, width: int) -> CacheStep:
        """The next `width` slots for every row; `valid` (batch, width) marks the real tokens (None:
        all real). Positions and the attention mask for this forward; the slots count as filled."""
        if width > self.room:
            raise ValueError(f"the cache holds {self.max_len} positions; {self.filled} used, {width} more asked")
        start, end = self.filled, self.filled + width
        device = self.valid.device
        if valid is None:
            valid = torch.ones(self.batch, width, dtype=torch.bool, device=device)
        else:
            self.padded = self.padded or not bool(valid.all())
        self.valid[:, start:end] = valid
        counts = valid.long().cumsum(dim=1)
        positions = (self.next_pos.unsqueeze(1) + counts - 1).clamp(min=0)
        self.next_pos += counts[:, -1]
        self.filled = end
        mask = None
        # Without padding, one new slot attends to all, and a first forward is plain causal.
        if self.padded or (start > 0 and width > 1):
            slots = torch.arange(end, device=device)
            query_slots = torch.arange(start, end, device=device).unsqueeze(1)
            earlier = slots.unsqueeze(0) <= query_slots  # (width, end)
            mask = (earlier.unsqueeze(0) & self.valid[:, :end].unsqueeze(1)) | (slots == query_slots).unsqueeze(0)
            mask = mask.unsqueeze(1)  # (batch, 1 head, width, end): broadcast over heads
        return CacheStep(self, start, end, positions, mask)


@dataclass
class CacheStep:
    """One forward's share of the cache: slots [start, end), each row's positions (batch, width) and
    the mask (None: no padding anywhere, so plain causal attention, as training computes it)."""

    cache: KVCache
    start: int
    end: int
    positions: torch.Tensor
    mask: torch.Tensor | None

    def layer(self, i: int) -> LayerStep:
        return LayerStep(self, i)


@dataclass
class LayerStep:
    step: CacheStep
    index: int

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's (batch, kv_heads, width, head_dim) keys and values into their slots;
        return the keys and values of every slot so far. The buffers are allocated at the first
        write, in the dtype the layer computes in (autocast's, when it runs under one)."""
        cache, s = self.step.cache, self.step
        if cache.keys[self.index] is None:
            shape = (cache.batch, k.shape[1], cache.max_len, k.shape[3])
            cache.keys[self.index] = torch.empty(shape, dtype=k.dtype, device=k.device)
            cache.values[self.index] = torch.empty(shape, dtype=v.dtype, device=v.device)
        keys, values = cache.keys[self.index], cache.values[self.index]
        keys[:, :, s.start: s.end] = k
        values[:, :, s.start: s.end] = v
        return keys[:, :, : s.end], values[:, :, : s.end]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa) -> torch.Tensor:
        """Attention of this forward's queries over every slot so far (trainer/model/layers.py KeyValues)."""
        keys, values = self.store(k, v)
        return sdpa(q, keys, values, self.mask, self.causal)

    @property
    def causal(self) -> bool:
        """Plain causal attention suffices: no padding, and the queries are the only slots so far."""
        return self.step.mask is None and self.step.start == 0

    @property
    def mask(self) -> torch.Tensor | None:
        return self.step.mask
