"""Models: loading from ids/paths/objects (``loading``), PEFT helpers (``peft_utils``), offline tiny models
(``tiny``), the chunked forward pass and token log-probs (``forward``), completion scoring of rollouts
(``completion_scoring``) with the shared-prompt layout (``prefix_sharing``), of preference pairs
(``preference_scoring``) and of distillation completions (``distillation_scoring``), and reference policies
(``reference``).

``from posttrain.models import create_reference_model, unwrap_model_for_generation`` works as
``from trl.models import ...`` does (lazily, so
importing a submodule such as ``posttrain.models.tiny`` costs nothing extra)."""


from __future__ import annotations

from typing import Any

__all__ = ["create_reference_model", "unwrap_model_for_generation"]


def __getattr__(name: str) -> Any:
    if name == "create_reference_model":
        from posttrain.models.peft_utils import create_reference_model

        return create_reference_model
    if name == "unwrap_model_for_generation":
        from posttrain.models.unwrap import unwrap_model_for_generation

        return unwrap_model_for_generation
    raise AttributeError(f"module 'posttrain.models' has no attribute {name!r}")
