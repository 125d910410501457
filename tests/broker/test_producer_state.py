"""The partition's idempotent-producer state: duplicates, sequence checks, fencing, rebuild from
the log, truncation and snapshots."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.broker.log.test_log import PowerLoss
from tidewater.broker import producer_state
from tidewater.broker.log.config import LogConfig
from tidewater.broker.log.log import FlushJob, Log
from tidewater.broker.partition import HostedPartition, replication_config
from tidewater.broker.producer_state import (
    SEQUENCE_MAX,
    SNAPSHOT_SUFFIX,
    Duplicate,
    ProducerStateManager,
    batch_headers,
    snapshot_path,
)
from tidewater.broker.topic_config import TopicConfig
from tidewater.client.sequences import ProducerSequences
from tidewater.errors import (
    RETRIABLE,
    InvalidProducerEpoch,
    InvalidRequest,
    OutOfOrderSequence,
    TidewaterError,
    UnknownProducerId,
)
from tidewater.local.standin_controller import make_leader
from tidewater.local.wait import eventually
from tidewater.records.batch import Record, build_batch
from tidewater.records.header import BatchHeader, read_header
from tidewater.replication.partition import LeaderAndIsr, Partition
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1.errors_pb2 import ErrorCode

PID = 7
EXPIRATION_MS = 86_400_000


def raw_batch(
    sequence: int, records: int = 1, epoch: int = 0, pid: int = PID, offset: int = 0
) -> bytes:
    return build_batch(
        [Record(value=b"v")] * records,
        base_offset=offset,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=sequence,
        now_ms=1_000,
    )


def batch(
    sequence: int, records: int = 1, epoch: int = 0, pid: int = PID, offset: int = 0
) -> BatchHeader:
    return read_header(raw_batch(sequence, records, epoch, pid, offset))


def append(
    state: ProducerStateManager, header: BatchHeader, offset: int, now_ms: int = 1_000
) -> None:
    """What the leader does: check, then record the append at `offset` at `now_ms`."""
    assert state.check(header) is None
    state.update(header, offset, now_ms)


@pytest.fixture
def state(tmp_path: Path) -> ProducerStateManager:
    return ProducerStateManager(tmp_path)


def test_a_retry_of_any_of_the_last_five_batches_returns_its_original_offsets(
    state: ProducerStateManager,
) -> None:
    for i in range(7):  # sequences 2i, 2i+1 at offsets 10i, 10i+1
        append(state, batch(2 * i, records=2), 10 * i)
    for i in range(2, 7):
        assert state.check(batch(2 * i, records=2)) == Duplicate(10 * i, 10 * i + 1)


def test_a_retry_older_than_the_last_five_batches_is_out_of_order(
    state: ProducerStateManager,
) -> None:
    # Kafka's behaviour: the broker no longer knows it, so it is out of sequence
    # (OUT_OF_ORDER_SEQUENCE), not answered as a duplicate.
    for i in range(6):
        append(state, batch(i), i)
    with pytest.raises(OutOfOrderSequence):
        state.check(batch(0))


def test_a_retry_must_match_the_whole_sequence_range(state: ProducerStateManager) -> None:
    append(state, batch(0, records=3), 0)
    with pytest.raises(OutOfOrderSequence):
        state.check(batch(0, records=2))


def test_a_gap_in_the_sequence_is_out_of_order(state: ProducerStateManager) -> None:
    append(state, batch(0, records=3), 0)
    assert state.check(batch(3)) is None
    with pytest.raises(OutOfOrderSequence, match="does not follow 2"):
        state.check(batch(4))


def test_an_unknown_producer_must_start_at_sequence_zero(state: ProducerStateManager) -> None:
    with pytest.raises(UnknownProducerId):
        state.check(batch(5))
    assert state.check(batch(0, epoch=3)) is None


def test_an_idempotent_batch_without_a_sequence_is_invalid(state: ProducerStateManager) -> None:
    with pytest.raises(InvalidRequest):
        state.check(batch(-1))


def test_an_older_epoch_is_fenced_and_a_new_epoch_starts_at_zero(
    state: ProducerStateManager,
) -> None:
    append(state, batch(0, records=5), 0)
    with pytest.raises(OutOfOrderSequence, match="new epoch"):
        state.check(batch(5, epoch=1))
    append(state, batch(0, epoch=1), 5)
    with pytest.raises(InvalidProducerEpoch):
        state.check(batch(5, epoch=0))
    # The new epoch's batches are all that count: epoch 0's are forgotten.
    assert state.check(batch(1, epoch=1)) is None
    assert state.check(batch(0, epoch=1)) == Duplicate(5, 5)


def test_sequences_wrap_after_the_largest_int32(state: ProducerStateManager) -> None:
    # Replayed from the log (no checks): a batch crossing the wrap, whose last sequence is
    # (MAX - 1 + 2) mod 2^31 = 0.
    crossing = batch(SEQUENCE_MAX - 1, records=3)
    state.load_from_log([crossing._replace(base_offset=100)], 1_000)
    assert state.producers[PID].last_sequence == 0
    assert state.check(crossing) == Duplicate(100, 102)
    assert state.check(batch(1)) is None
    with pytest.raises(OutOfOrderSequence):
        state.check(batch(SEQUENCE_MAX))


def test_replaying_the_log_rebuilds_the_state(state: ProducerStateManager) -> None:
    # As a follower or a restarted broker sees them: offsets stored in the batches, other
    # producers and non-idempotent batches mixed in.
    log = b"".join(
        [
            raw_batch(0, offset=0),
            build_batch([Record(value=b"b")], base_offset=1),
            raw_batch(0, pid=9, records=2, offset=2),
            raw_batch(1, records=2, offset=4),
        ]
    )
    state.load_from_log(batch_headers(log), 1_000)
    assert state.check(batch(1, records=2)) == Duplicate(4, 5)
    assert state.check(batch(0, pid=9, records=2)) == Duplicate(2, 3)
    assert state.check(batch(3)) is None
    assert set(state.producers) == {PID, 9}


async def test_a_truncation_brings_back_the_older_epoch_a_removed_batch_had_replaced(
    tmp_path: Path,
) -> None:
    """Review 14 L1: a follower's truncation popped the removed batches off the one entry it
    keeps a producer, which the removed batch, the first of a new epoch, had begun afresh:
    the producer was forgotten, while the new leader (which never had that batch), and this
    replica after a restart, held its older epoch; a stale retry of that epoch was appended
    again here. Now the state is rebuilt from a snapshot and the log after it (Kafka's
    truncateTo), and the snapshots past the new end go."""
    new_leader = follower(tmp_path / "b" / "t-0")
    diverged = follower(tmp_path / "c" / "t-0", segment_bytes=100)  # a batch a segment
    for offset in range(3):
        for replica in (new_leader, diverged):
            await replica.append_as_follower(raw_batch(offset, offset=offset))
    # The old leader's last batch, which the new leader never got: epoch 1 of the producer.
    await diverged.append_as_follower(raw_batch(0, epoch=1, offset=3))
    assert snapshots(diverged.log.dir) == [3, 4]  # taken at the rolls, the newest two kept

    diverged.truncate_to(3)
    assert diverged.producer_state.producers == new_leader.producer_state.producers
    assert diverged.producer_state.check(batch(0)) == Duplicate(0, 0)
    assert diverged.producer_state.check(batch(0, epoch=1)) is None  # may be sent again
    assert snapshots(diverged.log.dir) == [3]
    for replica in (new_leader, diverged):
        replica.log.close()
    restarted = follower(diverged.log.dir)
    assert restarted.producer_state.producers == new_leader.producer_state.producers
    restarted.log.close()


def record_log_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the offset of every read of any log, in order."""
    reads: list[int] = []
    read = Log.read

    def recorded_read(self: Log, offset: int, *args: Any, **kwargs: Any) -> bytes | memoryview:
        reads.append(offset)
        return read(self, offset, *args, **kwargs)

    monkeypatch.setattr(Log, "read", recorded_read)
    return reads


