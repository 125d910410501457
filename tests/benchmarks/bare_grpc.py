"""Bare grpc.aio references and the load client of bench_replication.py. Imports no Tidewater
code, so reference measurements run with none in the process tree, and the client side of
every measurement (reference or Tidewater) is the same code sending the same raw bytes.

    python bare_grpc.py echo --ready FILE
    python bare_grpc.py relay-follower --ready FILE --out FILE
    python bare_grpc.py relay-leader --ready FILE --followers HOST:PORT,HOST:PORT
    python bare_grpc.py client MODE --address HOST:PORT --method PATH --payload FILE [...]

Servers write their address to the ready file once serving and run until killed. The client
prints one JSON object: latency percentiles in ms, or throughput in MB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

# The same limits as Tidewater's channels and servers, so both sides run with equal settings.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 128 * 1024 * 1024),
    ("grpc.max_receive_message_length", 128 * 1024 * 1024),
]
SERVICE = "bench.Reference"
ECHO_STREAM = f"/{SERVICE}/EchoStream"
ECHO_UNARY = f"/{SERVICE}/Echo"
RELAY = f"/{SERVICE}/Relay"
RELAY_STREAM = f"/{SERVICE}/RelayStream"
REPLICATE = f"/{SERVICE}/Replicate"
ACK = b"ok"
WARMUP = 20
CALL_TIMEOUT_S = 60.0
# The broker's default cache.drop.behind.bytes, and how often its log applies it.
DROP_BEHIND_BYTES = 64 * 1024 * 1024
DROP_STEP = 4 * 1024 * 1024
DONTNEED = os.POSIX_FADV_DONTNEED


class AppendFile:
    """An append-only file written unbuffered (the OS flushes when it likes, the log's default
    flush policy) that keeps about `drop_behind` bytes of its tail in the page cache, as the
    log does by default (cache.drop.behind.bytes); -1 leaves the page cache to the OS. The
    same few lines as the log's, repeated so that references import no Tidewater code."""

    def __init__(self, path: Path, drop_behind: int = DROP_BEHIND_BYTES) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._drop_behind = drop_behind
        self._size = self._drop_from = self._dropped_to = 0
        self._dropper = ThreadPoolExecutor(max_workers=1)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
            self._size += written
        end = self._size - self._drop_behind
        if self._drop_behind >= 0 and end - self._dropped_to >= DROP_STEP:
            length = end - self._drop_from
            # Off the caller's thread, as the log does: the call may wait for the disk.
            self._dropper.submit(os.posix_fadvise, self._fd, self._drop_from, length, DONTNEED)
            self._drop_from, self._dropped_to = self._dropped_to, end

    def close(self) -> None:
        self._dropper.shutdown()
        os.close(self._fd)


# -- servers -----------------------------------------------------------------------------


async def serve(handlers: dict[str, grpc.RpcMethodHandler], ready_file: Path) -> None:
    # Without SO_REUSEPORT, as Tidewater's servers bind.
    server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tmp = ready_file.with_suffix(".tmp")
    tmp.write_text(f"127.0.0.1:{port}")
    tmp.rename(ready_file)
    await server.wait_for_termination()


def echo_handlers() -> dict[str, grpc.RpcMethodHandler]:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def echo_stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request

    return {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream),
    }


