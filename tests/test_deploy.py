"""deploy/: the production broker config and the systemd units, held to the code that runs them.

The units' command lines go through Tidewater's own CLI parser with the example environment
files substituted as systemd does, so a renamed flag or config key fails here, not on a host.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tidewater import cli
from tidewater.broker.config import BrokerConfig
from tidewater.broker.server import STOP_GRACE_S
from tidewater.broker.topic_config import TopicConfig
from tidewater.errors import InvalidConfig
from tidewater.local.cluster import SERVING, grpc_health
from tidewater.local.etcd import free_port
from tidewater.local.process import ManagedProcess

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
BROKER_TOML = DEPLOY / "config" / "broker.toml"
UNITS = {
    "broker": DEPLOY / "systemd" / "tidewater-broker.service",
    "controller": DEPLOY / "systemd" / "tidewater-controller.service",
    "metadata": DEPLOY / "systemd" / "tidewater-metadata.service",
}
# Where deploy/README.md installs the example files.
ETC = Path("/etc/tidewater")
INSTALLED = {
    ETC / "broker.toml": BROKER_TOML,
    **{ETC / f"{role}.env": DEPLOY / "systemd" / f"{role}.env" for role in UNITS},
}
# systemd substitutes ${VAR} anywhere in a word (one argument), $VAR only as a whole word
# (split at whitespace).
BRACED = re.compile(r"\$\{(\w+)\}")
WHOLE_WORD = re.compile(r"\$(\w+)")


def read_unit(path: Path) -> dict[str, dict[str, str]]:
    """A unit file's sections, key → value; a line ending in a backslash goes on on the next."""
    sections: dict[str, dict[str, str]] = {}
    section: dict[str, str] = {}
    for raw in path.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        section[key.strip()] = value.strip()
    return sections


def read_environment_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep and key.isidentifier(), f"{path.name}: not KEY=VALUE: {line!r}"
        env[key] = value
    return env


def command_line(exec_start: str, env: dict[str, str]) -> list[str]:
    """ExecStart= as systemd runs it with `env`."""
    argv: list[str] = []
    for word in shlex.split(exec_start):
        whole = WHOLE_WORD.fullmatch(word)
        if whole:
            argv += env[whole[1]].split()
        else:
            argv.append(BRACED.sub(lambda m: env[m[1]], word))
    return argv


def unit_environment(role: str) -> dict[str, str]:
    installed = Path(read_unit(UNITS[role])["Service"]["EnvironmentFile"])
    assert installed in INSTALLED, f"{UNITS[role].name} reads {installed}, not an example file"
    return read_environment_file(INSTALLED[installed])


def parsed_unit(role: str, **edits: str) -> argparse.Namespace:
    """The unit's ExecStart through `tidewater`'s own parser, with the example environment
    file (and `edits` to it, as an operator would make)."""
    env = {**unit_environment(role), **edits}
    argv = command_line(read_unit(UNITS[role])["Service"]["ExecStart"], env)
    assert Path(argv[0]).name == "tidewater"
    try:
        args = cli.parser().parse_args(argv[1:])
    except SystemExit as e:
        raise AssertionError(f"{UNITS[role].name}: tidewater refuses {argv[1:]}") from e
    assert args.command == role
    return args


def broker_unit_config(**edits: str) -> BrokerConfig:
    """The config tidewater-broker.service runs with: broker.toml under the unit's flags."""
    args = parsed_unit("broker", **edits)
    assert args.config in INSTALLED
    args.config = INSTALLED[args.config]
    return cli.broker_config(args)


@pytest.mark.parametrize("role", UNITS)
def test_every_variable_a_unit_uses_is_in_its_environment_file(role: str) -> None:
    exec_start = read_unit(UNITS[role])["Service"]["ExecStart"]
    used = set(BRACED.findall(exec_start)) | {
        m[1] for word in shlex.split(exec_start) if (m := WHOLE_WORD.fullmatch(word))
    }
    assert used, exec_start
    assert used <= set(unit_environment(role)), used - set(unit_environment(role))
    # Anything else with a $ would reach tidewater as it is written.
    assert all("$" not in arg for arg in command_line(exec_start, unit_environment(role)))


@pytest.mark.parametrize("role", UNITS)
def test_unit_command_line_is_accepted_by_the_cli(role: str) -> None:
    args = parsed_unit(role)
    assert args.listen == unit_environment(role)["TIDEWATER_LISTEN"]
    assert args.metrics_port == int(unit_environment(role)["TIDEWATER_METRICS_PORT"])