def replayed(directory: Path, headers: list[BatchHeader]) -> ProducerStateManager:
    """The state of a log holding `headers`, each appended at 1,000 ms plus its offset."""
    state = ProducerStateManager(directory)
    for header in headers:
        state.update(header, header.base_offset, 1_000 + header.base_offset)
    return state


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    appends=st.lists(
        st.tuples(st.integers(1, 3), st.booleans(), st.integers(1, 3)), min_size=1, max_size=30
    ),
    cut=st.integers(0, 30),
    committed=st.integers(0, 30),
)
def test_a_truncated_tail_is_undone_to_the_state_of_the_log_before_it(
    tmp_path: Path, appends: list[tuple[int, bool, int]], cut: int, committed: int
) -> None:
    """Three producers, some bumping their epochs (a new entry replacing the old one), more
    than five batches each (the oldest pushed out): undoing every batch at and past a batch
    boundary gives the state of the log before it, unless the boundary is below the HW the
    journal was released to; appending the batches again then gives the whole log's."""
    headers: list[BatchHeader] = []
    epochs: dict[int, int] = {}
    sequences: dict[int, int] = {}
    offset = 0
    for pid, bump, records in appends:
        if bump and pid in epochs:
            epochs[pid] += 1
            sequences[pid] = 0
        epoch = epochs.setdefault(pid, 0)
        sequence = sequences.get(pid, 0)
        headers.append(batch(sequence, records, epoch, pid, offset))
        sequences[pid] = sequence + records
        offset += records
    boundaries = [h.base_offset for h in headers] + [offset]
    end = boundaries[min(cut, len(boundaries) - 1)]
    high_watermark = boundaries[min(committed, len(boundaries) - 1)]
    state = replayed(tmp_path, headers)
    state.release(high_watermark)

    undone = state.truncate(end)
    assert undone == (end >= high_watermark)
    if undone:
        kept = [h for h in headers if h.base_offset < end]
        assert state.producers == replayed(tmp_path, kept).producers
        for header in headers[len(kept) :]:
            state.update(header, header.base_offset, 1_000 + header.base_offset)
        assert state.producers == replayed(tmp_path, headers).producers


