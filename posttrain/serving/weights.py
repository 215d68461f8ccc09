"""The old home of weight transfer, kept so ``from posttrain.serving.weights import ...`` keeps working.

Which tensors a push sends and in which bytes is shared by the trainer's side (the ``vllm_server`` backend, the async
rollout worker) and the server, so it lives in :mod:`posttrain.generation.weights`, below both; code inside posttrain
imports it from there (``tests/test_layering.py`` checks).
"""

from posttrain.generation.weights import (
    DEFAULT_CHUNK_BYTES,
    clean_param_name,
    deserialize,
    load_into,
    policy_weights,
    serialize_chunks,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "clean_param_name",
    "deserialize",
    "load_into",
    "policy_weights",
    "serialize_chunks",
]
