"""The message rank 0 sends each worker once per step, and the two ends that keep it small.

A worker needs, per scheduled sequence, where its tokens go (block table, first position, token
count), the token ids to compute, and whether its last row is sampled. Token ids are sent once:
prompt chunks as they are prefilled, then one sampled token per decode step. Block tables are
sent as deltas: a sequence that ran in the previous step and only gained blocks sends the new
ones; any other (new, resumed, swapped back, renumbered by a dtype switch) sends its whole
table. Both ends keep the tables of the previous step's sequences only, so nothing grows with
the number of requests served. A pipeline step sent as several micro-batches is one step: its
later messages say they continue it, and the tables known stay those of the step before.

Before the step's tensors, the message carries the KV copies (swap out/in) rank 0 made since the
previous message, in order: replaying them in order on a worker gives the same pools, because
nothing reads or writes the KV between them but these copies.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

KVOp = tuple[
    str, list[int], list[int]
]  # ("swap_out", device ids, host ids) | ("swap_in", host, device)


@dataclass(slots=True)
class StepMessage:
    handles: list[int]  # one per scheduled sequence
    starts: list[int]  # first position computed this step
    num_tokens: list[int]
    sampled: list[int]  # of each sequence's last rows, how many get logits (`logit_rows`)
    tables: list[tuple[bool, list[int]]]  # (append?, block ids): a delta or the whole table
    token_ids: list[int]
    every_row: bool = False  # scoring: logits of every row
    kv_ops: list[KVOp] = field(default_factory=list)
    continues: bool = False  # another micro-batch of the previous message's step
    as_decode: list[bool] | None = None  # sequences with drafts: one decode row a position
    # each sequence's rows' kind (`decode_rows`: a RowKind, an int)
    decodes: list[int] | None = None


class StepEncoder:
    """Rank 0's end: what each worker already knows of each table."""

    def __init__(self) -> None:
        self._known: dict[int, list[int]] = {}
        self._before: dict[int, list[int]] = {}  # the tables known before this step

    def encode(
        self,
        handles: list[int],
        tables: list[list[int]],
        starts: list[int],
        num_tokens: list[int],
        sampled: list[int],
        token_ids: list[int],
        every_row: bool,
        kv_ops: list[KVOp],
        continues: bool = False,
        as_decode: list[bool] | None = None,
        decodes: list[int] | None = None,
    ) -> bytes:
        if not continues:
            self._before, self._known = self._known, {}
        known = self._before
        deltas = []
        for h, table in zip(handles, tables, strict=True):
            old = known.get(h)
            if old is not None and len(old) <= len(table) and table[: len(old)] == old:
                deltas.append((True, table[len(old) :]))
            else:
                deltas.append((False, list(table)))
            self._known[h] = list(table)
        msg = StepMessage(
            handles, starts, num_tokens, sampled, deltas, token_ids, every_row, kv_ops, continues,
            as_decode, decodes,
        )  # fmt: skip
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


class StepDecoder:
    """A worker's end: rebuilds the full block tables from the deltas."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}
        self._before: dict[int, list[int]] = {}

    def tables(self, msg: StepMessage) -> list[list[int]]:
        if not msg.continues:
            self._before, self._tables = self._tables, {}
        known = self._before
        out = []
        for h, (append, blocks) in zip(msg.handles, msg.tables, strict=True):
            table = known[h] + blocks if append else blocks
            self._tables[h] = table
            out.append(table)
        return out
