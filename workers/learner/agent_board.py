"""The sync agent's board: what the agent tells the learner, in shared memory, no frames.

A frame from the agent wakes the learner's reader thread, which then takes the GIL from the
training thread in the middle of a step: measured at ~0.1-0.16 ms of training time per frame,
and a round used to send three (the round opened, the round closed, the version arrived;
docs/scale.md). So the steady-state news goes on this board instead, and the training thread
reads it itself at the start of each step - one shared word when nothing changed:

* **opened rounds**, one record per fragment (``present``, epoch, round), written by the agent;
* **arrivals**, one record per fragment (the generation ``gen``, the version slot, the Arrival's
  fields), written by the agent; generation ``g`` of fragment ``p`` lies in version slot
  ``2p + g % 2`` (after the delta slots), and ``consumed`` (one record per fragment, written by
  the learner) is the newest generation it has copied out. The agent writes generation ``g``
  only once ``consumed >= g - 2``: the slot's previous generation has been copied out, so no side
  ever reads a slot the other is writing. The newest version wins: a learner that missed ``g - 1``
  reads ``g``;
* **delta slots handed back**: ``done`` (one record per delta slot, written by the agent) counts
  the deltas it copied out of that slot; the learner counts its hand-overs, and a slot whose two
  counts are equal is the learner's again;
* ``generation`` (in the header): bumped by the agent after every opened or arrival record, so a
  step with no news reads one word;
* **settled deltas** (board version 2, issue 25): a ring of ``SETTLED_RING`` records, written by
  the agent as soon as its Sender made a delta durable or dropped it with a logged reason (the
  delta's seq + 1; 0: never written). The learner reads it only from a *dead* agent's board, to
  tell the deltas that died with it from those it settled but had not reported yet (its ``stats``
  frames lag by up to a second): a frame per settled delta would wake the learner mid-step.

**Format** (version ``BOARD_VERSION``, all little-endian 8-byte words, in one ``memfd``):
header ``[magic, version, fragments, delta_slots, generation (a record)]``, then the records.
A record is ``[seq, fields..., crc]``, written by one side only, seqlock style: ``seq`` odd while
it is written, the fields, ``crc`` = crc32 of ``seq`` and the fields' bytes, then ``seq`` even. A
reader copies the record and takes it when ``seq`` is even, unchanged after the copy, and the crc
matches. A copy made while the writer was busy is read again - after ``SPINS`` reads the reader
waits, yielding, for as long as the writer lives (up to ``WRITER_STALL_S``): a writer that lost
the GIL or the CPU mid-write holds a record odd for milliseconds. A record whose ``seq`` is even and
stable but whose crc fails ``RETRIES`` times is refused as damaged (``FormatError``): never guessed at.
Documented in docs/scale.md ("The learner's sync agent").
"""
from __future__ import annotations

import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.errors import FormatError
from workers.learner.agent_wire import unmap

BOARD_VERSION = 2   # 2: the settled ring after the done records
SETTLED_RING = 1024   # settled deltas a dead agent's board still names (more than its reports can lag behind)
MAGIC = 0x4452_4442_4F41_5244   # "DDLBOARD"-ish, a fixed 8-byte tag
RETRIES = 100          # reads of a record whose seq is stable but whose crc fails: then it is damaged
SPINS = 1_000          # reads of a record mid-write before the reader waits, yielding, for its writer
WAIT_S = 0.0002        # the wait between those reads
WRITER_STALL_S = 10.0  # a record mid-write this long: its writer died or hangs (FormatError)
FOUND_BY = ("announce", "poll")   # Arrival.found_by, by code

_HEADER = 4                       # magic, version, fragments, delta_slots; then the generation record
_COUNTER = struct.Struct("<qq")                    # seq, value
_OPENED = struct.Struct("<qqqq")                   # seq, present, epoch, round
_ARRIVAL = struct.Struct("<qqqqqqqdq")             # seq, gen, slot, version, log seq, epoch, round, committed_at, found_by


@dataclass(frozen=True)
class BoardArrival:
    """One arrival record: generation ``gen`` of the fragment's version, in version slot ``slot``."""
    gen: int
    slot: int
    version: int
    seq: int
    epoch: int
    round: int
    committed_at: float
    found_by: str


def _words(s: struct.Struct) -> int:
    return s.size // 8 + 1          # the fields, then the crc word


