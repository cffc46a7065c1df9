"""Wire protocol between trainer and rollout servers (``protos/``) and helpers for both sides.

``rollout_pb2`` / ``rollout_pb2_grpc`` are generated (``python -m areal_jax.protocol.generate``);
``convert`` maps trajectory groups to and from their messages; ``weights`` turns a checkpoint
directory into a ``PushWeights`` request stream.
"""

from areal_jax.protocol.convert import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    group_from_proto,
    group_to_proto,
)
from areal_jax.protocol.v1 import rollout_pb2, rollout_pb2_grpc
from areal_jax.protocol.weights import push_weight_requests

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
# Sampling temperatures below this mean greedy decoding, with log-probs reported at temperature
# 1 (SGLang's threshold too): dividing logits by a tinier one overflows float32.
GREEDY_TEMPERATURE = 1e-6

__all__ = [
    "GREEDY_TEMPERATURE",
    "SERVICE_NAME",
    "finish_reason_from_proto",
    "finish_reason_to_proto",
    "group_from_proto",
    "group_to_proto",
    "push_weight_requests",
    "rollout_pb2",
    "rollout_pb2_grpc",
]