def test_the_journal_reaches_back_no_further_than_its_last_updates(
    state: ProducerStateManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(producer_state, "JOURNAL_MAX", 3)
    headers = [batch(i, offset=i) for i in range(5)]
    for header in headers:
        state.update(header, header.base_offset, 1_000 + header.base_offset)
    assert not state.truncate(1)  # offsets 0 and 1's updates left the journal
    assert state.truncate(2)
    assert state.producers == replayed(state.dir, headers[:2]).producers


def test_an_expiry_leaves_truncations_below_it_to_a_rebuild(state: ProducerStateManager) -> None:
    append(state, batch(0), 0, now_ms=0)
    append(state, batch(0, pid=9), 1, now_ms=EXPIRATION_MS)
    assert state.expire(EXPIRATION_MS, EXPIRATION_MS, log_end_offset=2) == 1
    # Undoing offset 1's update cannot bring back producer 7's entry.
    assert not state.truncate(1)
    append(state, batch(1, pid=9), 2, now_ms=EXPIRATION_MS)
    assert state.truncate(2)
    assert state.producers[9].last_sequence == 0


async def test_a_followers_truncation_reads_none_of_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower's truncation rebuilt the producer state from the newest snapshot and the
    log after it, up to a segment of batch headers (about a minute for 1 GiB of small batches)
    on the event loop that serves every partition and the heartbeats. It now undoes the
    removed batches from the journal: no read of the log, the state the new leader holds, and
    the snapshots past the new end deleted."""
    new_leader = follower(tmp_path / "b" / "t-0")
    diverged = follower(tmp_path / "c" / "t-0", segment_bytes=300)
    for offset in range(12):
        pid = PID if offset % 2 else 9
        for replica in (new_leader, diverged):
            await replica.append_as_follower(raw_batch(offset // 2, pid=pid, offset=offset))
    # The old leader's tail the new leader never got: one producer's new epoch, and more.
    await diverged.append_as_follower(raw_batch(0, epoch=1, offset=12))
    await diverged.append_as_follower(raw_batch(6, pid=9, offset=13))
    assert max(snapshots(diverged.log.dir)) > 12
    reads = record_log_reads(monkeypatch)
    diverged.truncate_to(12)
    assert reads == []
    assert diverged.producer_state.producers == new_leader.producer_state.producers
    assert max(snapshots(diverged.log.dir)) <= 12
    for replica in (new_leader, diverged):
        replica.log.close()


async def test_a_truncation_undoes_the_batches_of_a_write_under_way(tmp_path: Path) -> None:
    """Review 16 L1: the truncation read the LEO before the log took in a write under way on
    a worker thread; that write's batches entered the producer state, the truncation cut them
    from the log, and the state was not undone (a retry would be taken for a duplicate)."""
    hosted = follower(tmp_path / "t-0")
    for offset in range(3):
        await hosted.append_as_follower(raw_batch(offset, offset=offset))
    big = build_batch(
        [Record(value=b"x" * 100_000)],
        base_offset=3,
        producer_id=9,
        producer_epoch=0,
        base_sequence=0,
        now_ms=1_000,
    )
    write = asyncio.create_task(hosted.append_as_follower(big))
    await asyncio.sleep(0)  # the write has gone to a worker thread
    assert hosted.log._pending_write is not None
    hosted.truncate_to(3)
    await write
    assert hosted.log.log_end_offset == 3
    assert 9 not in hosted.producer_state.producers
    hosted.log.close()


async def test_a_reopened_partition_journals_nothing_below_its_hw(tmp_path: Path) -> None:
    """Review 16 L2: the load after a crash (no snapshot at the end) journals every batch
    after the last snapshot, up to JOURNAL_MAX a partition, and only an append let go of
    those below the HW: a partition with none kept them (about 2.8 MB for 10,000 small
    batches). Hosting lets go of them; above the HW they stay, for a truncation to undo."""
    hosted = follower(tmp_path / "t-0")
    for offset in range(10):
        await hosted.append_as_follower(raw_batch(offset, offset=offset))
    hosted.log.close()  # a crash: no snapshot at the LEO
    reopened = follower(tmp_path / "t-0", high_watermark=8)
    assert [undo.first_offset for undo in reopened.producer_state._journal] == [8, 9]
    assert reopened.producer_state.truncate(8)
    assert reopened.producer_state.producers[PID].last_sequence == 7
    reopened.log.close()


async def test_a_truncation_below_the_hw_rebuilds_the_state_from_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unclean election's truncation goes below the HW, where the journal keeps nothing:
    the state is rebuilt from a snapshot and the log, as before the journal."""
    hosted = follower(tmp_path / "t-0", segment_bytes=300)
    headers = [batch(offset, offset=offset) for offset in range(8)]
    for offset in range(8):
        await hosted.append_as_follower(raw_batch(offset, offset=offset))
    hosted.producer_state.release(6)  # what the appends do with the partition's HW
    hosted.truncate_to(4)
    assert "rebuilding it from the log" in caplog.text
    expected = replayed(tmp_path, headers[:4]).producers
    assert [(e.epoch, list(e.batches)) for e in hosted.producer_state.producers.values()] == [
        (e.epoch, list(e.batches)) for e in expected.values()
    ]
    hosted.log.close()


@pytest.mark.parametrize("offset", [4, 5])  # a batch boundary, and inside a 2-record batch
async def test_a_truncation_below_the_hw_is_prepared_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, offset: int
) -> None:
    """The rebuild of the truncation below the HW above, built on a worker thread by
    prepare_truncation (the fetcher calls it first): truncate_to only takes it. On the loop it
    cost about 4 us a batch, up to a segment's (seconds, for a segment of small batches). A
    log that changed since (another LEO) is rebuilt on the loop, as before."""
    hosted = follower(tmp_path / "t-0", segment_bytes=300)
    offsets = [0, 1, 2, 4, 6, 7]  # batches of 1, 1, 2, 2, 1, 1 records
    for base in offsets:
        records = 2 if base in (2, 4) else 1
        await hosted.append_as_follower(raw_batch(base, records, offset=base))
    headers = list(batch_headers(hosted.log.read(0, 1 << 20)))
    hosted.producer_state.release(7)
    assert hosted.producer_state.journal_floor == 7
    on_the_loop: list[int] = []
    monkeypatch.setattr(
        hosted.producer_state, "rebuild", lambda log, now: on_the_loop.append(log.log_end_offset)
    )
    await hosted.prepare_truncation(offset)
    hosted.truncate_to(offset)
    assert on_the_loop == [] and "rebuilding it from the log" not in caplog.text
    assert hosted.log.log_end_offset == 4
    expected = replayed(tmp_path, [h for h in headers if h.next_offset <= 4]).producers
    assert [(e.epoch, list(e.batches)) for e in hosted.producer_state.producers.values()] == [
        (e.epoch, list(e.batches)) for e in expected.values()
    ]
    assert max(snapshots(hosted.log.dir), default=0) <= 4
    # Prepared for a log that has changed since: rebuilt on the loop.
    hosted.producer_state.release(4)
    await hosted.prepare_truncation(2)
    await hosted.append_as_follower(raw_batch(4, offset=4))
    hosted.producer_state.release(5)
    hosted.truncate_to(2)
    assert on_the_loop == [2]
    hosted.log.close()


