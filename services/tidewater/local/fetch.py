"""Consumer fetches and offset look-ups in raw protobuf, and a log's bytes as stored, for tests
and tools that check what one broker serves or keeps byte for byte or which error it names (a
user reads through tidewater.client.Consumer)."""

from __future__ import annotations

from tidewater.broker.log.log import Log
from tidewater.records.header import read_header
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

READ_MAX_BYTES = 1 << 20


def consumer_fetch(
    topic: str,
    partition: int,
    offset: int,
    *,
    leader_epoch: int = -1,
    max_bytes: int = READ_MAX_BYTES,
    max_wait_ms: int = 0,
    min_bytes: int = 0,
    record_format: int = pb.RECORD_FORMAT_BATCHES,
) -> pb.FetchRequest:
    """A consumer's (replica_id -1) fetch of one partition from `offset`."""
    return pb.FetchRequest(
        replica_id=-1,
        max_wait_ms=max_wait_ms,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        record_format=record_format,  # type: ignore[arg-type]
        partitions=[
            pb.FetchPartition(
                topic=topic,
                partition=partition,
                fetch_offset=offset,
                current_leader_epoch=leader_epoch,
                last_fetched_epoch=-1,
                log_start_offset=-1,
            )
        ],
    )


def list_offsets(
    topic: str, partition: int, spec: int, *, replica_id: int = -1, timestamp_ms: int = 0
) -> pb.ListOffsetsRequest:
    """A ListOffsets of one partition: a consumer's (replica_id -1, bounded by the HW) or a
    replica's (its broker id, up to the LEO)."""
    return pb.ListOffsetsRequest(
        replica_id=replica_id,
        partitions=[
            pb.ListOffsetsPartition(
                topic=topic,
                partition=partition,
                current_leader_epoch=-1,
                spec=spec,  # type: ignore[arg-type]
                timestamp_ms=timestamp_ms,
            )
        ],
    )


async def read_served(
    stub: broker_pb2_grpc.BrokerServiceStub,
    topic: str,
    partition: int,
    *,
    up_to: int | None = None,
    timeout_s: float | None = None,
) -> bytes:
    """Every batch the broker serves a consumer from offset 0 (so up to its HW), as served:
    fetched until an empty answer, or until the batches reach `up_to`. Any error fails."""
    served = bytearray()
    offset = 0
    while up_to is None or offset < up_to:
        response = await stub.Fetch(consumer_fetch(topic, partition, offset), timeout=timeout_s)
        result = response.partitions[0]
        assert result.error_code == ErrorCode.NONE, (
            ErrorCode.Name(result.error_code),
            result.error_message,
        )
        batches = result.record_batches
        if not batches:
            break
        served += batches
        offset = next_offset(batches)
    return bytes(served)


def log_bytes(log: Log, up_to: int, start: int = 0) -> bytes:
    """Every batch of a broker's log from offset `start` to the one holding `up_to - 1`, as
    stored."""
    stored = bytearray()
    offset = start
    while offset < up_to and (batches := log.read(offset, READ_MAX_BYTES, up_to)):
        stored += batches
        offset = next_offset(batches)
    return bytes(stored)


def next_offset(batches: bytes | memoryview) -> int:
    """The offset after the last of these whole batches."""
    pos = 0
    while True:
        header = read_header(batches, pos)
        pos += header.size
        if pos >= len(batches):
            return header.next_offset
