"""The old home of the generation server's client, kept so ``from posttrain.serving.client import GenerationClient``
(the path the README documented) keeps working.

The client is the trainer's side of the wire and lives in :mod:`posttrain.generation.client`, below the server that
``posttrain.serving`` runs; code inside posttrain imports it from there (``tests/test_layering.py`` checks).
"""

from posttrain.generation.client import (
    Choice,
    CompletionResult,
    GenerationClient,
    ServerError,
    ServerRequestError,
    ServerUnavailableError,
    WeightSyncError,
    completion_payload,
    parse_completions,
)

__all__ = [
    "Choice",
    "CompletionResult",
    "GenerationClient",
    "ServerError",
    "ServerRequestError",
    "ServerUnavailableError",
    "WeightSyncError",
    "completion_payload",
    "parse_completions",
]