def test_a_producer_idle_for_the_expiration_is_forgotten(state: ProducerStateManager) -> None:
    append(state, batch(0), 0, now_ms=10_000)
    append(state, batch(0, pid=9), 1, now_ms=10_000)
    append(state, batch(1, pid=9), 2, now_ms=15_000)  # each batch renews its producer
    assert state.expire(10_000 + EXPIRATION_MS - 1, EXPIRATION_MS, 3) == 0
    assert state.expire(10_000 + EXPIRATION_MS, EXPIRATION_MS, 3) == 1
    assert set(state.producers) == {9}
    # Its next batch: UNKNOWN_PRODUCER_ID, and the client's bumped epoch starts afresh.
    with pytest.raises(UnknownProducerId):
        state.check(batch(1))
    assert state.check(batch(0, epoch=1)) is None


def test_expiry_counts_from_the_brokers_clock_not_the_batchs_timestamp(
    state: ProducerStateManager,
) -> None:
    # The batch says 1970 (a producer whose clock lags, or a replay of old records): Kafka,
    # which stamps the entry with it, would expire the producer at its next check.
    old = batch(0)
    assert old.max_timestamp == 1_000
    now = 1_800_000_000_000
    append(state, old, 0, now_ms=now)
    state.load_from_log([batch(0, pid=9)], now)  # a follower's replay too
    assert state.expire(now + EXPIRATION_MS - 1, EXPIRATION_MS, 2) == 0
    assert set(state.producers) == {PID, 9}


