"""The commit ordering (store/ordering.py) driven directly with events, h11-style: no trio, no devices.

Each test feeds `CommitLog` namespace records, closes and drains, takes batches as the
committer would, and checks the prefix rule on what comes out: records leave in order,
a file appears at its first close together with its contents, superseded commits are
voided atomically with what voided them, and past max_lag nothing pending can be voided
or chained any more.
"""
import random
from collections import deque

from hypothesis import given, settings, strategies as st

from ckptfs.format.records import Extent, Make, Rename, Setattr, Unlink
from ckptfs.store.ordering import CommitLog

REG, DIR = 0o100644, 0o040755
ROOT = 1


class FakeChunk:
    def __init__(self, idx: int):
        self.idx = idx
        self.drained = False
        self.extent = None

    def drain(self):
        self.drained = True
        self.extent = Extent(0, self.idx, 4096, 0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def new_log(max_lag=2.0, names=None):
    names = names if names is not None else {}
    clock = Clock()
    log = CommitLog(max_lag=max_lag, alive=lambda ino: names.get(ino, True), clock=clock)
    return log, clock, names


def ops(batch):
    return [r.op for r in (p.record() for p in batch) if r is not None]


def commit(log, budget=1 << 20):
    batch = log.take_batch(budget)
    if batch:
        log.committed_batch(batch)
    log.check_invariants()
    return batch


def close(log, ino, nchunks=1, drained=False):
    chunks = {i: FakeChunk(i) for i in range(nchunks)}
    if drained:
        for c in chunks.values():
            c.drain()
    return chunks, log.close(ino, 100, 1, 1, chunks)


class Counting(deque):
    """A deque that counts how often it is iterated."""
    iterations = 0

    def __iter__(self):
        self.iterations += 1
        return super().__iter__()


def test_a_close_looks_at_its_own_files_records_not_every_pending_one():
    """The log keeps each file's pending commits: a close (or a state query) looks at that file's
    records only. A scan of every pending record made saving N small files cost O(N^2) under the
    loop lock while the drain was held back (16,000 closes: 8.4 s; now 0.03 s)."""
    log, clock, names = new_log()
    for ino in range(100, 2100):
        close(log, ino)
    log.pending = Counting(log.pending)
    close(log, 5000)
    assert [p.ino for p in log.content_of(5000)] == [5000] and log.pending.iterations == 0
    assert log.is_made_pending(5000) is False and len(log.content_pending()) == 2001
    old = log.content_of(150)[0]
    close(log, 150)  # supersedes 150's older commit: voided, grouped up to the new one
    assert old.void and [p.index for p in log.content_of(150)] == [log.last_index()]
    assert old.group_end == log.last_index() and log.pending.iterations == 0  # (the group: marked once)
    log.check_invariants()


def test_told_which_file_lost_its_last_name_a_delete_looks_at_that_file_only():
    """The store reports each file that loses its last name (`unnamed`, before the record of the
    unlink, rmdir or rename that did it): the delete voids that file's pending commit and asks
    about no other file (it used to ask about every one with a pending commit)."""
    asked, names = [], {}
    log = CommitLog(max_lag=2.0, alive=lambda ino: asked.append(ino) or names.get(ino, True))
    for ino in range(100, 1100):
        close(log, ino)
    names[150] = False
    log.unnamed(150)
    log.record(Unlink(1, b"f150", 0))
    assert asked == [150]
    assert log.content_of(150) == [] and len(log.content_pending()) == 999
    log.record(Unlink(1, b"other", 0))  # nothing reported: nothing voided, nobody asked
    assert asked == [150] and len(log.content_pending()) == 999
    log.check_invariants()


def test_a_file_appears_at_its_first_close_with_its_contents():
    log, _, _ = new_log()
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    assert not log.pending and 2 in log.deferred  # never closed: absent after a crash
    chunks, freed = close(log, 2)
    assert freed == [] and [p.rec.op if p.rec else "content" for p in log.pending] == ["make", "content"]
    assert log.take_batch(1 << 20) == []  # the make waits for the contents (one group)
    chunks[0].drain()
    assert ops(commit(log)) == ["make", "content"]
    assert log.committed == 1 and not log.pending


def test_created_and_deleted_before_any_close_leaves_no_trace():
    log, _, _ = new_log()
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    log.record(Unlink(ROOT, b"f", 2))
    assert not log.pending and not log.deferred


def test_records_that_need_a_deferred_file_journal_it_first():
    log, _, _ = new_log()
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    log.record(Setattr(2, 0o600, None, None, None, None, 3))
    assert [p.rec.op for p in log.pending] == ["make", "setattr"]
    assert ops(commit(log)) == ["make", "setattr"]


def test_a_newer_close_voids_the_older_atomically():
    log, _, names = new_log()
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    first, _ = close(log, 2)
    log.record(Make(ROOT, b"g", DIR, 0, 0, 0, b"", 3, 2))  # an unrelated record in between
    second, freed = close(log, 2)
    assert freed == list(first.values())  # the store unpins them: never drained for this commit
    assert log.records_voided == 1
    assert log.take_batch(1 << 20) == []  # make .. second content is one group: waits for it
    second[0].drain()
    assert ops(commit(log)) == ["make", "make", "content"]  # the first content never reaches the journal


def test_idle_until_the_record_a_take_stopped_at_is_ready_or_something_is_voided():
    log, _, _ = new_log()
    assert log.idle()  # nothing pending: the store's wake-ups skip the committer
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    chunks, _ = close(log, 2, nchunks=3)
    assert not log.idle()  # not looked at yet
    assert log.take_batch(1 << 20) == []
    assert log.idle()  # stalled on the close: a drain trip that leaves a chunk undrained changes nothing
    chunks[0].drain()
    chunks[1].drain()
    assert log.idle()
    chunks[2].drain()
    assert not log.idle()
    assert ops(commit(log)) == ["make", "content"]
    assert log.idle()
    newer, _ = close(log, 2)
    assert log.take_batch(1 << 20) == [] and log.idle()
    close(log, 2, drained=True)  # voids the newer one: the stall is over without its drain
    assert not log.idle()
    assert ops(commit(log)) == ["content"]


def test_a_batch_ends_before_a_group_still_open_however_long_the_ready_prefix():
    log, _, _ = new_log()
    log.record(Make(ROOT, b"d0", DIR, 0, 0, 0, b"", 10, 1))  # alone: may go
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    close(log, 2)
    for i in range(300):  # ready records inside the group the next close opens
        log.record(Make(ROOT, b"d%d" % (i + 1), DIR, 0, 0, 0, b"", 11 + i, 1))
    second, _ = close(log, 2)  # voids the first content: make f .. second content is one group
    assert ops(commit(log)) == ["make"]  # d0 only: the rest waits for the second content
    assert log.take_batch(1 << 20) == []
    second[0].drain()
    assert ops(commit(log)) == ["make"] * 301 + ["content"]  # make f, the 300 dirs, the contents


def test_deleting_a_file_voids_its_pending_commit_with_the_delete():
    log, _, names = new_log()
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    chunks, _ = close(log, 2, nchunks=3)
    names[2] = False  # the live namespace: no name left
    log.unnamed(2)  # (as the namespace reports it)
    freed = log.record(Unlink(ROOT, b"f", 5))
    assert len(freed) == 3 and log.records_voided == 1
    batch = commit(log)
    assert ops(batch) == ["make", "unlink"] and len(batch) == 3  # make, void content, unlink: one frame


def test_records_in_flight_are_never_voided():
    log, _, _ = new_log()
    log.record(Make(ROOT, b"f", REG, 0, 0, 0, b"", 2, 1))
    close(log, 2, drained=True)
    batch = log.take_batch(1 << 20)  # being written now
    assert ops(batch) == ["make", "content"]
    _, freed = close(log, 2)
    assert freed == [] and log.records_voided == 0
    log.committed_batch(batch)
    log.check_invariants()


def test_max_lag_stops_voids_from_starving_the_journal():
    """Rewriting one path faster than it drains: each close voids the one before and chains the
    group, so without the bound no prefix is ever ready. Past max_lag the chain breaks."""
    log, clock, _ = new_log(max_lag=1.0)
    log.record(Make(ROOT, b"last.ckpt", REG, 0, 0, 0, b"", 2, 0))
    versions = []
    for step in range(30):
        clock.t = step * 0.1
        chunks, _ = close(log, 2)
        versions.append(chunks)
        if step > 0:
            versions[step - 1][0].drain()  # each version drains just after the next close
        if commit(log):
            break
    else:
        raise AssertionError("nothing was ever committed")
    assert clock.t <= 1.0 + 0.2, f"the first commit came {clock.t:.1f}s after the first close"
    assert log.void_floor >= 0 and log.records_voided > 0  # some versions were skipped, not all


def test_without_the_bound_the_same_loop_never_commits():
    log, clock, _ = new_log(max_lag=1e9)
    log.record(Make(ROOT, b"last.ckpt", REG, 0, 0, 0, b"", 2, 0))
    prev = None
    for step in range(30):
        clock.t = step * 0.1
        chunks, _ = close(log, 2)
        if prev is not None:
            prev[0].drain()
        prev = chunks
        assert commit(log) == []
    assert log.lag() >= 2.9


def test_lag_and_oldest_closed():
    log, clock, _ = new_log()
    assert log.lag() == 0 and log.oldest_closed() is None
    log.record(Make(ROOT, b"d", DIR, 0, 0, 0, b"", 2, 0))
    clock.t = 0.5
    close(log, 3)
    clock.t = 2.0
    assert log.lag() == 2.0 and log.oldest_closed() == (3, 1.5) and log.overdue()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["make", "close", "rename", "unlink", "drain", "commit", "tick"]),
                          st.integers(0, 3)), max_size=60))