@pytest.mark.parametrize("role", UNITS)
def test_unit_restarts_on_failure_and_stops_with_sigterm(role: str) -> None:
    service = read_unit(UNITS[role])["Service"]
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["LimitNOFILE"]) >= 65536


def test_broker_unit_runs_with_the_deploy_broker_toml() -> None:
    config = broker_unit_config()
    env = unit_environment("broker")
    assert config.broker_id == int(env["TIDEWATER_BROKER_ID"])
    assert config.listen_address == env["TIDEWATER_LISTEN"]
    # The example's empty advertised address: the broker registers its listen address.
    assert str(config.advertised_address(config.port)) == env["TIDEWATER_LISTEN"]
    assert config.rack == env["TIDEWATER_RACK"]
    assert config.log_dirs == (Path("/var/lib/tidewater/data"),)
    assert config.topic_defaults["min.insync.replicas"] == "2"
    assert config.topic_defaults["retention.ms"] == "604800000"
    assert config.controlled_shutdown_timeout_ms == 15000
    assert config.replica_lag_time_max_ms == 30000
    assert config.producer_id_expiration_ms == 86400000
    # The topic defaults as the broker reads them when it starts.
    assert TopicConfig.from_properties(dict(config.topic_defaults)).min_insync_replicas == 2


def test_broker_unit_binds_all_interfaces_with_an_advertised_address() -> None:
    config = broker_unit_config(
        TIDEWATER_LISTEN="0.0.0.0:9092", TIDEWATER_ADVERTISED="broker-1.internal:9092"
    )
    assert (config.host, str(config.advertised_address(9092))) == (
        "0.0.0.0",
        "broker-1.internal:9092",
    )
    with pytest.raises(InvalidConfig, match="--advertised-address"):
        broker_unit_config(TIDEWATER_LISTEN="0.0.0.0:9092")


def test_controller_unit_passes_its_advertised_address() -> None:
    assert parsed_unit("controller").advertised_address == ""
    edited = parsed_unit("controller", TIDEWATER_ADVERTISED="control-1.internal:9093")
    assert edited.advertised_address == "control-1.internal:9093"


def test_controllers_take_the_brokers_min_insync_replicas() -> None:
    """The controllers keep eligible leader replicas by the min.insync.replicas the brokers
    hold the HW by, for topics without their own."""
    expected = broker_unit_config().topic_defaults["min.insync.replicas"]
    assert parsed_unit("controller").min_insync_replicas == int(expected)
    with pytest.raises(AssertionError, match="refuses"):
        parsed_unit("controller", TIDEWATER_MIN_INSYNC_REPLICAS="0")


def test_broker_unit_waits_out_controlled_shutdown_before_sigkill() -> None:
    service = read_unit(UNITS["broker"])["Service"]
    config = broker_unit_config()
    assert int(service["TimeoutStopSec"]) > (
        config.controlled_shutdown_timeout_ms / 1000 + STOP_GRACE_S
    )
    # log.dirs below the directory systemd creates for the broker's user.
    state = Path("/var/lib") / service["StateDirectory"]
    assert all(state in log_dir.parents for log_dir in config.log_dirs)


def test_example_files_point_at_each_other() -> None:
    """A broker reaches the example controller; the controllers feed the example metadata
    service."""
    controller = parsed_unit("controller")
    assert controller.listen in broker_unit_config().controllers
    assert parsed_unit("metadata").listen in controller.metadata.split(",")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_units_have_only_directives_systemd_knows(tmp_path: Path) -> None:
    tidewater = Path(sys.executable).with_name("tidewater")
    for unit in UNITS.values():
        text = unit.read_text().replace("/opt/tidewater/venv/bin/tidewater", str(tidewater))
        (tmp_path / unit.name).write_text(text)
    result = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            *(str(tmp_path / u.name) for u in UNITS.values()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stderr) == (0, "")


async def test_broker_starts_from_the_deploy_config_and_stops_cleanly_on_sigterm(
    broker_processes: Callable[..., ManagedProcess],
) -> None:
    # Only what a test must override: the address, the log dir, and controllers at a port on
    # loopback where nothing listens (a broker serves before it has registered).
    broker = broker_processes(1, config=BROKER_TOML, controllers=f"127.0.0.1:{free_port()}")
    address = await asyncio.to_thread(broker.start)
    assert await grpc_health(address) == SERVING
    assert await asyncio.to_thread(broker.stop) == 0
    assert "stopped cleanly" in broker.log_tail()
