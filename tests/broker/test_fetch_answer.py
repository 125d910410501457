"""A FetchAnswer's wire bytes are a FetchResponse that any protobuf reader parses."""

from __future__ import annotations

from tidewater.broker.fetch_answer import FetchAnswer
from tidewater.records.batch import Record, build_batch
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import common_pb2
from tidewater.v1.errors_pb2 import ErrorCode


def test_serialized_answer_parses_to_the_response_with_records_in_place() -> None:
    small = build_batch([Record(value=b"v")])
    # Over 2 MiB: its length takes a four-byte varint.
    large = build_batch([Record(value=bytes(1024)) for _ in range(1014)]) * 3
    served = pb.FetchPartitionResponse(
        topic="t", partition=0, high_watermark=4, log_start_offset=0, log_end_offset=9
    )
    other = pb.FetchPartitionResponse(topic="t", partition=1, high_watermark=1)
    failed = pb.FetchPartitionResponse(
        topic="t", partition=2, error_code=ErrorCode.NOT_LEADER_OR_FOLLOWER, error_message="no"
    )
    decoded = pb.FetchPartitionResponse(topic="u", partition=0, high_watermark=1)
    decoded.records.append(common_pb2.Record(offset=0, value=b"v"))
    header = pb.FetchResponse(correlation_id=7, session_id=3)

    answer = FetchAnswer(header, [(served, large), (other, small), (failed, b""), (decoded, b"")])

    expected = pb.FetchResponse(correlation_id=7, session_id=3)
    for response, records in answer.partitions:
        partition = expected.partitions.add()
        partition.CopyFrom(response)
        partition.record_batches = records
    parsed = pb.FetchResponse.FromString(answer.serialize())
    assert parsed == expected
    assert parsed.partitions[0].record_batches == large
    assert parsed.partitions[1].record_batches == small


def test_an_answer_without_partitions_is_its_header() -> None:
    header = pb.FetchResponse(
        correlation_id=1, error_code=ErrorCode.FETCH_SESSION_ID_NOT_FOUND, error_message="gone"
    )
    answer = FetchAnswer(header)
    assert pb.FetchResponse.FromString(answer.serialize()) == header
    assert (answer.error_code, answer.error_message) == (header.error_code, "gone")
