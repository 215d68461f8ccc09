"""Model merging during training with mergekit (TRL's ``trl.experimental.merge_model_callback``).

:class:`MergeModelCallback` merges the policy being trained (a saved checkpoint) with a target model (by default
the model training started from) using the :class:`MergeConfig` method — ``linear``, ``ties``, ``dare_ties`` or
``slerp`` — and writes the result to ``checkpoint-N/merged``. mergekit is an optional extra
(``pip install posttrain[mergekit]`` or ``pip install mergekit``); without it, building either class raises an
ImportError that says so.

posttrain-only detail: when training ends without a checkpoint of the final step (e.g. ``save_strategy="no"``), the
callback saves the final weights to a temporary folder, merges from there and writes ``output_dir/merged``
(TRL expects ``checkpoint-N`` to exist).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["MergeConfig", "MergeModelCallback", "is_mergekit_available", "merge_models", "upload_model_to_hf"]

MERGE_METHODS = ("linear", "ties", "dare_ties", "slerp")


def is_mergekit_available() -> bool:
    """Whether the optional ``mergekit`` package is installed."""
    return importlib.util.find_spec("mergekit") is not None


def _require_mergekit(what: str) -> None:
    if not is_mergekit_available():
        raise ImportError(
            f"{what} requires the `mergekit` extra. To install, run `pip install mergekit` (or "
            "`pip install posttrain[mergekit]`)."
        )


def upload_model_to_hf(folder_path: str, repo_id: str) -> None:
    """Create the model repository ``repo_id`` on the Hub (if needed) and upload ``folder_path`` to it."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo = api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=folder_path, repo_id=repo.repo_id, repo_type=repo.repo_type)


def _model_ref(path: str | None) -> dict[str, Any]:
    return {"model": {"path": path, "revision": None}, "lora": None, "override_architecture": None}


class MergeConfig:
    r"""Configuration for merging the policy with a target model using mergekit (TRL's ``MergeConfig``).

    Args:
        method: ``"linear"`` (weighted average), ``"ties"`` (TIES with densities), ``"dare_ties"`` (DARE + TIES) or
            ``"slerp"`` (spherical interpolation).

    Attributes (defaults set per method, as in TRL):
        policy_model_path, target_model_path: Paths of the two models (filled by the callback; the target defaults
            to the model training started from).
        policy_model_weight, target_model_weight: 0.5 each for linear; 1.0 each for ties / dare_ties.
        policy_model_density ([1.0, 0.7, 0.1]), target_model_density ([1.0]), normalize (1.0): ties / dare_ties.
        t_values (0.5): slerp interpolation factor.
        dtype: ``"float16"``.
    """

    def __init__(self, method: str = "linear"):
        _require_mergekit("MergeConfig")
        if method not in MERGE_METHODS:
            raise ValueError(f"Unsupported merge method: {method!r}. Valid methods: {', '.join(MERGE_METHODS)}.")
        self.method = method
        self.policy_model_path: str | None = None
        self.target_model_path: str | None = None
        self.dtype = "float16"
        if method == "linear":
            self.policy_model_weight = 0.5
            self.target_model_weight = 0.5
        elif method in ("ties", "dare_ties"):
            self.policy_model_weight = 1.0
            self.policy_model_density = [1.0, 0.7, 0.1]
            self.target_model_weight = 1.0
            self.target_model_density = [1.0]
            self.normalize = 1.0
        else:
            self.t_values = 0.5

    def _validate(self, payload: dict[str, Any]) -> Any:
        from mergekit.config import MergeConfiguration

        return MergeConfiguration.model_validate(payload)

    def create_merge_config_linear(self) -> Any:
        """mergekit configuration of a linear merge (weights ``policy_model_weight`` / ``target_model_weight``)."""
        return self._validate(
            {
                "dtype": self.dtype,
                "merge_method": "linear",
                "models": [
                    {"model": self.policy_model_path, "parameters": {"weight": self.policy_model_weight}},
                    {"model": self.target_model_path, "parameters": {"weight": self.target_model_weight}},
                ],
            }
        )

    def _ties_like(self, method: str) -> Any:
        return self._validate(
            {
                "merge_method": method,
                "slices": None,
                "models": [
                    {
                        "model": _model_ref(self.target_model_path),
                        "parameters": {"density": self.target_model_density, "weight": self.target_model_weight},
                    },
                    {
                        "model": _model_ref(self.policy_model_path),
                        "parameters": {"density": self.policy_model_density, "weight": self.policy_model_weight},
                    },
                ],
                "parameters": {"normalize": self.normalize},
                "base_model": _model_ref(self.policy_model_path),
                "dtype": self.dtype,
                "tokenizer_source": None,
                "tokenizer": None,
                "chat_template": None,
                "out_dtype": None,
            }
        )

    def create_merge_config_ties(self) -> Any:
        """mergekit configuration of a TIES merge (the policy is the base model)."""
        return self._ties_like("ties")

    def create_merge_config_dare_ties(self) -> Any:
        """mergekit configuration of a DARE-TIES merge (the policy is the base model)."""
        return self._ties_like("dare_ties")

    def create_merge_config_slerp(self) -> Any:
        """mergekit configuration of a SLERP merge of the target with the policy as base (``t_values``)."""
        return self._validate(
            {
                "merge_method": "slerp",
                "slices": None,
                "models": [{"model": _model_ref(self.target_model_path), "parameters": None}],
                "parameters": {"t": self.t_values},
                "base_model": _model_ref(self.policy_model_path),
                "dtype": self.dtype,
                "tokenizer_source": None,
                "tokenizer": None,
                "chat_template": None,
                "out_dtype": None,
            }
        )

    def create(self) -> Any:
        """The mergekit ``MergeConfiguration`` of this method."""
        return getattr(self, f"create_merge_config_{self.method}")()