class Board:
    """The board (module docstring) mapped from ``fd``; ``fd=None`` creates the memfd (the learner)."""

    def __init__(self, fragments: int, delta_slots: int, fd: int | None = None):
        if fragments < 1 or delta_slots < 1:
            raise ValueError(f"board: fragments and delta_slots must be >= 1, got {fragments}, {delta_slots}")
        self.fragments, self.delta_slots = fragments, delta_slots
        self._gen_at = _HEADER
        self._opened_at = self._gen_at + _words(_COUNTER)
        self._arrival_at = self._opened_at + fragments * _words(_OPENED)
        self._consumed_at = self._arrival_at + fragments * _words(_ARRIVAL)
        self._done_at = self._consumed_at + fragments * _words(_COUNTER)
        self._settled_at = self._done_at + delta_slots * _words(_COUNTER)
        self._settled_n = 0                 # the agent's: settled deltas written (the ring's next record)
        size = 8 * (self._settled_at + SETTLED_RING * _words(_COUNTER))
        created = fd is None
        if created:
            fd = os.memfd_create("ddiloco-agent-board", 0)   # Linux, as the slots
            os.ftruncate(fd, size)
        have = os.fstat(fd).st_size
        if have != size:     # the header says why (another version, another shape) when it can be read
            head = np.frombuffer(os.pread(fd, 8 * _HEADER, 0), dtype=np.int64) if have >= 8 * _HEADER else []
            raise FormatError(f"sync agent board: {have} bytes with header {[int(w) for w in head]}, expected "
                              f"{size} for version {BOARD_VERSION}, {fragments} fragments, {delta_slots} delta slots")
        self.fd = fd
        self.map = mmap.mmap(fd, size)
        self.words = np.frombuffer(self.map, dtype=np.int64)
        self._seqs = memoryview(self.map).cast("q")    # single words, read without numpy's scalar boxing
        # Whether the other side (the records' writer) still lives: a reader then stops waiting
        # for a record torn by its writer's death at once, not after WRITER_STALL_S.
        self.writer_alive: Callable[[], bool] | None = None
        if created:
            self.words[:_HEADER] = (MAGIC, BOARD_VERSION, fragments, delta_slots)
        elif tuple(int(w) for w in self.words[:_HEADER]) != (MAGIC, BOARD_VERSION, fragments, delta_slots):
            raise FormatError(f"sync agent board: header {[int(w) for w in self.words[:_HEADER]]}, expected "
                              f"version {BOARD_VERSION} for {fragments} fragments and {delta_slots} delta slots")

    # -- records ---------------------------------------------------------------------------------
    def _write(self, at: int, s: struct.Struct, *fields) -> None:
        seq = int(self.words[at]) + 1
        body = s.pack(seq + 1, *fields)                    # the crc covers the final (even) seq
        self.words[at] = seq                               # odd: being written
        self.map[8 * at + 8: 8 * at + s.size] = body[8:]
        self.words[at + s.size // 8] = zlib.crc32(body)
        self.words[at] = seq + 1                           # even: done

    def _read(self, at: int, s: struct.Struct) -> tuple:
        n = s.size + 8
        torn = 0                 # copies whose seq was even and stable but whose crc failed
        spins, deadline = 0, None
        while True:
            seq = self._seqs[at]
            raw = self.map[8 * at: 8 * at + n]
            if not seq & 1 and self._seqs[at] == seq:
                if seq == 0 and not any(raw):
                    return s.unpack(raw[:s.size])[1:]      # never written: zeros
                body, crc = raw[:s.size], int.from_bytes(raw[s.size:], "little", signed=True)
                fields = s.unpack(body)
                if fields[0] == seq and zlib.crc32(body) == crc:
                    return fields[1:]
                torn += 1            # a CPU that reorders stores, or damage: read again, a bounded number of times
                if torn >= RETRIES:
                    raise FormatError(f"sync agent board: the record at word {at} fails its checksum {RETRIES} "
                                      "times: damaged")
                continue
            # The writer is mid-write. It may hold that state for many milliseconds: its thread lost
            # the GIL to another of its threads (5 ms a switch), or its process was descheduled on a
            # busy machine. Spinning a fixed count judged such a record damaged and the learner
            # died of it (a CI run, issue 25); so spin a little, then wait, yielding, until the writer
            # finishes - or is known dead, or WRITER_STALL_S passes.
            spins += 1
            if spins < SPINS:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + WRITER_STALL_S
            elif now > deadline or (self.writer_alive is not None and not self.writer_alive()):
                raise FormatError(f"sync agent board: the record at word {at} stays mid-write (seq {seq}): its "
                                  "writer died or stalled while writing it")
            time.sleep(WAIT_S)

    # -- the header's generation -----------------------------------------------------------------
    def generation(self) -> int:
        return self._read(self._gen_at, _COUNTER)[0]

    def generation_seq(self) -> int:
        """The generation record's ``seq`` word alone: it moves with every bump, so a reader that
        saw the same value before has no news (one word read, ~0.1 us; the record, checked, ~4)."""
        return self._seqs[self._gen_at]

    def bump(self) -> None:
        """The agent, after writing opened or arrival records."""
        self._write(self._gen_at, _COUNTER, self.generation() + 1)

    # -- opened rounds (agent writes) ------------------------------------------------------------
    def write_opened(self, opened: dict[int, tuple[int, int]], before: dict[int, tuple[int, int]] | None = None
                     ) -> None:
        """The open rounds; ``before``: what the board holds now, so that only the fragments whose
        round changed are written (a reader re-reads only records whose seq word moved)."""
        for p in range(self.fragments):
            if before is not None and before.get(p) == opened.get(p):
                continue
            e, r = opened.get(p, (-1, -1))
            self._write(self._opened_at + p * _words(_OPENED), _OPENED, int(p in opened), e, r)
        self.bump()

    def opened(self) -> dict[int, tuple[int, int]]:
        out = {}
        for p in range(self.fragments):
            round_ = self.opened_round(p)
            if round_ is not None:
                out[p] = round_
        return out

    def opened_seq(self, p: int) -> int:
        """Fragment ``p``'s opened record's ``seq`` word (unchanged since a read: the same round)."""
        return self._seqs[self._opened_at + p * _words(_OPENED)]

    def opened_round(self, p: int) -> tuple[int, int] | None:
        """The (epoch, round) open for fragment ``p``, or None."""
        present, e, r = self._read(self._opened_at + p * _words(_OPENED), _OPENED)
        return (e, r) if present else None

    # -- arrivals (agent writes; the learner writes consumed) ------------------------------------
    def version_slot(self, p: int, gen: int) -> int:
        """The slot (counting the delta slots first) holding generation ``gen`` of fragment ``p``."""
        return self.delta_slots + 2 * p + gen % 2

    def write_arrival(self, p: int, a: BoardArrival) -> None:
        self._write(self._arrival_at + p * _words(_ARRIVAL), _ARRIVAL, a.gen, a.slot, a.version, a.seq, a.epoch,
                    a.round, a.committed_at, FOUND_BY.index(a.found_by))
        self.bump()

    def arrival_seq(self, p: int) -> int:
        """Fragment ``p``'s arrival record's ``seq`` word: unchanged since a read, no new arrival."""
        return self._seqs[self._arrival_at + p * _words(_ARRIVAL)]

    def arrival(self, p: int) -> BoardArrival | None:
        gen, slot, version, seq, epoch, rnd, at, found = self._read(self._arrival_at + p * _words(_ARRIVAL), _ARRIVAL)
        if gen == 0:
            return None
        if slot != self.version_slot(p, gen) or not 0 <= found < len(FOUND_BY):
            raise FormatError(f"sync agent board: arrival of fragment {p} names slot {slot} / found_by {found}")
        return BoardArrival(gen, slot, version, seq, epoch, rnd, at, FOUND_BY[found])

    def consumed(self, p: int) -> int:
        return self._read(self._consumed_at + p * _words(_COUNTER), _COUNTER)[0]

    def set_consumed(self, p: int, gen: int) -> None:
        self._write(self._consumed_at + p * _words(_COUNTER), _COUNTER, gen)

    # -- delta slots handed back (agent writes) --------------------------------------------------
    def done(self, slot: int) -> int:
        return self._read(self._done_at + slot * _words(_COUNTER), _COUNTER)[0]

    def set_done(self, slot: int, count: int) -> None:
        self._write(self._done_at + slot * _words(_COUNTER), _COUNTER, count)

    # -- settled deltas (agent writes; the learner reads a dead agent's) --------------------------
    def add_settled(self, delta_seq: int) -> None:
        """The agent: its Sender settled the learner's delta ``delta_seq`` (durable, or dropped with
        a logged reason). The oldest of the ring is overwritten."""
        at = self._settled_at + (self._settled_n % SETTLED_RING) * _words(_COUNTER)
        self._write(at, _COUNTER, delta_seq + 1)
        self._settled_n += 1

    def settled(self) -> set[int]:
        """The seqs of the last ``SETTLED_RING`` deltas settled; a record torn by the writer's death
        is skipped (its delta then counts as not settled: the safe side)."""
        out = set()
        for i in range(SETTLED_RING):
            try:
                (v,) = self._read(self._settled_at + i * _words(_COUNTER), _COUNTER)
            except FormatError:
                continue
            if v > 0:
                out.add(v - 1)
        return out

    def close(self, close_fd: bool = True) -> None:
        self.words = None
        self._seqs.release()
        unmap(self.map, self.fd if close_fd else None)
