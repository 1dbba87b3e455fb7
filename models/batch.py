"""The running batch's KV cache: merging a new sequence in, dropping finished ones.

A sequence is prefilled alone into its own :class:`DynamicCache`, then merged
into the batch by left-padding both to a common width; a finished sequence is
removed with an index-select, and columns that became padding for every
remaining row are trimmed from the left. Only plain per-layer caches
(:class:`DynamicLayer`) can be merged this way; :func:`check_mergeable` says
whether a model's cache is one.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

Row = TypeVar("Row")


def check_mergeable(config: PretrainedConfig) -> bool:
    """Whether the model of ``config`` uses a plain per-layer KV cache."""
    cache = DynamicCache(config=config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


class Batch(Generic[Row]):
    """Rows of running sequences, their shared KV cache and attention mask.

    Row ``i`` of every cache tensor (``[rows, kv_heads, columns, head_dim]``)
    and of ``mask`` (``[rows, columns]``, 1 = real token, 0 = padding) belongs
    to ``seqs[i]``. Sequences of different lengths are left-padded to a common
    width; callers pass explicit position ids, so padding shifts nothing.
    """

    def __init__(self) -> None:
        self.seqs: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [rows, columns], 1 = real token

    def __len__(self) -> int:
        return len(self.seqs)

    def clear(self) -> None:
        self.seqs, self.cache, self.mask = [], None, None

    def layers(self) -> list[DynamicLayer]:
        assert self.cache is not None
        return _layers(self.cache)

    def add(self, seq: Row, cache: DynamicCache, length: int) -> None:
        """Merge a prefilled sequence (its cache is ``length`` long) as the last row.

        All or nothing: if an allocation fails half-way (a CUDA out-of-memory
        error), the layers merged so far are cut back to what they were and the
        error propagates with the batch unchanged. Each layer's old tensors are
        released as soon as it is merged, so the merge never holds two copies
        of the whole cache.
        """
        new_mask = torch.ones(1, length, dtype=torch.long, device=cache_device(cache))
        if self.cache is None or self.mask is None:
            self.seqs, self.cache, self.mask = [seq], cache, new_mask
            return
        rows, old_width = len(self.seqs), self.mask.shape[1]
        width = max(old_width, length)
        merged: list[DynamicLayer] = []
        try:
            for mine, theirs in zip(self.layers(), _layers(cache), strict=True):
                (k1, v1), (k2, v2) = _kv(mine), _kv(theirs)
                keys = torch.cat([_pad_left(k1, width), _pad_left(k2, width)])
                values = torch.cat([_pad_left(v1, width), _pad_left(v2, width)])
                mine.keys, mine.values = keys, values
                merged.append(mine)
            mask = torch.cat(
                [F.pad(self.mask, (width - old_width, 0)), F.pad(new_mask, (width - length, 0))]
            )
        except BaseException:
            shift = width - old_width  # the padding this merge put on the left
            for layer in merged:
                keys, values = _kv(layer)
                layer.keys, layer.values = keys[:rows, :, shift:], values[:rows, :, shift:]
            raise
        self.mask = mask
        self.seqs.append(seq)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and trim all-padding columns on the left."""
        if not rows:
            self.clear()
            return
        if len(rows) == len(self.seqs) and rows == list(range(len(rows))):
            return
        assert self.mask is not None
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(0).long().argmax())
        for layer in self.layers():
            keys, values = _kv(layer)
            layer.keys = keys.index_select(0, index)[:, :, first:]
            layer.values = values.index_select(0, index)[:, :, first:]
        self.mask = mask[:, first:]
        self.seqs = [self.seqs[i] for i in rows]

    def crop(self, width: int) -> None:
        """Cut every layer back to ``width`` columns (undo a half-done forward)."""
        for layer in self.layers():
            keys, values = _kv(layer)
            layer.keys = keys[:, :, :width]
            layer.values = values[:, :, :width]
        if self.mask is not None:
            self.mask = self.mask[:, :width]


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = list(cache.layers)
    assert all(isinstance(layer, DynamicLayer) for layer in layers)
    return layers  # type: ignore[return-value]


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[2]
    return F.pad(t, (0, 0, missing, 0)) if missing else t


def cache_device(cache: DynamicCache) -> torch.device:
    return _kv(_layers(cache)[0])[0].device