def merge_models(config: Any, out_path: str) -> None:
    """Run a mergekit merge of ``config`` (a ``MergeConfiguration``) into ``out_path`` (tokenizer copied)."""
    _require_mergekit("merge_models")
    import torch
    from mergekit.merge import MergeOptions, run_merge

    cuda = torch.cuda.is_available()
    run_merge(
        config,
        out_path=out_path,
        options=MergeOptions(
            device="cuda" if cuda else "cpu", cuda=cuda, copy_tokenizer=True, lazy_unpickle=False, low_cpu_memory=False
        ),
    )


def _local_or_hub(path: str) -> str:
    """Absolute path for a local folder (mergekit would look a relative one up on the Hub), else the hub id."""
    return os.path.abspath(path) if os.path.isdir(path) else path


class MergeModelCallback(TrainerCallback):
    r"""Merges the policy with another model based on a :class:`MergeConfig` (TRL's ``MergeModelCallback``).

    Args:
        merge_config: The merge configuration; None → ``MergeConfig()`` (linear, 0.5/0.5).
        merge_at_every_checkpoint: Merge at every checkpoint save (``checkpoint-N/merged``) instead of once when
            training ends.
        push_to_hub: Push each merged model to the Hub as ``{output_dir}_checkpoint-{N}_merged``.

    Example::

        from posttrain.experimental.merge_model_callback import MergeConfig, MergeModelCallback
        trainer = DPOTrainer(..., callbacks=[MergeModelCallback(MergeConfig())])
    """

    def __init__(self, merge_config: MergeConfig | None = None, merge_at_every_checkpoint: bool = False,
                 push_to_hub: bool = False):  # fmt: skip
        _require_mergekit("MergeModelCallback")
        self.merge_config = merge_config or MergeConfig()
        self.merge_at_every_checkpoint = merge_at_every_checkpoint
        self.push_to_hub = push_to_hub

    def _merge_and_maybe_push(self, output_dir: str, global_step: int, model: Any, policy_path: str,
                              merge_path: str) -> None:  # fmt: skip
        config = self.merge_config
        config.policy_model_path = _local_or_hub(policy_path)
        if config.target_model_path is None:
            source = getattr(getattr(model, "config", None), "_name_or_path", None)
            if not source:
                raise ValueError(
                    "MergeModelCallback: the target model is unknown (the policy has no `name_or_path`); set "
                    "merge_config.target_model_path."
                )
            config.target_model_path = source
        config.target_model_path = _local_or_hub(config.target_model_path)
        merge_models(config.create(), merge_path)
        logger.info("MergeModelCallback: merged model written to %s", merge_path)
        if self.push_to_hub:
            upload_model_to_hf(merge_path, f"{output_dir}_checkpoint-{global_step}_merged")

    def on_save(self, args, state, control, model=None, **kwargs):
        if self.merge_at_every_checkpoint and state.is_world_process_zero:
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self._merge_and_maybe_push(
                args.output_dir, state.global_step, model, checkpoint, os.path.join(checkpoint, "merged")
            )

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.merge_at_every_checkpoint or not state.is_world_process_zero:
            return
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(checkpoint):
            self._merge_and_maybe_push(
                args.output_dir, state.global_step, model, checkpoint, os.path.join(checkpoint, "merged")
            )
            return
        # No checkpoint of the final step: merge from the final weights, saved to a temporary folder.
        with tempfile.TemporaryDirectory(dir=args.output_dir) as tmp:
            inner = getattr(model, "module", model)
            inner.save_pretrained(tmp)
            if processing_class is not None:
                processing_class.save_pretrained(tmp)
            self._merge_and_maybe_push(
                args.output_dir, state.global_step, model, tmp, os.path.join(args.output_dir, "merged")
            )