def test_an_older_snapshot_brings_an_expired_producer_back_only_until_the_next_check(
    tmp_path: Path, state: ProducerStateManager
) -> None:
    append(state, batch(0), 0, now_ms=0)
    state.take_snapshot(1)
    assert state.expire(EXPIRATION_MS, EXPIRATION_MS, 1) == 1
    assert state.producers == {}
    # A restart before the next snapshot: the producer is back, with the time it was last
    # seen (not the restart's), as it was before it expired; the next check expires it.
    restarted = ProducerStateManager(tmp_path)
    assert restarted.load_snapshot(log_end_offset=1) == 1
    assert restarted.check(batch(0)) == Duplicate(0, 0)
    assert restarted.expire(EXPIRATION_MS, EXPIRATION_MS, 1) == 1
    # A snapshot taken after the expiry leaves it out.
    state.take_snapshot(2)
    after = ProducerStateManager(tmp_path)
    assert after.load_snapshot(log_end_offset=2) == 2
    assert after.producers == {}


def test_a_snapshot_round_trips_the_state(tmp_path: Path, state: ProducerStateManager) -> None:
    for i in range(6):
        append(state, batch(i), i)
    append(state, batch(0, pid=9, epoch=4, records=2), 6)
    state.take_snapshot(8)

    loaded = ProducerStateManager(tmp_path)
    assert loaded.load_snapshot(log_end_offset=8) == 8
    assert loaded.producers == state.producers
    assert loaded.check(batch(1)) == Duplicate(1, 1)
    assert loaded.check(batch(0, pid=9, epoch=4, records=2)) == Duplicate(6, 7)