def follower_handlers(out: Path) -> dict[str, grpc.RpcMethodHandler]:
    """Appends every message to an AppendFile and acks it."""

    async def replicate(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        f = AppendFile(out)
        try:
            async for request in requests:
                f.write(request)
                yield ACK
        finally:
            f.close()

    return {"Replicate": grpc.stream_stream_rpc_method_handler(replicate)}


class FollowerStream:
    """A long-lived Replicate stream to one follower; its acks come back in send order."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._call = channel.stream_stream(REPLICATE)()
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._write_lock = asyncio.Lock()
        self._reader = asyncio.create_task(self._read_acks())

    async def send(self, data: bytes) -> asyncio.Future[None]:
        """Write data; the returned future resolves when the follower acks it."""
        acked = asyncio.get_running_loop().create_future()
        async with self._write_lock:  # one write at a time, acks queued in write order
            self._waiting.append(acked)
            await self._call.write(data)
        return acked

    async def _read_acks(self) -> None:
        try:
            async for _ in self._call:
                self._waiting.popleft().set_result(None)
            raise ConnectionError("follower closed its stream")
        except Exception as e:
            while self._waiting:
                self._waiting.popleft().set_exception(e)
            raise


async def relay_leader(followers: list[str], ready_file: Path) -> None:
    """Answers each message (unary Relay, or in order on a RelayStream) once every follower
    acked the same bytes."""
    channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in followers]
    streams = [FollowerStream(channel) for channel in channels]

    async def forward(request: bytes) -> asyncio.Future[list[None]]:
        acks = await asyncio.gather(*(stream.send(request) for stream in streams))
        return asyncio.gather(*acks)

    async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await (await forward(request))
        return ACK

    async def relay_stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # Forward each message as it arrives, without waiting for earlier acks.
        forwarded: asyncio.Queue[asyncio.Future[list[None]] | None] = asyncio.Queue()

        async def forward_all() -> None:
            try:
                async for request in requests:
                    forwarded.put_nowait(await forward(request))
            finally:
                forwarded.put_nowait(None)

        forwarding = asyncio.create_task(forward_all())
        try:
            while (acked := await forwarded.get()) is not None:
                await acked
                yield ACK
        finally:
            forwarding.cancel()

    await serve(
        {
            "Relay": grpc.unary_unary_rpc_method_handler(relay),
            "RelayStream": grpc.stream_stream_rpc_method_handler(relay_stream),
        },
        ready_file,
    )


# -- client ------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def latency_summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {
        "count": len(ms),
        "p50_ms": percentile(ms, 0.50),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": ms[-1],
    }


async def read_one(call: grpc.aio.StreamStreamCall) -> bytes:
    response = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
    if response is grpc.aio.EOF:
        raise ConnectionError("server closed the stream")
    return response


async def stream_round_trips(
    channel: grpc.aio.Channel, method: str, payload: bytes, count: int
) -> dict[str, float]:
    """Send one message on an open stream, wait for its answer, repeat."""
    call = channel.stream_stream(method)()
    latencies = []
    for i in range(WARMUP + count):
        started = time.perf_counter()
        await call.write(payload)
        await read_one(call)
        if i >= WARMUP:
            latencies.append(time.perf_counter() - started)
    await call.done_writing()
    return {**latency_summary(latencies), "calls": WARMUP + count}


async def unary_round_trips(
    channel: grpc.aio.Channel, method: str, payload: bytes, count: int
) -> dict[str, float]:
    """One unary call, wait for its answer, repeat."""
    call = channel.unary_unary(method)
    latencies = []
    for i in range(WARMUP + count):
        started = time.perf_counter()
        await call(payload, timeout=CALL_TIMEOUT_S)
        if i >= WARMUP:
            latencies.append(time.perf_counter() - started)
    return {**latency_summary(latencies), "calls": WARMUP + count}


async def unary_throughput(
    channel: grpc.aio.Channel, method: str, payload: bytes, seconds: float, in_flight: int
) -> dict[str, float]:
    """Send payload back to back on `in_flight` concurrent unary calls for `seconds`."""
    call = channel.unary_unary(method)
    for _ in range(3):
        await call(payload, timeout=CALL_TIMEOUT_S)
    calls = 0
    started = time.perf_counter()
    deadline = started + seconds

    async def worker() -> None:
        nonlocal calls
        while time.perf_counter() < deadline:
            await call(payload, timeout=CALL_TIMEOUT_S)
            calls += 1

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    elapsed = time.perf_counter() - started
    return {
        "calls": calls + 3,  # the servers saw the warm-up calls too
        "mb_per_s": calls * len(payload) / elapsed / 1e6,
    }


async def paced_stream(
    channel: grpc.aio.Channel, method: str, payload: bytes, rate_hz: float, count: int
) -> dict[str, float]:
    """Open-loop: send on a fixed schedule without waiting for answers (which come back in
    order). Latency counts from the scheduled send time, so a sender held up by a slow server
    is charged to the server rather than hidden (coordinated omission)."""
    call = channel.stream_stream(method)()
    for _ in range(3):
        await call.write(payload)
        await read_one(call)
    scheduled: deque[float] = deque()
    latencies: list[float] = []

    async def read_answers() -> None:
        for _ in range(count):
            await read_one(call)
            latencies.append(time.perf_counter() - scheduled.popleft())

    reader = asyncio.create_task(read_answers())
    try:
        start = time.perf_counter()
        for i in range(count):
            at = start + i / rate_hz
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            scheduled.append(at)
            await call.write(payload)
        await asyncio.wait_for(reader, CALL_TIMEOUT_S)
    finally:
        reader.cancel()
    elapsed = time.perf_counter() - start
    await call.done_writing()
    summary = latency_summary(latencies)
    summary["calls"] = count + 3
    summary["mb_per_s"] = count * len(payload) / elapsed / 1e6
    return summary


CLIENT_MODES: dict[str, Callable[..., Any]] = {
    "stream-rtt": stream_round_trips,
    "unary-rtt": unary_round_trips,
    "unary-throughput": unary_throughput,
    "paced-stream": paced_stream,
}


async def run_client(args: argparse.Namespace) -> dict[str, float]:
    payload = args.payload.read_bytes()
    extra: dict[str, Any] = {}
    if args.mode in ("stream-rtt", "unary-rtt", "paced-stream"):
        extra["count"] = args.count
    if args.mode == "unary-throughput":
        extra.update(seconds=args.seconds, in_flight=args.in_flight)
    if args.mode == "paced-stream":
        extra["rate_hz"] = args.rate_hz
    async with grpc.aio.insecure_channel(args.address, options=CHANNEL_OPTIONS) as channel:
        result: dict[str, float] = await CLIENT_MODES[args.mode](
            channel, args.method, payload, **extra
        )
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    roles = parser.add_subparsers(dest="role", required=True)
    for role in ("echo", "relay-follower", "relay-leader"):
        server = roles.add_parser(role)
        server.add_argument("--ready", type=Path, required=True)
        if role == "relay-follower":
            server.add_argument("--out", type=Path, required=True)
        if role == "relay-leader":
            server.add_argument("--followers", required=True)
    client = roles.add_parser("client")
    client.add_argument("mode", choices=sorted(CLIENT_MODES))
    client.add_argument("--address", required=True)
    client.add_argument("--method", required=True)
    client.add_argument("--payload", type=Path, required=True)
    client.add_argument("--count", type=int, default=2000)
    client.add_argument("--seconds", type=float, default=5.0)
    client.add_argument("--in-flight", type=int, default=4)
    client.add_argument("--rate-hz", type=float, default=10.0)
    args = parser.parse_args()
    if args.role == "echo":
        asyncio.run(serve(echo_handlers(), args.ready))
    elif args.role == "relay-follower":
        asyncio.run(serve(follower_handlers(args.out), args.ready))
    elif args.role == "relay-leader":
        asyncio.run(relay_leader(args.followers.split(","), args.ready))
    else:
        print(json.dumps(asyncio.run(run_client(args))))


if __name__ == "__main__":
    main()
