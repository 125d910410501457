"""`tidewater produce` and `bench produce` as a user runs them, against the in-process cluster
(child processes: the brokers serve on this test's event loop)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.client.cluster import Cluster

DEADLINE_S = 60


async def tidewater(*args: str, stdin: bytes = b"") -> tuple[int, str]:
    """Exit status and stderr of `tidewater ARGS`."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tidewater",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(DEADLINE_S):
            _, err = await child.communicate(stdin)
    finally:
        if child.returncode is None:  # the deadline passed: no process outlives the test
            child.kill()
            await child.wait()
    assert child.returncode is not None
    return child.returncode, err.decode()


async def test_produce_counts_records_in_words(cluster: Cluster) -> None:
    await cluster.create_topic("words")
    bootstrap = ("--bootstrap", cluster.bootstrap[0])
    assert await tidewater("produce", "--topic", "words", *bootstrap, stdin=b"a\n") == (
        0,
        "Produced 1 record to words.\n",
    )
    assert await tidewater("produce", "--topic", "words", *bootstrap, stdin=b"a\nb\n") == (
        0,
        "Produced 2 records to words.\n",
    )


@pytest.mark.parametrize(
    "command",
    [
        ["produce"],
        ["bench", "produce", "--num-records", "1", "--record-size", "10", "--throughput", "-1"],
    ],
)
async def test_a_produce_retried_until_its_delivery_timeout_leads_with_the_last_error(
    cluster: Cluster, command: list[str]
) -> None:
    """ISR [1, 2] below min.insync.replicas=3: every attempt is answered NOT_ENOUGH_REPLICAS,
    retried (as Kafka's producer does) until --delivery-timeout-ms, and the error line names
    that error, not the timeout."""
    cluster.controller.configs["short"] = {"min.insync.replicas": "3"}
    # Broker 4 does not exist: the ISR stays [1, 2] of the replicas [1, 2, 4].
    await cluster.controller.elect("short", 0, leader=1, replicas=[1, 2, 4], isr=[1, 2])
    await cluster.publish()
    status, stderr = await tidewater(
        *command,
        "--topic",
        "short",
        "--bootstrap",
        cluster.bootstrap[0],
        "--request-timeout-ms",
        "500",
        "--delivery-timeout-ms",
        "1500",
        stdin=b"x\n",
    )
    assert status == 1, stderr
    assert stderr.startswith(
        "tidewater: NOT_ENOUGH_REPLICAS: short-0: ISR [1, 2] is smaller than min.insync.replicas=3"
    ), stderr
    assert "after retrying for --delivery-timeout-ms 1500" in stderr
    assert stderr.count("\n") == 1, stderr
