from __future__ import annotations

from pathlib import Path

import pytest

from tidewater.broker.log.checkpoints import (
    CorruptCheckpoint,
    EpochEntry,
    LeaderEpochCheckpoint,
    OffsetCheckpoint,
    OffsetCheckpointWriter,
    write_atomically,
)


def test_offset_checkpoint_round_trips_in_kafkas_format(tmp_path: Path) -> None:
    checkpoint = OffsetCheckpoint(tmp_path / "replication-offset-checkpoint")
    offsets = {("orders", 0): 42, ("orders-eu", 11): 0, ("a.b_c", 3): 10**12}
    checkpoint.write(offsets)
    assert checkpoint.read() == offsets
    lines = checkpoint.path.read_text().splitlines()
    assert lines[:2] == ["0", "3"]
    assert sorted(lines[2:]) == ["a.b_c 3 1000000000000", "orders 0 42", "orders-eu 11 0"]


async def test_offsets_waiting_for_a_worker_thread_never_overwrite_a_later_write(
    tmp_path: Path,
) -> None:
    """The periodic checkpoint hands its offsets to a worker thread; a truncation's checkpoint
    written meanwhile, on the event loop, is the later one and must stay."""
    writer = OffsetCheckpointWriter("recovery-point-offset-checkpoint")
    periodic = writer.write_off_loop(tmp_path, {("t", 0): 60})
    writer.write(tmp_path, {("t", 0): 20})
    await periodic
    assert OffsetCheckpoint(tmp_path / writer.name).read() == {("t", 0): 20}
    await writer.write_off_loop(tmp_path, {("t", 0): 25})
    assert OffsetCheckpoint(tmp_path / writer.name).read() == {("t", 0): 25}


async def test_offsets_the_file_already_holds_are_not_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The periodic checkpoints of idle logs: no fsync'd rewrite of the same offsets."""
    written: list[dict[tuple[str, int], int]] = []
    write = OffsetCheckpoint.write

    def counted(checkpoint: OffsetCheckpoint, offsets: dict[tuple[str, int], int]) -> None:
        written.append(dict(offsets))
        write(checkpoint, offsets)

    monkeypatch.setattr(OffsetCheckpoint, "write", counted)
    writer = OffsetCheckpointWriter("log-start-offset-checkpoint")
    (tmp_path / "other-dir").mkdir()
    writer.write(tmp_path, {("t", 0): 5, ("t", 1): 0})
    writer.write(tmp_path, {("t", 1): 0, ("t", 0): 5})
    await writer.write_off_loop(tmp_path, {("t", 0): 5, ("t", 1): 0})
    writer.write(tmp_path / "other-dir", {("u", 0): 5})  # another log dir's file
    writer.write(tmp_path, {("t", 0): 6, ("t", 1): 0})
    assert written == [{("t", 0): 5, ("t", 1): 0}, {("u", 0): 5}, {("t", 0): 6, ("t", 1): 0}]
    assert OffsetCheckpoint(tmp_path / writer.name).read() == {("t", 0): 6, ("t", 1): 0}


def test_missing_checkpoint_reads_empty(tmp_path: Path) -> None:
    assert OffsetCheckpoint(tmp_path / "recovery-point-offset-checkpoint").read() == {}
    assert LeaderEpochCheckpoint(tmp_path / "leader-epoch-checkpoint").read() == []


def test_leader_epoch_checkpoint_round_trips(tmp_path: Path) -> None:
    checkpoint = LeaderEpochCheckpoint(tmp_path / "leader-epoch-checkpoint")
    entries = [EpochEntry(0, 0), EpochEntry(3, 120), EpochEntry(7, 120)]
    checkpoint.write(entries)
    assert checkpoint.read() == entries
    assert checkpoint.path.read_text() == "0\n3\n0 0\n3 120\n7 120\n"
    checkpoint.write([])
    assert checkpoint.read() == []


def test_rewrites_are_atomic_and_leave_no_temp_files(tmp_path: Path) -> None:
    checkpoint = OffsetCheckpoint(tmp_path / "recovery-point-offset-checkpoint")
    for i in range(5):
        checkpoint.write({("t", p): p * i for p in range(3)})
    assert checkpoint.read() == {("t", p): p * 4 for p in range(3)}
    assert [p.name for p in tmp_path.iterdir()] == ["recovery-point-offset-checkpoint"]


def test_an_interrupted_write_leaves_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "leader-epoch-checkpoint"
    LeaderEpochCheckpoint(path).write([EpochEntry(1, 5)])
    # A crash between writing the temp file and the rename: the temp file is all that differs.
    (tmp_path / "leader-epoch-checkpoint.tmp").write_text("0\n1\n2 9")
    assert LeaderEpochCheckpoint(path).read() == [EpochEntry(1, 5)]
    write_atomically(path, b"0\n0\n")
    assert LeaderEpochCheckpoint(path).read() == []
    assert not (tmp_path / "leader-epoch-checkpoint.tmp").exists()


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "missing the version or count line"),
        ("0\n", "missing the version or count line"),
        ("1\n0\n", "unknown version '1'"),
        ("0\n2\nt 0 5\n", "count line '2' but 1 entries"),
        ("0\nx\n", "count line 'x'"),
        ("0\n\u00b2\n", "not ASCII"),
        ("0\n1\nt 0\n", "does not have 3 fields"),
        ("0\n1\nt 0 5 6\n", "does not have 3 fields"),
        ("0\n1\nt zero 5\n", "'zero' is not an integer"),
        ("0\n1\nt 0 -5\n", "'-5' is not an integer >= 0"),
        ("0\n1\nbad/topic 0 5\n", "bad/topic"),
        ("0\n1\nt 0 5\n\n\n", "count line"),
        (b"0\n1\n\xff 0 5\n", "not ASCII"),
    ],
)
def test_corrupt_offset_checkpoint_names_the_file(
    tmp_path: Path, text: str | bytes, complaint: str
) -> None:
    path = tmp_path / "replication-offset-checkpoint"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CorruptCheckpoint) as raised:
        OffsetCheckpoint(path).read()
    assert str(path) in str(raised.value)
    assert complaint in str(raised.value)


@pytest.mark.parametrize(
    "text",
    ["0\n2\n3 10\n2 20\n", "0\n2\n3 10\n4 5\n", "0\n1\n3\n", "0\n1\n-1 0\n"],
)
def test_corrupt_leader_epoch_checkpoint_names_the_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "leader-epoch-checkpoint"
    path.write_text(text)
    with pytest.raises(CorruptCheckpoint, match="leader-epoch-checkpoint"):
        LeaderEpochCheckpoint(path).read()
