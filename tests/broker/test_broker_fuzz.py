"""Property test: random and mutated batches sent to a real broker are either stored and served
back byte-identical, or rejected with a named error. The broker never crashes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.records.strategies import batches
from tidewater.broker.config import BrokerConfig
from tidewater.broker.server import BrokerServer
from tidewater.local.fetch import consumer_fetch
from tidewater.local.standin_controller import leader_and_isr_request
from tidewater.records.header import read_header
from tidewater.rpc.server import CHANNEL_OPTIONS
from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc
from tidewater.v1.errors_pb2 import ErrorCode

TOPIC = "fuzz"
# Errors a defective batch may earn; anything else (UNKNOWN_SERVER_ERROR above all) is a bug.
NAMED_REJECTIONS = {
    ErrorCode.CORRUPT_MESSAGE,
    ErrorCode.MESSAGE_TOO_LARGE,
    ErrorCode.UNSUPPORTED_COMPRESSION_TYPE,
    ErrorCode.UNSUPPORTED_VERSION,
    ErrorCode.INVALID_REQUEST,
    ErrorCode.INVALID_TIMESTAMP,
}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[broker_pb2_grpc.BrokerServiceStub]:
    """One broker on its own event loop thread, so hypothesis can drive it synchronously."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = BrokerConfig.from_properties(
        {
            "broker.id": 1,
            "listeners": "127.0.0.1:0",
            "log.dirs": str(Path(tmp_path_factory.mktemp("fuzz")) / "broker-1"),
            "message.max.bytes": 200_000,
        }
    )

    async def start() -> BrokerServer:
        server = BrokerServer(config)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
    control = broker_pb2_grpc.BrokerControlStub(channel)
    control.LeaderAndIsr(leader_and_isr_request(TOPIC, 0, leader=1, leader_epoch=1, replicas=[1]))
    try:
        yield broker_pb2_grpc.BrokerServiceStub(channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


BATCHES = batches(max_records=20, max_value=300)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(BATCHES))
    kind = draw(st.sampled_from(["none", "flip", "truncate", "extend", "overwrite", "random"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            pos = draw(st.integers(0, len(data) - 1))
            data[pos] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif kind == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "overwrite":
        pos = draw(st.integers(0, 60))
        chunk = draw(st.binary(min_size=1, max_size=8))
        data[pos : pos + len(chunk)] = chunk
    elif kind == "random":
        return draw(st.binary(max_size=400))
    return bytes(data)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=mutated())
def test_every_batch_is_stored_intact_or_rejected_by_name(
    broker: broker_pb2_grpc.BrokerServiceStub, batch: bytes
) -> None:
    response = broker.Produce(
        pb.ProduceRequest(
            acks=1,
            partitions=[pb.PartitionProduceData(topic=TOPIC, partition=0, record_batch=batch)],
        )
    )
    result = response.partitions[0]
    if result.error_code != ErrorCode.NONE:
        assert result.error_code in NAMED_REJECTIONS, (
            ErrorCode.Name(result.error_code),
            result.error_message,
        )
        assert result.error_message
        return
    fetched = broker.Fetch(consumer_fetch(TOPIC, 0, result.base_offset, max_bytes=1))
    served = fetched.partitions[0].record_batches
    header = read_header(served)
    assert header.base_offset == result.base_offset
    assert served[: header.size][17:] == batch[17:]