@pytest.mark.parametrize("spoiled", ["torn", "another offset's", "past the log end"])
def test_a_snapshot_that_cannot_be_used_is_deleted_and_the_one_before_it_loaded(
    tmp_path: Path, state: ProducerStateManager, spoiled: str
) -> None:
    append(state, batch(0), 0)
    state.take_snapshot(1)
    append(state, batch(1), 1)
    newest = state.take_snapshot(2, durable=False)  # as on a roll: fsynced later
    assert newest == snapshot_path(tmp_path, 2)
    log_end = 2
    if spoiled == "torn":
        newest.write_bytes(b'{"version": 1, "produc')
    elif spoiled == "another offset's":
        # A crash before the unsynced file reached the disk can leave its name on blocks
        # that hold an older snapshot's bytes.
        newest.write_bytes(snapshot_path(tmp_path, 1).read_bytes())
    else:
        log_end = 1  # a crash took back the log behind it

    loaded = ProducerStateManager(tmp_path)
    assert loaded.load_snapshot(log_end_offset=log_end) == 1
    assert loaded.check(batch(0)) == Duplicate(0, 0)
    assert not newest.exists()


def test_only_the_newest_snapshots_are_kept(tmp_path: Path, state: ProducerStateManager) -> None:
    for offset in (10, 20, 30):
        append(state, batch(offset // 10 - 1), offset - 1)
        state.take_snapshot(offset)
    assert snapshots(tmp_path) == [20, 30]


def test_no_snapshot_leaves_the_state_empty(tmp_path: Path) -> None:
    state = ProducerStateManager(tmp_path)
    assert state.load_snapshot(log_end_offset=100) is None
    assert state.producers == {}


@pytest.mark.parametrize("truncation", ["truncate_to", "truncate_fully_and_start_at"])
async def test_snapshots_a_truncation_deletes_stay_deleted_after_a_machine_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, truncation: str
) -> None:
    """Review 14 L2: the snapshots past a truncation were unlinked after the log's directory
    fsync, and nothing fsynced the directory again before the records appended after it were
    on disk. A machine crash could bring such a snapshot back under a log as long again:
    another producer's records at its offsets, and the truncated producer's retry answered
    as a duplicate at them. The deletions are fsynced before the truncation returns."""
    power = PowerLoss((tmp_path / "t-0").resolve(), monkeypatch)
    hosted = follower(tmp_path / "t-0", segment_bytes=600)
    for offset in range(10):
        await hosted.append_as_follower(raw_batch(offset, offset=offset))
    assert snapshots(hosted.log.dir) == [9]  # the roll's, fsynced (no background flusher)
    getattr(hosted, truncation)(3)
    # The new leader's records from offset 3 on: another producer's (no roll), on disk.
    await hosted.append_as_follower(raw_batch(0, records=7, pid=9, offset=3))
    hosted.log.flush()
    power.crash(hosted.log, [])

    restarted = follower(hosted.log.dir)
    replayed = ProducerStateManager(tmp_path)
    replayed.load_from_log(
        batch_headers(restarted.log.read(restarted.log_start_offset, 1 << 20)), 1_000
    )
    # Not the snapshot at 9 back, answering producer 7's retry of offset 5 as a duplicate.
    assert restarted.producer_state.producers == replayed.producers
    restarted.log.close()


def test_a_roll_snapshots_the_state_and_leaves_the_fsync_to_the_background(
    tmp_path: Path,
) -> None:
    config = TopicConfig(log=LogConfig(segment_bytes=300))
    log = Log.open(tmp_path / "t-0", config.log, 0, lambda: 1_000)
    jobs: list[FlushJob] = []
    log.flush_in_background = lambda lg, job: jobs.append(job)
    state = Partition("t", 0, 1, log, replication_config(config, 30_000), 0)
    hosted = HostedPartition(state, log, config, lambda: 1_000)
    while len(log.segments) < 2:
        batch = raw_batch(log.log_end_offset, offset=log.log_end_offset)
        asyncio.run(hosted.append_as_follower(batch))
    # The appending request did not wait for an fsync of the snapshot: a job after the
    # rolled segment's own does it.
    snapshot = snapshot_path(log.dir, log.log_end_offset)
    assert [(job.offset, job.paths) for job in jobs][-1] == (None, [snapshot])

    loaded = ProducerStateManager(log.dir)
    assert loaded.load_snapshot(log.log_end_offset) == log.log_end_offset
    assert loaded.producers == hosted.producer_state.producers
    log.close()


class ClientBatch:
    """A producer batch as the client's sequence state machine numbers it."""

    def __init__(self, value: bytes) -> None:
        self.tp = ("t", 0)
        self.value = value
        self.pid = self.epoch = self.sequence = -1

    @property
    def record_count(self) -> int:
        return 1

    def stamp(self, producer_id: int, producer_epoch: int, base_sequence: int) -> None:
        self.pid, self.epoch, self.sequence = producer_id, producer_epoch, base_sequence

    def data(self) -> bytearray:
        return bytearray(
            build_batch(
                [Record(value=self.value)],
                producer_id=self.pid,
                producer_epoch=self.epoch,
                base_sequence=self.sequence,
                now_ms=1_000,
            )
        )


async def test_a_retry_whose_first_attempt_retention_deleted_is_a_duplicate(
    tmp_path: Path,
) -> None:
    # Review 14's M1: the producer's state went with its batches, the retry got
    # UNKNOWN_PRODUCER_ID, and the client (renumbering it from 0 in a bumped epoch, as a batch
    # known not to be in the log) had it appended a second time.
    config = TopicConfig(log=LogConfig(segment_bytes=400, retention_bytes=400))
    log = Log.open(tmp_path / "t-0", config.log, 0, lambda: 1_000)
    state = Partition("t", 0, 1, log, replication_config(config, 30_000), 0)
    state.make_leader(LeaderAndIsr(1, 1, (1,), (1,), 1), 1_000)
    hosted = HostedPartition(state, log, config, lambda: 1_000)
    client = ProducerSequences(producer_id=PID, epoch=0)

    async def attempt(batch: ClientBatch) -> int:
        """An attempt at a batch the client is sending and, if the broker refuses it, the
        client's resend; returns where the batch is."""
        try:
            info, _ = await hosted.append_as_leader(batch.data(), -1, 1_000)
        except TidewaterError as e:
            assert client.retriable(batch, e.code, RETRIABLE)
            client.settle()
            info, _ = await hosted.append_as_leader(batch.data(), -1, 1_000)
        client.acknowledged(batch)
        return info.first_offset

    sent = ClientBatch(b"p-0")
    client.sending(sent)
    await attempt(sent)
    lost = ClientBatch(b"p-1")
    client.sending(lost)
    first, _ = await hosted.append_as_leader(lost.data(), -1, 1_000)  # its answer is lost
    # Another producer's traffic rolls segments, and retention deletes the one holding it.
    other = 0
    while log.log_start_offset <= first.last_offset:
        await hosted.append_as_leader(bytearray(raw_batch(other, pid=9)), -1, 1_000)
        other += 1
        log.delete_retention_segments(1_000, state.high_watermark)
    await hosted.append_as_leader(bytearray(raw_batch(other, pid=9)), -1, 1_000)
    log_end = log.log_end_offset

    assert await attempt(lost) == first.first_offset  # the retry
    assert log.log_end_offset == log_end
    log.close()


async def test_hosting_a_partition_reads_none_of_its_log(
    tmp_path: Path, start_broker: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 14 M3: with no snapshot at the log end (a kill -9), the first LeaderAndIsr to
    host the partition replayed the log after the newest snapshot on the event loop that also
    answers heartbeats: up to a segment, about a minute for 1 GiB of small batches, with the
    broker fenced long before. The log now loads its producers as it opens, when the broker
    loads its logs before it listens or registers; hosting the partition reads none of it,
    and the state it finds deduplicates retries."""
    log = Log.open(tmp_path / "broker-1" / "events-0", LogConfig())
    log.append_as_follower(b"".join(raw_batch(i, offset=i) for i in range(20)))
    log.close()  # no snapshot, as a kill -9 leaves it
    _, client = await start_broker(1)
    reads = record_log_reads(monkeypatch)
    await make_leader(client.channel, "events", 0, leader=1, leader_epoch=1, replicas=[1])
    assert reads == []
    retry = await client.service.Produce(
        pb.ProduceRequest(
            acks=1,
            partitions=[
                pb.PartitionProduceData(topic="events", partition=0, record_batch=raw_batch(19))
            ],
        )
    )
    assert [(p.error_code, p.base_offset) for p in retry.partitions] == [(ErrorCode.NONE, 19)]


def follower(
    directory: Path, segment_bytes: int = 1 << 20, high_watermark: int = 0
) -> HostedPartition:
    """A replica (broker 3) following broker 1 on a log opened in `directory`, with the HW
    checkpoint `high_watermark`."""
    config = TopicConfig(log=LogConfig(segment_bytes=segment_bytes))
    log = Log.open(directory, config.log, 0, lambda: 1_000)
    state = Partition("t", 0, 3, log, replication_config(config, 30_000), high_watermark)
    state.make_follower(LeaderAndIsr(1, 1, (1, 2, 3), (1, 2, 3), 1))
    return HostedPartition(state, log, config, lambda: 1_000)


def snapshots(directory: Path) -> list[int]:
    return sorted(int(p.name.removesuffix(SNAPSHOT_SUFFIX)) for p in directory.glob("*.snapshot"))


async def test_retention_past_every_snapshot_leaves_one_at_the_log_end(
    start_broker: Callable[..., Any],
) -> None:
    """Review 31 #2: retention rolled an idle log at its end and deleted every segment, with
    no snapshot there; after a kill -9 the reopened log loaded an older snapshot (or none)
    and replayed nothing: the producer's next batch was refused as out of sequence or from
    an unknown producer. As Kafka snapshots at every roll, the broker snapshots the state at
    the log end once retention moves the log start past every snapshot."""
    server, client = await start_broker(1, **{"log.retention.check.interval.ms": 50})
    await make_leader(
        client.channel, "t", 0, leader=1, leader_epoch=1, replicas=[1],
        configs={"retention.ms": "1000"},
    )  # fmt: skip
    for sequence in range(3):
        response = await client.service.Produce(
            pb.ProduceRequest(
                acks=1,
                partitions=[
                    pb.PartitionProduceData(
                        topic="t", partition=0, record_batch=raw_batch(sequence)
                    )
                ],
            )
        )
        assert response.partitions[0].error_code == ErrorCode.NONE
    hosted = server.replica_manager.partitions[("t", 0)]
    directory = hosted.log.dir
    # The batches' timestamps (1,000 ms after the epoch) are long past retention.ms.
    await eventually(lambda: hosted.log.log_start_offset == 3, 30)
    await eventually(lambda: snapshots(directory) == [3], 30)
    # What a broker killed now would load: the snapshot, and no log after it.
    reopened = ProducerStateManager(directory)
    assert reopened.load_snapshot(3) == 3
    assert reopened.producers == hosted.producer_state.producers
