"""The controller's LeaderAndIsr, sent by hand: the demo and tests play the controller with it."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from tidewater.v1 import broker_pb2 as pb
from tidewater.v1 import broker_pb2_grpc, common_pb2
from tidewater.v1.errors_pb2 import ErrorCode


def leader_and_isr_request(
    topic: str,
    partition: int,
    *,
    leader: int,
    leader_epoch: int,
    replicas: Sequence[int],
    isr: Sequence[int] | None = None,
    controller_epoch: int = 1,
    configs: dict[str, str] | None = None,
    leaders: dict[int, str] | None = None,
) -> pb.LeaderAndIsrRequest:
    """LeaderAndIsr for one partition; `leaders` maps broker ids to addresses (host:port) so
    followers can reach the leader."""
    return pb.LeaderAndIsrRequest(
        controller_id=0,
        controller_epoch=controller_epoch,
        partition_states=[
            pb.LeaderAndIsrPartitionState(
                topic=topic,
                partition=partition,
                controller_epoch=controller_epoch,
                leader=leader,
                leader_epoch=leader_epoch,
                isr=list(isr if isr is not None else replicas),
                partition_epoch=leader_epoch,
                replicas=list(replicas),
                is_new=True,
            )
        ],
        topic_configs=[common_pb2.TopicConfig(topic=topic, configs=configs or {})],
        live_leaders=[
            common_pb2.BrokerInfo(
                broker_id=broker_id,
                endpoint=common_pb2.Endpoint(
                    host=address.rpartition(":")[0], port=int(address.rpartition(":")[2])
                ),
            )
            for broker_id, address in (leaders or {}).items()
        ],
    )


async def make_leader(
    channel: grpc.aio.Channel, topic: str, partition: int, **kwargs: object
) -> pb.LeaderAndIsrResponse:
    """Send LeaderAndIsr for one partition; raise if the broker refused it."""
    response = await broker_pb2_grpc.BrokerControlStub(channel).LeaderAndIsr(
        leader_and_isr_request(topic, partition, **kwargs)  # type: ignore[arg-type]
    )
    errors = [response.error_code] + [p.error_code for p in response.partition_errors]
    if any(code != ErrorCode.NONE for code in errors):
        raise RuntimeError(f"LeaderAndIsr refused: {response}")
    return response
