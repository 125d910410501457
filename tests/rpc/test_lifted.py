from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from tidewater.records.varint import encode_unsigned_varint
from tidewater.rpc.lifted import LIFT_MIN_BYTES, Lifted, Lifter
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import common_pb2

PRODUCE = Lifter(pb.ProduceRequest, "partitions", "record_batch")
FETCH = Lifter(pb.FetchResponse, "partitions", "record_batches")
LARGE = b"\x01" * LIFT_MIN_BYTES


def put_back(lifted: Lifted[pb.ProduceRequest]) -> pb.ProduceRequest:
    """The message as protobuf alone parses it: each lifted view set back into its element."""
    message = pb.ProduceRequest()
    message.CopyFrom(lifted.message)
    for data, view in zip(message.partitions, lifted.views, strict=True):
        if view is not None:
            data.record_batch = bytes(view)
    return message


def test_a_large_requests_batches_come_out_as_views_of_the_received_bytes() -> None:
    request = pb.ProduceRequest(acks=-1, timeout_ms=500, correlation_id=7)
    request.partitions.add(topic="t", partition=0, record_batch=LARGE)
    request.partitions.add(topic="t", partition=1, records=[common_pb2.Record(value=b"v")])
    data = request.partitions.add(topic="u", partition=2, record_batch=b"small")
    data.trace_context["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    raw = request.SerializeToString()
    lifted = PRODUCE.parse(raw)
    assert [None if v is None else bytes(v) for v in lifted.views] == [LARGE, None, b"small"]
    assert all(v is None or v.obj is raw for v in lifted.views)  # no copies
    assert [p.record_batch for p in lifted.message.partitions] == [b""] * 3
    assert put_back(lifted) == request


def test_fields_in_any_order_unknown_ones_and_repeats_parse_as_protobuf_parses_them() -> None:
    element = pb.PartitionProduceData(partition=3, record_batch=b"first").SerializeToString()
    element += pb.PartitionProduceData(record_batch=LARGE, topic="t").SerializeToString()
    element += b"\xf8\x06\x05"  # field 111, a varint nobody knows
    tag = b"\x1a"  # partitions: field 3, length-delimited
    raw = pb.ProduceRequest(correlation_id=9).SerializeToString()
    raw += tag + encode_unsigned_varint(len(element)) + element
    raw += pb.ProduceRequest(acks=1).SerializeToString()
    lifted = PRODUCE.parse(raw)
    assert [bytes(v) for v in lifted.views if v is not None] == [LARGE]  # the last one wins
    assert put_back(lifted) == pb.ProduceRequest.FromString(raw)


def test_fetch_answers_lift_their_records() -> None:
    response = pb.FetchResponse(correlation_id=1, session_id=5)
    response.partitions.add(topic="t", partition=0, high_watermark=10, record_batches=LARGE)
    response.partitions.add(topic="t", partition=1, error_code=3)
    lifted = FETCH.parse(response.SerializeToString())
    assert lifted.views[1] is None and bytes(lifted.views[0] or b"") == LARGE
    assert lifted.message.partitions[0].high_watermark == 10
    assert lifted.message.session_id == 5


def test_small_messages_go_to_protobuf_whole() -> None:
    request = pb.ProduceRequest(partitions=[pb.PartitionProduceData(record_batch=b"x" * 100)])
    lifted = PRODUCE.parse(request.SerializeToString())
    assert lifted.views == [None]
    assert lifted.message == request


@pytest.mark.parametrize(
    "raw",
    [
        LARGE,  # field 0
        b"\x1a\xff\xff\x03" + LARGE,  # a partitions element longer than the message
        b"\x1a\x05" + b"\xff" * 11 + LARGE,  # a varint that never ends
    ],
    ids=["field-0", "overlong", "endless-varint"],
)
def test_what_protobuf_refuses_is_refused(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.ProduceRequest.FromString(raw)
    with pytest.raises(DecodeError):
        PRODUCE.parse(raw)
