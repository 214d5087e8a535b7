"""A Hugging Face folder read by slice: each rank reads only the elements of the tensors it keeps.

    with hf_slices(url, cfg) as weights:                 # config checked, files opened lazily
        rank = build_model(cfg, state, seed, device, weights=weights.fill)

`fill(name, shape, offsets, box)` writes a box of one canonical tensor (engine.materialize asks for
a tensor-parallel shard's boxes, an expert shard's experts) from safetensors' lazy slices: the
folder's tensors are never read whole, and nothing of another pipeline stage or expert is read.

Every import rule (interop.hf_mapping) builds a canonical tensor from its Hub tensors by moving
whole rows (the leading dimensions, flattened) and possibly transposing (GPT-2's Conv1D): regrouping
q/k/v per query group, stacking [gate; up], stacking experts, padding the vocabulary with zero
rows, cutting positions. Rather than restate each rule as slice arithmetic, the rule itself is run
once on small probes: tensors of one column whose values encode (which Hub tensor, which row). Its
output says, for every canonical row, where that row comes from (or that it is padding), so a box
reads the runs of consecutive Hub rows it covers, columns sliced, and the rules stay the one truth.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.interop.hf import HFReader, hf_reader, resolve_rules
from megatrain.engine.interop.hf_mapping import Rule
from megatrain.engine.materialize import MissingTensor
from megatrain.engine.models.init import box_row_runs

_ROW_BITS = 32


@dataclass
class RowMap:
    """Where each row of a canonical tensor (leading dimensions flattened) comes from."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    transposed: bool
    """The Hub tensors are (columns, rows) of ours: GPT-2's Conv1D."""
    codes: torch.Tensor
    """int64 per canonical row: (index into names + 1) << 32 | the Hub tensor's row; 0 is padding."""


def row_map(rule: Rule, shapes: dict[str, tuple[int, ...]], target: tuple[int, ...]) -> RowMap:
    """Run `rule.from_hf` on probes of the Hub tensors' rows (else their columns: transposed) and
    read off the source of each of the canonical tensor's rows. target: the canonical shape."""
    rows = math.prod(target[:-1]) if len(target) > 1 else target[0]
    hub = [shapes[n] for n in rule.hf]
    for transposed in (False, True):
        probes = [_probe(j, shape, transposed) for j, shape in enumerate(hub)]
        if any(p is None for p in probes):
            continue
        try:
            out = rule.from_hf(*probes)
        except (RuntimeError, TypeError, ValueError):
            continue
        # Rows found for every canonical row, and the Hub's columns are ours, one for one.
        cols = [s[0] if transposed else s[-1] for s in hub if len(s) > 1]
        if out.numel() == rows and (out.dim() == 1 or out.shape[-1] == 1) and set(cols) <= {target[-1]}:
            return RowMap(list(rule.hf), hub, transposed, out.reshape(-1).to(torch.int64))
    raise ValueError(f"{rule.name}: its Hugging Face tensors {list(rule.hf)} do not map row by row")


def _probe(index: int, shape: tuple[int, ...], transposed: bool) -> torch.Tensor | None:
    """Codes of (index, row) along the rows of `shape` (its columns when transposed), one column."""
    if transposed and len(shape) != 2:
        return None
    n = shape[1] if transposed else math.prod(shape[:-1]) if len(shape) > 1 else shape[0]
    codes = (torch.arange(n, dtype=torch.int64) + ((index + 1) << _ROW_BITS)).double()  # exact below 2^53
    if len(shape) == 1:
        return codes
    return codes.view(1, n) if transposed else codes.view(*shape[:-1], 1)


