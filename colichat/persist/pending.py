"""What a sidecar commit promised the KV file and the file may not show yet: its two marks, how a load
reads through them, and how the writer finishes them.

    p = pending_of(doc, nrec)        # the marks of a sidecar (whose check holds) over a header's nrec
    p.spans(n)                       # [(first, last, at)]: where records [0, n) lie in the file
    p.holds(turn, nrec, whole)       # whether the file holds a turn's records
    p.finish(fd, n, record_bytes, rewrite)   # the file as the sidecar says it is (the writer's)

Two marks, at the sidecar's top level (covered by its check, so a damaged one is not believed):
  "staged": [P, C]  the turns from record C on are new, and their records lie at record P of the file
                    until they are written in place. A save that replaces turns (/regen, an answer
                    after a cut that waited) writes the new records past everything the old and the
                    new conversation use (P = max(nrec, their end)), then the sidecar that lists the
                    kept turns and the new ones with this mark: that rename is the one commit (a
                    crash before it leaves the old exchange, after it the new one, never neither).
                    Then the records are written in place, nrec, the sidecar without the mark, and
                    the file is cut to its records.
  "cut": R          the sidecar cut the conversation from R records to its turns' end (a rewind,
                    /reset; after staged records were put in place, R is where they ended). While
                    the header's nrec is still R (a crash came before nrec), the records past the
                    turns are the cut's: a load drops them without a warning (an interrupted cut
                    looks like a finished one); while nrec is the turns' end and the file is longer
                    (a crash came before the file's cut), the writer cuts it.
A load reads through both; the writer finishes them when it opens the conversation (Session.load),
and before any other write, so that no removed token id lingers in the file.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from .kvfile import HEADER_SIZE, INT32_MAX, cut_to, write_nrec
from .sidecar import doc_check

COPY_RECORDS = 8 << 20  # bytes: the staged records are moved in place this many at a time


@dataclass(frozen=True)
class Pending:
    staged_at: int | None = None  # P: where the records from `staged_from` on lie until moved
    staged_from: int = 0  # C
    cut_from: int | None = None  # R, when the header's nrec is still the one the cut came from

    def spans(self, n: int) -> list[tuple[int, int, int]]:
        """(first, last, at): the records [first, last) of the conversation's first n lie at record
        `at` of the file."""
        if self.staged_at is None or n <= self.staged_from:
            return [(0, n, 0)]
        return [(0, self.staged_from, 0), (self.staged_from, n, self.staged_at)]

    def holds(self, t, nrec: int, whole: int) -> bool:
        """Whether the file (nrec in its header, `whole` records in its size) holds turn t's records."""
        if self.staged_at is None or t.last <= self.staged_from:
            return t.last <= min(nrec, whole)
        return self.staged_from <= min(nrec, whole) and self.staged_at + t.last - self.staged_from <= whole

    def finish(self, fd: int, n: int, record_bytes: int, rewrite) -> None:
        """Make the file what the sidecar says (its turns end at record n): the staged records moved
        in place (then `rewrite(cut)` writes the sidecar without the mark, with a "cut" from the file's
        end), nrec n, the file cut to them. OSError as any write's; each step can be done again."""
        if self.staged_at is not None and n > self.staged_from:
            move_records(fd, self.staged_at, self.staged_from, n - self.staged_from, record_bytes)
        write_nrec(fd, n)
        if self.staged_at is not None:
            rewrite(self.staged_at + max(0, n - self.staged_from))
        cut_to(fd, n, record_bytes)


def pending_of(doc: dict | None, nrec: int, end: int | None = None, whole: int = 0) -> Pending | None:
    """The marks of a sidecar whose top-level check holds that the file (`nrec` in its header) does not
    show yet; None when there is none to finish. With the turns' `end` and the `whole` records the file
    holds: also a cut whose nrec was written and not the file's size (its records past nrec)."""
    if not isinstance(doc, dict) or doc.get("check") != doc_check(doc):
        return None
    staged, cut = doc.get("staged"), doc.get("cut")
    if isinstance(staged, list) and len(staged) == 2 and all(type(v) is int and 0 <= v <= INT32_MAX for v in staged):
        return Pending(staged[0], staged[1], cut if cut == nrec else None)
    if type(cut) is int and (cut == nrec or end is not None and nrec == end < whole):
        return Pending(cut_from=cut)
    return None


def move_records(fd: int, at: int, to: int, count: int, record_bytes: int) -> None:
    """Copy `count` records from record `at` to record `to` of the same file (the two do not overlap:
    `at` is past `to + count`), then fsync."""
    done, size = 0, count * record_bytes
    while done < size:
        data = os.pread(fd, min(size - done, COPY_RECORDS), HEADER_SIZE + at * record_bytes + done)
        if not data:
            raise OSError(errno.EIO, "the KV file ended before its staged records")
        view = memoryview(data)
        while view:
            wrote = os.pwrite(fd, view, HEADER_SIZE + to * record_bytes + done)
            view, done = view[wrote:], done + wrote
    os.fsync(fd)
