"""The Python client SDK: an asyncio Producer, Consumer and Admin, and blocking facades in
`tidewater.client.sync`.

    from tidewater.client import Consumer, Producer
"""

from tidewater.client.accumulator import UNKNOWN_OFFSET, RecordFuture, RecordMetadata
from tidewater.client.admin import Admin, PartitionReassignment
from tidewater.client.consumer import Consumer
from tidewater.client.metadata import TopicPartition
from tidewater.client.producer import Producer
from tidewater.errors import TidewaterError
from tidewater.records.batch import ConsumerRecord

__all__ = [
    "UNKNOWN_OFFSET",
    "Admin",
    "Consumer",
    "ConsumerRecord",
    "PartitionReassignment",
    "Producer",
    "RecordFuture",
    "RecordMetadata",
    "TidewaterError",
    "TopicPartition",
]