def test_batches_are_prefixes_that_never_split_a_group(events):
    log, clock, names = new_log(max_lag=0.5)
    files = {}  # name index -> ino
    chunks = []
    next_ino = 10
    committed = []
    for kind, k in events:
        if kind == "make" and k not in files:
            files[k] = next_ino
            names[next_ino] = True
            log.record(Make(ROOT, b"f%d" % k, REG, 0, 0, 0, b"", next_ino, 0))
            next_ino += 1
        elif kind == "close" and k in files:
            c, _ = close(log, files[k], nchunks=2)
            chunks += c.values()
        elif kind == "rename" and k in files and (k + 1) % 4 in files and k != (k + 1) % 4:
            dst = (k + 1) % 4
            names[files[dst]] = False
            log.unnamed(files[dst])
            log.record(Rename(ROOT, b"f%d" % k, ROOT, b"f%d" % dst, 0, 0))
            files[dst] = files.pop(k)
        elif kind == "unlink" and k in files:
            names[files[k]] = False
            log.unnamed(files[k])
            log.record(Unlink(ROOT, b"f%d" % k, 0))
            del files[k]
        elif kind == "drain" and chunks:
            random.Random(k).choice(chunks).drain()
        elif kind == "commit":
            for c in chunks:
                c.drain()
            batch = log.take_batch(1 << 20)
            if batch:
                assert batch[0].index == log.committed + 1, "not the next record"
                assert all(p.ready() for p in batch)
                assert max(p.group_end for p in batch) <= batch[-1].index, "a group was split"
                log.committed_batch(batch)
                committed += batch
        elif kind == "tick":
            clock.t += 0.3
        log.check_invariants()
    assert [p.index for p in committed] == list(range(len(committed)))
