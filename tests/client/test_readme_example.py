"""The README's Python SDK example, run as it stands against a real local cluster."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.client.cluster import Cluster

README = Path(__file__).resolve().parents[2] / "README.md"


def sdk_example() -> str:
    """The first code block (lines indented four spaces) of the README's Python SDK section."""
    section = README.read_text().split("\n## Python SDK\n", 1)[1]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block)


async def test_the_readme_sdk_example_prints_the_record_it_sent(cluster: Cluster) -> None:
    await cluster.create_topic("orders")
    code = sdk_example()
    assert "asyncio.run(main())" in code
    # A child process, as a user runs it: the brokers serve on this test's event loop.
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # What `cluster up` says to export.
        env={**os.environ, "TIDEWATER_BOOTSTRAP": ",".join(cluster.bootstrap)},
    )
    try:
        async with asyncio.timeout(60):
            out, err = await child.communicate()
    finally:
        if child.returncode is None:  # the deadline passed: no process outlives the test
            child.kill()
            await child.wait()
    assert child.returncode == 0, err.decode()
    assert out.decode().splitlines() == ["0 b'customer-7' b'hello'"]