class HFSlices:
    """Boxes of canonical tensors read from an open Hugging Face folder (see the module's doc)."""

    def __init__(self, reader: HFReader, rules: dict[str, Rule], cfg: TransformerConfig):
        self.reader, self.rules, self.cfg = reader, rules, cfg
        self._maps: dict[str, RowMap] = {}
        self.bytes_read = 0
        """Bytes of Hub tensors read so far (each element once per box that asked for it)."""

    def row_map(self, name: str, shape: tuple[int, ...]) -> RowMap:
        if name not in self._maps:
            rule = self.rules[name]
            shapes = {n: tuple(self.reader.slice(n).get_shape()) for n in rule.hf}
            self._maps[name] = row_map(rule, shapes, shape)
        return self._maps[name]

    @torch.no_grad()
    def fill(self, name: str, shape: tuple[int, ...], offsets: tuple[int, ...], out: torch.Tensor) -> None:
        """engine.materialize's WeightSource: the box of canonical `name` at `offsets`."""
        if name not in self.rules:  # a head the folder lacks (a new classifier): build_model's fallback
            raise MissingTensor(f"no Hugging Face tensor maps onto {name}")
        rmap = self.row_map(name, shape)
        for dest, first, col in box_row_runs(shape, offsets, out):
            self._fill_rows(rmap, dest, first, col)

    def _fill_rows(self, rmap: RowMap, dest: torch.Tensor, first: int, col: int) -> None:
        """dest (m, w) = canonical rows [first, first+m), columns [col, col+w)."""
        m, w = dest.shape
        codes = rmap.codes[first : first + m]
        for lo, hi in _runs(codes, rmap):
            code = int(codes[lo])
            if code == 0:
                dest[lo:hi].zero_()
                continue
            j, row = (code >> _ROW_BITS) - 1, code & ((1 << _ROW_BITS) - 1)
            part = self._read(rmap.names[j], rmap.shapes[j], rmap.transposed, row, row + hi - lo, col, w)
            dest[lo:hi].copy_(part)
            self.bytes_read += part.numel() * part.element_size()

    def _read(
        self, name: str, shape: tuple[int, ...], transposed: bool, r0: int, r1: int, col: int, w: int
    ) -> torch.Tensor:
        """Rows [r0, r1) (leading dimensions flattened), columns [col, col+w) of a Hub tensor, as
        (r1-r0, w): only those elements are read."""
        sl = self.reader.slice(name)
        if len(shape) == 1:
            return sl[r0:r1].view(-1, 1)
        if transposed:
            return sl[col : col + w, r0:r1].t()
        inner = shape[-2]
        lead = list(_unravel(r0 // inner, shape[:-2]))  # a run never crosses a leading index
        rows = slice(r0 % inner, r0 % inner + r1 - r0)
        index = (*(slice(i, i + 1) for i in lead), rows, slice(col, col + w))
        return sl[index].reshape(r1 - r0, w)


def _runs(codes: torch.Tensor, rmap: RowMap) -> list[tuple[int, int]]:
    """[lo, hi) spans of codes that are one read: padding, or consecutive rows of one Hub tensor
    under one leading index."""
    if codes.numel() == 0:
        return []
    inner = torch.tensor([s[-2] if len(s) > 2 else 1 << 62 for s in rmap.shapes] + [1 << 62])
    j = (codes >> _ROW_BITS) - 1  # -1 for padding
    row = codes & ((1 << _ROW_BITS) - 1)
    lead = torch.where(j >= 0, row // inner[j], -1)
    step = torch.ones_like(codes, dtype=torch.bool)
    step[1:] = (j[1:] != j[:-1]) | (lead[1:] != lead[:-1]) | ((j[1:] >= 0) & (row[1:] != row[:-1] + 1))
    starts = torch.nonzero(step).flatten().tolist() + [codes.numel()]
    return list(zip(starts[:-1], starts[1:], strict=True))


def _unravel(index: int, dims: tuple[int, ...]) -> Iterator[int]:
    out = []
    for n in reversed(dims):
        out.append(index % n)
        index //= n
    return reversed(out)


@contextmanager
def hf_slices(url: str | Path, cfg: TransformerConfig) -> Iterator[HFSlices]:
    """An open Hugging Face folder for the model `cfg` describes (checked as load_hf_state checks
    it: every mismatched config field named, every unmapped or missing tensor)."""
    with hf_reader(url) as reader:
        yield HFSlices(reader, resolve_rules(url, cfg, reader), cfg)
