"""`tidewater produce`: one record per input line (stdin or a file), like
kafka-console-producer; with --key-separator each line is KEY<sep>VALUE."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from tidewater.client.errors import DeliveryTimeout, error_for
from tidewater.client.producer import COMPRESSIONS, DEFAULTS, Producer, RecordFuture
from tidewater.errors import InvalidRequest
from tidewater.tools.options import (
    UsageError,
    add_connection_options,
    at_least,
    bootstrap,
    check_partitions,
    partition_count,
)

READ_SIZE = 256 * 1024


def acks_arg(text: str) -> int:
    """Kafka's acks values: all (= -1), -1, 0, 1."""
    acks = {"all": -1, "-1": -1, "0": 0, "1": 1}.get(text)
    if acks is None:
        raise argparse.ArgumentTypeError(f"acks must be all, -1, 0 or 1, got {text!r}")
    return acks


def add_producer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--acks", type=acks_arg, default=-1, help="all (default), 1 or 0")
    parser.add_argument(
        "--compression",
        choices=[c for c in COMPRESSIONS if c],
        default="none",
        help="default none",
    )
    parser.add_argument("--linger-ms", type=at_least(0), default=5, help="default 5")
    parser.add_argument(
        "--batch-size", type=at_least(1), default=16384, help="bytes (default 16384)"
    )
    parser.add_argument(
        "--delivery-timeout-ms",
        type=at_least(1),
        default=DEFAULTS["delivery_timeout_ms"],
        help="give up on a record not acknowledged within this long, retries included "
        "(default %(default)s)",
    )


def producer_config(args: argparse.Namespace) -> dict[str, object]:
    """The SDK producer's settings; idempotence (the default) needs acks=all, so other acks
    turn it off as Kafka's producer does when acks is set explicitly."""
    if args.delivery_timeout_ms < args.linger_ms + args.request_timeout_ms:
        raise UsageError(
            "--delivery-timeout-ms must be at least --linger-ms + --request-timeout-ms "
            f"({args.linger_ms + args.request_timeout_ms}), got {args.delivery_timeout_ms}"
        )
    return {
        "acks": args.acks,
        "compression": args.compression,
        "linger_ms": args.linger_ms,
        "batch_size": args.batch_size,
        "request_timeout_ms": args.request_timeout_ms,
        "delivery_timeout_ms": args.delivery_timeout_ms,
        "enable_idempotence": args.acks == -1,
    }


def delivery_failure(error: BaseException, args: argparse.Namespace) -> BaseException:
    """What a failed record's error says on the command line: a delivery timeout after
    retriable errors leads with the last one (NOT_ENOUGH_REPLICAS, ...), which is what to
    fix, and says how long it was retried."""
    if isinstance(error, DeliveryTimeout) and error.last_error is not None:
        last = error.last_error
        return error_for(
            last.code,
            f"{last.message} (still failing after retrying for --delivery-timeout-ms "
            f"{args.delivery_timeout_ms}; not produced)",
        )
    return error


def add_parser(commands: argparse._SubParsersAction) -> None:
    produce = commands.add_parser("produce", help="produce one record per line of stdin or a file")
    produce.add_argument("--topic", required=True)
    produce.add_argument("--file", type=Path, help="read lines from this file (default: stdin)")
    produce.add_argument(
        "--key-separator",
        help="split each line at the first SEP into key and value (default: no key)",
    )
    produce.add_argument(
        "--partition",
        type=at_least(0),
        help="send every record to this partition (default: by key)",
    )
    add_producer_options(produce)
    add_connection_options(produce)
    produce.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    separator = args.key_separator.encode() if args.key_separator is not None else None
    if separator == b"":
        raise UsageError("--key-separator must not be empty")
    config = producer_config(args)
    source = args.file.open("rb") if args.file is not None else sys.stdin.buffer
    sent = 0
    failures: list[BaseException] = []

    def delivered(future: RecordFuture) -> None:
        if not future.cancelled() and future.exception() is not None:
            failures.append(future.exception())  # type: ignore[arg-type]

    try:
        async with Producer(bootstrap(args), **config) as producer:
            count = await partition_count(producer.metadata, args.topic)
            if args.partition is not None:
                check_partitions(args.topic, [args.partition], count)
            async for number, line in _lines(source):
                key, value = _split(line, separator, number)
                future = await producer.send(args.topic, value, key=key, partition=args.partition)
                future.add_done_callback(delivered)
                sent += 1
                if failures:
                    break
            await producer.flush()
    finally:
        if args.file is not None:
            source.close()
    if failures:
        raise delivery_failure(failures[0], args)
    records = "record" if sent == 1 else "records"
    print(f"Produced {sent} {records} to {args.topic}.", file=sys.stderr)
    return 0


def _split(line: bytes, separator: bytes | None, number: int) -> tuple[bytes | None, bytes]:
    if separator is None:
        return None, line
    key, sep, value = line.partition(separator)
    if not sep:
        raise InvalidRequest(f"line {number} has no key separator {separator.decode()!r}")
    return key, value


async def _lines(source: BinaryIO) -> AsyncIterator[tuple[int, bytes]]:
    """(line number, line without its newline). A daemon thread reads, so the producer keeps
    sending while a terminal waits for the next line, and Ctrl-C does not wait for one."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[bytes] = asyncio.Queue(maxsize=4)
    fd = source.fileno()

    def read() -> None:
        while True:
            chunk = os.read(fd, READ_SIZE)
            asyncio.run_coroutine_threadsafe(chunks.put(chunk), loop).result()
            if not chunk:
                return

    threading.Thread(target=read, name="stdin-reader", daemon=True).start()
    pending = b""
    number = 0
    while chunk := await chunks.get():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            number += 1
            yield number, line
    if pending:
        yield number + 1, pending
