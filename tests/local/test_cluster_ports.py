"""The local cluster's ports: each process binds its own (port 0) and reports it back, and a
restart's recorded port that another process took gives way to a fresh one."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tidewater.local import cluster as cluster_mod
from tidewater.local.cluster import ClusterFile, LocalCluster, Member


def test_a_recorded_port_taken_after_the_check_gives_way_to_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the metrics port was chosen free here and bound later by the process: taken
    in between (a deterministic stand-in for another process's bind), the start failed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # What the last run recorded, and a check that saw the port free before it was taken.
        ClusterFile(tmp_path, 0, (Member("metadata", 1, f"127.0.0.1:{port}", 0, port),)).write()
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
