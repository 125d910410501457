"""CPU per message of parsing what carries record batches: protobuf alone vs tidewater.rpc.lifted.

    .venv/bin/python tests/benchmarks/bench_lifted.py [--count 400] [--rounds 3]

A leader's produce request (then the bytearray it stamps offsets into) and a follower's fetch
answer, each holding one 1 MiB batch of 1 KiB records; with the brokers' malloc settings
(tidewater.rpc.allocator) and messages rotated over more memory than the CPU caches hold, as a
broker receives them. Modes alternate by round; the best round of each counts.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from tidewater.broker.fetch_answer import FetchAnswer
from tidewater.records.batch import Record, build_batch
from tidewater.rpc.allocator import tune_for_large_messages
from tidewater.rpc.lifted import Lifter
from tidewater.v1 import broker_pb2 as pb

MESSAGES = 16  # distinct 1 MiB messages in turn: 16 MiB, above the CPU caches


def messages() -> tuple[list[bytes], list[bytes]]:
    batch = build_batch([Record(value=os.urandom(1024)) for _ in range(1014)])
    data = pb.PartitionProduceData(topic="rf3", partition=0, record_batch=batch)
    produce = pb.ProduceRequest(acks=-1, partitions=[data]).SerializeToString()
    answer = FetchAnswer(
        pb.FetchResponse(correlation_id=5, session_id=3),
        [(pb.FetchPartitionResponse(topic="rf3", partition=0, high_watermark=1 << 20), batch)],
    ).serialize()
    # Each its own buffer, as each message gRPC receives is.
    return [bytes(bytearray(produce)) for _ in range(MESSAGES)], [
        bytes(bytearray(answer)) for _ in range(MESSAGES)
    ]


def cpu_us(parse: Callable[[bytes], object], raw: list[bytes], count: int) -> float:
    for i in range(MESSAGES):
        parse(raw[i])
    started = time.process_time()
    for i in range(count):
        parse(raw[i % MESSAGES])
    return (time.process_time() - started) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tune_for_large_messages()
    produce, answers = messages()
    produce_lifter = Lifter(pb.ProduceRequest, "partitions", "record_batch")
    fetch_lifter = Lifter(pb.FetchResponse, "partitions", "record_batches")
    modes: dict[str, tuple[Callable[[bytes], object], list[bytes]]] = {
        "produce, protobuf": (
            lambda raw: bytearray(pb.ProduceRequest.FromString(raw).partitions[0].record_batch),
            produce,
        ),
        "produce, lifted": (lambda raw: bytearray(produce_lifter.parse(raw).views[0]), produce),
        "fetch answer, protobuf": (
            lambda raw: pb.FetchResponse.FromString(raw).partitions[0].record_batches,
            answers,
        ),
        "fetch answer, lifted": (lambda raw: fetch_lifter.parse(raw).views[0], answers),
    }
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(args.rounds):
        for name, (parse, raw) in modes.items():
            best[name] = min(best[name], cpu_us(parse, raw, args.count))
    for name, us in best.items():
        print(f"{name:24} {us:7.1f} us CPU per 1 MiB message")
    print(
        "SUMMARY lifted: produce "
        f"{best['produce, protobuf']:.0f} -> {best['produce, lifted']:.0f} us, fetch answer "
        f"{best['fetch answer, protobuf']:.0f} -> {best['fetch answer, lifted']:.0f} us per MiB"
    )


if __name__ == "__main__":
    main()
