"""`tidewater consume`: print a topic's records, like kafka-console-consumer; stops after
--max-messages, after --timeout-ms without a record, or on Ctrl-C."""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import sys
import time
from collections.abc import Callable

from tidewater.client.consumer import Consumer, ConsumerRecord
from tidewater.tools.options import (
    add_connection_options,
    at_least,
    bootstrap,
    check_partitions,
    partition_count,
    partitions_arg,
)

POLL_MS = 500
Writer = Callable[[str, int, ConsumerRecord], None]


def add_parser(commands: argparse._SubParsersAction) -> None:
    consume = commands.add_parser("consume", help="print records of a topic")
    consume.add_argument("--topic", required=True)
    consume.add_argument(
        "--partition", type=partitions_arg, help="partitions to read, e.g. 0,2 (default: all)"
    )
    start = consume.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the earliest record")
    start.add_argument(
        "--offset",
        type=offset_arg,
        default="latest",
        help="start at this offset in each partition read, or earliest / latest (default)",
    )
    start.add_argument(
        "--from-timestamp",
        type=timestamp_arg,
        help="start at the first record at or after this time: epoch milliseconds or "
        "ISO 8601 (e.g. 2026-11-22T10:00:00+00:00)",
    )
    consume.add_argument("--max-messages", type=at_least(1), help="stop after this many records")
    consume.add_argument(
        "--timeout-ms",
        type=at_least(1),
        help="stop when no record came for this long (default: never)",
    )
    consume.add_argument(
        "--format",
        choices=("raw", "json"),
        default="raw",
        help="raw: the value per line (default); json: one object per record",
    )
    consume.add_argument("--print-key", action="store_true", help="raw: print KEY<sep>VALUE")
    consume.add_argument("--key-separator", default="\t", help="raw: with --print-key (tab)")
    add_connection_options(consume)
    consume.set_defaults(run=run)


async def run(args: argparse.Namespace) -> int:
    offset = "earliest" if args.from_beginning else args.offset
    timestamp_ms = args.from_timestamp
    write = _write_json if args.format == "json" else _raw_writer(args)
    limit = args.max_messages
    count = 0
    async with Consumer(
        bootstrap(args),
        auto_offset_reset="earliest" if offset == "earliest" else "latest",
        request_timeout_ms=args.request_timeout_ms,
    ) as consumer:
        count_of_topic = await partition_count(consumer.metadata, args.topic)
        tps = [
            (args.topic, p) for p in check_partitions(args.topic, args.partition, count_of_topic)
        ]
        consumer.assign(tps)
        for tp in tps:
            if timestamp_ms is not None:
                await consumer.seek_to_timestamp(tp, timestamp_ms)
            elif isinstance(offset, int):
                consumer.seek(tp, offset)
        last_record = time.monotonic()
        while limit is None or count < limit:
            fetched = await consumer.poll_partitions(POLL_MS)
            for (topic, partition), records in fetched.items():
                for record in records[: None if limit is None else limit - count]:
                    write(topic, partition, record)
                    count += 1
                    last_record = time.monotonic()
            sys.stdout.flush()
            idle_s = time.monotonic() - last_record
            if args.timeout_ms is not None and idle_s * 1000 >= args.timeout_ms:
                break
    print(f"Processed a total of {count} messages", file=sys.stderr)
    return 0


def offset_arg(text: str) -> int | str:
    """`--offset`: earliest, latest or an offset >= 0."""
    if text in ("earliest", "latest"):
        return text
    try:
        return at_least(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected earliest, latest or an offset >= 0, got {text!r}"
        ) from None


def timestamp_arg(text: str) -> int:
    """`--from-timestamp`: epoch milliseconds or ISO 8601."""
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected epoch milliseconds or ISO 8601, got {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # local time, as a user typing it means
    return int(moment.timestamp() * 1000)


def _raw_writer(args: argparse.Namespace) -> Writer:
    out = sys.stdout.buffer
    separator = args.key_separator.encode()

    def write(topic: str, partition: int, record: ConsumerRecord) -> None:
        if args.print_key:
            out.write(b"null" if record.key is None else record.key)
            out.write(separator)
        out.write(b"null" if record.value is None else record.value)
        out.write(b"\n")

    return write


def _write_json(topic: str, partition: int, record: ConsumerRecord) -> None:
    document: dict[str, object] = {
        "topic": topic,
        "partition": partition,
        "offset": record.offset,
        "timestamp": record.timestamp_ms,
        "leader_epoch": record.leader_epoch,
    }
    document.update(_bytes_field("key", record.key))
    document.update(_bytes_field("value", record.value))
    document["headers"] = [
        {"key": key, **_bytes_field("value", value)} for key, value in record.headers
    ]
    sys.stdout.write(json.dumps(document) + "\n")


def _bytes_field(name: str, data: bytes | None) -> dict[str, object]:
    """UTF-8 text under `name`; other bytes base64 under `name`_base64; None as null."""
    if data is None:
        return {name: None}
    try:
        return {name: data.decode()}
    except UnicodeDecodeError:
        return {f"{name}_base64": base64.b64encode(data).decode()}
