"""Inputs of a CUDA-graph step: a compact record per row on the host, expanded on the device.

A graph step's shapes are fixed by its ``GraphLayout`` (rows padded to a captured size, ``q`` tokens per row,
block tables ``table_width`` wide). For it the host writes only what it alone knows, per row: the first
position, the token count, the number of drafts among those tokens, the tokens themselves (padded to ``q``),
the block-table row (padded with the pad block), and per-row parameters (sampling, acceptance). All of it
goes into the pinned staging buffer with one assignment for the lists, a fill and one slice per row for the
tables (and one more assignment with float fields), and reaches the device with one copy. Everything else
a step reads — positions, cache slots, the query layout, each row's last token, and for speculation the
verified positions, the drafts and the draft loop's token table — is computed from the record at the
start of the captured step, by one kernel (``specserve.kernels.step_inputs``).

On the GPU machine the host is slow (numpy calls and CUDA copies cost several microseconds each): building
every array on the host took 160 µs per plain step and 340 µs per speculative one (13% and 20% of the
step); the record takes a few calls. Packed (eager) steps keep building their arrays on the host
(``runner/packed.py``); tests check that both give the same tokens.

Dummy rows (padding up to the captured batch size) are rows of one token at position 0 that read and write
only the pad block; tokens past a row's count are padding at position = their column, writing the pad block.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from specserve.cache.kv_cache import PAD_BLOCK
from specserve.config import cdiv


@dataclass
class Record:
    """A staged record: where each field sits in the int64 staging buffer (floats in float64 slots)."""

    rows: int  # B (padded)
    q: int  # tokens per row
    table_width: int  # M
    fields: dict[str, tuple[int, int]]  # name -> (offset, length) among the int64 slots
    float_fields: dict[str, tuple[int, int]]  # name -> (offset, length) among the float64 slots
    size: int  # slots used
    requests: list  # the scheduled requests (their sampling parameters)


def row_fields(sched, rows: int, q: int, block_size: int, lookahead: int) -> tuple[dict[str, list[int]], list]:
    """The layout fields as Python lists — start, count, num_drafts [B]; tokens [B * q] (zeros for a row that
    continues the step in flight, which the device corrects) — and each scheduled row's block ids (as many as its step reaches; ``stage_record`` pads the table rows)."""
    start, count, nd, tokens, tables = [], [], [], [], []
    for s in sched:
        req = s.request
        if s.after is not None:  # continues the step in flight: its tokens come from that step, on the device
            tokens += [0] * q
        else:
            known = s.num_tokens - s.num_drafts
            tokens += req.token_ids[s.start:s.start + known]
            if s.num_drafts:
                tokens += req.spec_token_ids[:s.num_drafts]
            tokens += [0] * (q - s.num_tokens)
        tables.append(req.block_ids[:min(len(req.block_ids), cdiv(s.start + s.num_tokens + lookahead, block_size))])
        start.append(s.start)
        count.append(s.num_tokens)
        nd.append(s.num_drafts)
    pad = rows - len(sched)
    return dict(start=start + [0] * pad, count=count + [1] * pad, num_drafts=nd + [0] * pad,
                tokens=tokens + [0] * (pad * q)), tables


def stage_record(staging, sched, rows: int, q: int, width: int, ints: dict[str, list], tables: list[list[int]],
                 floats: dict[str, list[float]]) -> Record:
    """Write the fields into ``staging`` (one assignment for the integers, the block tables [B, M] filled with
    the pad block and each scheduled row's ids written over it, one assignment for the floats); the graph step
    copies it to the device itself (its upload is captured with it). The tables are ``M`` wide (the
    longest row's context rounded up to a power of two), B * M entries: as padded Python lists they cost more
    than the rest of the record at large batches."""
    n_list = sum(len(v) for v in ints.values())
    n_int = n_list + rows * width
    n_float = sum(len(v) for v in floats.values())
    buf = staging.reserve(n_int + n_float)
    buf[:n_list] = list(chain.from_iterable(ints.values()))
    tab = buf[n_list:n_int]
    tab.fill(PAD_BLOCK)
    for i, blocks in enumerate(tables):
        tab[i * width:i * width + len(blocks)] = blocks
    if n_float:
        buf[n_int:n_int + n_float].view(np.float64)[:] = list(chain.from_iterable(floats.values()))
    staging.upload_deferred()
    fields = _offsets(ints, 0)
    fields["tables"] = (n_list, rows * width)
    return Record(rows, q, width, fields, _offsets(floats, n_int), n_int + n_float, [s.request for s in sched])


def restage_record(staging, rec: Record, ints: dict[str, list[int]], tables: list[list[int]],
                   previous: "RestageState | None") -> "RestageState":
    """Rewrite the fields that change from step to step in a record staged by ``stage_record`` for the same
    rows, layout and parameters, the rest left where that wrote them (the caller checks that nothing else has
    written the buffer since: ``staging.version``): ``ints`` holds the fields to rewrite, each as long as before
    and always the same names in the same order; ``tables`` every row's block ids, of which the rows that differ
    from ``previous``' are rewritten. One fancy-index assignment for the fields instead of the whole record (the
    host's share of a graph step on the GPU machine, docs/BENCHMARKS.md) -> the state for the next step."""
    buf = staging.rewrite()
    if previous is None:
        index = np.concatenate([np.arange(o, o + n) for o, n in (rec.fields[k] for k in ints)])
        old: list[list[int]] = [[]] * len(tables)
    else:
        index, old = previous.index, previous.tables
    buf[index] = list(chain.from_iterable(ints.values()))
    o, w = rec.fields["tables"][0], rec.table_width
    for i, blocks in enumerate(tables):
        if blocks != old[i]:
            row = buf[o + i * w:o + (i + 1) * w]
            row[len(blocks):] = PAD_BLOCK
            row[:len(blocks)] = blocks
    staging.upload_deferred()
    return RestageState(index, tables)


@dataclass
class RestageState:
    """What ``restage_record`` keeps between steps: the slots it rewrites, and the block tables it wrote."""

    index: np.ndarray  # [F] int64 slots of the rewritten fields, in their order
    tables: list[list[int]]


def _offsets(fields: dict[str, list], at: int) -> dict[str, tuple[int, int]]:
    out = {}
    for name, v in fields.items():
        out[name] = (at, len(v))
        at += len(v)
    return out


def record_views(staging, rec: Record) -> dict[str, torch.Tensor]:
    """Device views of a record's fields: integers as int64, floats as float32 (one conversion)."""
    dev = staging.view(rec.size)
    out = {name: dev[o:o + n] for name, (o, n) in rec.fields.items()}
    if rec.float_fields:
        first = min(o for o, _ in rec.float_fields.values())
        flo = dev[first:rec.size].view(torch.float64).float()  # [F]
        out.update({name: flo[o - first:o - first + n] for name, (o, n) in rec.float_fields.items()})
    return out
