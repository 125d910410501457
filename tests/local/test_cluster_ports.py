"""The local cluster's ports: each process binds its own (port 0) and reports it back, and a
restart's recorded port that another process took gives way to a fresh one."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tidewater.local import cluster as cluster_mod
from tidewater.local.cluster import LocalCluster, Member, PortsFile


def test_a_recorded_port_taken_after_the_check_gives_way_to_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the metrics port was chosen free here and bound later by the process: taken
    in between (a deterministic stand-in for another process's bind), the start failed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # What the last run recorded, and a check that saw the port free before it was taken.
        PortsFile(tmp_path).write((Member("metadata", 1, f"127.0.0.1:{port}", 0, port),), 0)
        monkeypatch.setattr(cluster_mod, "_port_if_free", lambda p: p)
        cluster = LocalCluster(tmp_path, brokers=1)
        try:
            state = cluster.start()
        finally:
            cluster.stop()
    ports = {m.role: (m.port, m.metrics_port) for m in state.members}
    metadata_port, metadata_metrics = ports["metadata"]
    assert port not in (metadata_port, metadata_metrics)
    # Every process reported the metrics port it bound.
    assert all(metrics for role, (_, metrics) in ports.items()), ports
    assert (
        "tidewater: metadata 1: recorded ports taken, fresh ones instead" in capsys.readouterr().err
    )
