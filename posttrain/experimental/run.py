"""Run an experimental trainer from a YAML recipe and/or flags, as TRL's ``trl <verb>`` scripts do for the stable
ones (TRL has no CLI verbs for these, so neither has ``posttrain``)::

    python -m posttrain.experimental.run cpo --config examples/cpo.yaml
    python -m posttrain.experimental.run orpo --config examples/orpo.yaml --max_steps 5
    python -m posttrain.experimental.run tpo --config examples/tpo.yaml
    python -m posttrain.experimental.run prm --config examples/prm.yaml
    python -m posttrain.experimental.run bema_dpo --config examples/bema_dpo.yaml
    python -m posttrain.experimental.run gmpo --config examples/gmpo.yaml
    python -m posttrain.experimental.run grpo_with_replay_buffer --config examples/grpo_with_replay_buffer.yaml
    python -m posttrain.experimental.run online_dpo --config examples/online_dpo.yaml
    python -m posttrain.experimental.run a2po --config examples/a2po.yaml
    python -m posttrain.experimental.run ppo --config examples/ppo.yaml
    python -m posttrain.experimental.run sdpo --config examples/sdpo.yaml
    python -m posttrain.experimental.run gkd --config examples/gkd.yaml
    python -m posttrain.experimental.run gold --config examples/gold.yaml
    python -m posttrain.experimental.run iw_opd --config examples/iw_opd.yaml
    python -m posttrain.experimental.run server_distillation --config examples/server_distillation.yaml
    python -m posttrain.experimental.run sdft --config examples/sdft.yaml
    python -m posttrain.experimental.run async_distillation --config examples/async_distillation.yaml

Each method parses ``(ScriptArguments, <X>Config, ModelConfig, DatasetMixtureConfig)`` with ``TrlParser`` (YAML
keys and ``--flags``; flags win), trains in this process and saves to ``output_dir``. ``bema_dpo`` is
``bema_for_ref_model.DPOTrainer`` with a ``BEMACallback`` whose options are :class:`BEMAArguments`. The online methods
(``REWARD_METHODS``) parse ``posttrain grpo``'s script arguments instead, so their rewards come from
``reward_funcs`` (registry names or dotted paths) and/or ``reward_model_name_or_path``. Errors are one
paragraph (``--debug`` for the traceback). The distillation methods (``gkd``, ``gold``, ``iw_opd``) load the teacher
from ``--teacher_model_name_or_path`` like the student (dtype, attention; never quantized) unless
``teacher_model_init_kwargs`` says otherwise; ``server_distillation`` (and ``iw_opd`` with ``use_teacher_server``)
reads it from ``--teacher_model_server_url`` (a running ``posttrain serve --model TEACHER``); ``async_distillation``
from ``--teacher_server_urls`` (and samples the student on ``--vllm_server_base_url``, a running ``posttrain serve
--model STUDENT``) unless ``--teacher_model_name_or_path`` is given. ``sdft`` has no separate teacher: the student is
its own (``teacher_model_kind``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BEMAArguments", "METHODS", "REWARD_METHODS", "main"]


@dataclass
class BEMAArguments:
    """The ``BEMACallback`` options of the ``bema_dpo`` recipe (defaults: the callback's, with the reference
    updated)."""

    bema_update_freq: int = field(default=400, metadata={"help": "BEMACallback update_freq."})
    bema_ema_power: float = field(default=0.5, metadata={"help": "BEMACallback ema_power (κ)."})
    bema_bias_power: float = field(default=0.2, metadata={"help": "BEMACallback bias_power (η)."})
    bema_lag: int = field(default=10, metadata={"help": "BEMACallback lag (ρ)."})
    bema_update_after: int = field(default=0, metadata={"help": "BEMACallback update_after (τ)."})
    bema_multiplier: float = field(default=1.0, metadata={"help": "BEMACallback multiplier (γ)."})
    bema_min_ema_multiplier: float = field(default=0.0, metadata={"help": "BEMACallback min_ema_multiplier."})
    bema_device: str = field(default="cpu", metadata={"help": "BEMACallback device."})
    update_ref_model: bool = field(default=True, metadata={"help": "Update the reference with the BEMA weights."})
    ref_model_update_freq: int = field(default=400, metadata={"help": "Steps between reference updates."})
    ref_model_update_after: int = field(default=0, metadata={"help": "Steps before the first reference update."})

    def callback(self) -> Any:
        from posttrain.experimental.bema_for_ref_model import BEMACallback

        return BEMACallback(
            update_freq=self.bema_update_freq,
            ema_power=self.bema_ema_power,
            bias_power=self.bema_bias_power,
            lag=self.bema_lag,
            update_after=self.bema_update_after,
            multiplier=self.bema_multiplier,
            min_ema_multiplier=self.bema_min_ema_multiplier,
            device=self.bema_device,
            update_ref_model=self.update_ref_model,
            ref_model_update_freq=self.ref_model_update_freq,
            ref_model_update_after=self.ref_model_update_after,
        )


# method -> (config "module:Class", trainer "module:Class")
METHODS: dict[str, tuple[str, str]] = {
    "cpo": ("posttrain.experimental.cpo:CPOConfig", "posttrain.experimental.cpo:CPOTrainer"),
    "orpo": ("posttrain.experimental.orpo:ORPOConfig", "posttrain.experimental.orpo:ORPOTrainer"),
    "tpo": ("posttrain.experimental.tpo:TPOConfig", "posttrain.experimental.tpo:TPOTrainer"),
    "prm": ("posttrain.experimental.prm:PRMConfig", "posttrain.experimental.prm:PRMTrainer"),
    "bema_dpo": ("posttrain.trainers.dpo:DPOConfig", "posttrain.experimental.bema_for_ref_model:DPOTrainer"),
    "gmpo": ("posttrain.experimental.gmpo:GMPOConfig", "posttrain.experimental.gmpo:GMPOTrainer"),
    "grpo_with_replay_buffer": (
        "posttrain.experimental.grpo_with_replay_buffer:GRPOWithReplayBufferConfig",
        "posttrain.experimental.grpo_with_replay_buffer:GRPOWithReplayBufferTrainer",
    ),
    "online_dpo": (
        "posttrain.experimental.online_dpo:OnlineDPOConfig",
        "posttrain.experimental.online_dpo:OnlineDPOTrainer",
    ),
    "a2po": ("posttrain.experimental.a2po:A2POConfig", "posttrain.experimental.a2po:A2POTrainer"),
    "ppo": ("posttrain.experimental.ppo:PPOConfig", "posttrain.experimental.ppo:PPOTrainer"),
    "sdpo": ("posttrain.experimental.sdpo:SDPOConfig", "posttrain.experimental.sdpo:SDPOTrainer"),
    "gkd": ("posttrain.experimental.gkd:GKDConfig", "posttrain.experimental.gkd:GKDTrainer"),
    "gold": ("posttrain.experimental.gold:GOLDConfig", "posttrain.experimental.gold:GOLDTrainer"),
    "iw_opd": ("posttrain.experimental.iw_opd:IWOPDConfig", "posttrain.experimental.iw_opd:IWOPDTrainer"),
    "server_distillation": (
        "posttrain.experimental.server_distillation:ServerDistillationConfig",
        "posttrain.experimental.server_distillation:ServerDistillationTrainer",
    ),
    "sdft": ("posttrain.experimental.sdft:SDFTConfig", "posttrain.experimental.sdft:SDFTTrainer"),
    "async_distillation": (
        "posttrain.experimental.async_distillation:AsyncDistillationConfig",
        "posttrain.experimental.async_distillation:AsyncDistillationTrainer",
    ),
}
# Online methods: GRPO's script arguments (reward_funcs, reward_model_name_or_path) and a reward_funcs argument.
REWARD_METHODS = {"gmpo", "grpo_with_replay_buffer", "online_dpo", "a2po", "ppo", "sdpo"}
# Methods distilling a teacher: loaded locally from teacher_model_name_or_path unless it is served.
_DISTILLATION = ("gkd", "gold", "iw_opd", "server_distillation", "async_distillation")


def _teacher_kwargs(method: str, training_args: Any, model_args: Any) -> dict[str, Any]:
    """``teacher_model=`` for the distillation methods (after ``apply_model_args``); {} when the teacher is served."""
    from posttrain.cli.parser import ConfigError

    if method == "server_distillation" or getattr(training_args, "use_teacher_server", False):
        return {}
    if method == "async_distillation" and not getattr(training_args, "teacher_model_name_or_path", None):
        return {}  # the teachers of teacher_server_urls
    teacher = getattr(training_args, "teacher_model_name_or_path", None)
    if not teacher:
        raise ConfigError("--teacher_model_name_or_path is required: a hub id or a local model folder.")
    if getattr(training_args, "teacher_model_init_kwargs", None) is None:
        kwargs = {k: v for k, v in (training_args.model_init_kwargs or {}).items() if k != "quantization_config"}
        kwargs.pop("device_map", None)
        kwargs["revision"] = getattr(training_args, "teacher_model_revision", None) or "main"
        training_args.teacher_model_init_kwargs = kwargs
    return {"teacher_model": teacher}


def _load(spec: str) -> Any:
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _train(method: str, argv: list[str]) -> int:
    from posttrain.cli.configs import GRPOScriptArguments, ModelConfig, ScriptArguments
    from posttrain.cli.parser import ConfigError
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.scripts._common import apply_model_args, build_and_train, make_trl_parser, reward_funcs_from_args

    if method not in METHODS:
        raise ConfigError(f"Unknown experimental method {method!r}; choose one of: {', '.join(METHODS)}.")
    config_spec, trainer_spec = METHODS[method]
    script_class = GRPOScriptArguments if method in REWARD_METHODS else ScriptArguments
    types: tuple = (script_class, _load(config_spec), ModelConfig, DatasetMixtureConfig)
    if method == "bema_dpo":
        types = (*types, BEMAArguments)
    parser = make_trl_parser(f"python -m posttrain.experimental.run {method}", types, __doc__)
    namespace, remaining = parser.parse_namespace_and_config(argv)
    if remaining:
        raise ConfigError(parser.unknown_args_message(remaining))
    configs = parser.namespace_to_dataclasses(namespace)
    script_args, training_args, model_args, dataset_args = configs[:4]
    extra = {"callbacks": [configs[4].callback()]} if method == "bema_dpo" else {}
    if method in REWARD_METHODS:
        config_reward_model = getattr(training_args, "reward_model_path", None)  # OnlineDPOConfig's / PPOConfig's
        has_script_rewards = bool(script_args.reward_funcs or script_args.reward_model_name_or_path)
        if method == "online_dpo" and config_reward_model:
            # OnlineDPOTrainer never reads reward_model_path (TRL); like TRL's online_dpo.py, pass it as a reward
            funcs = reward_funcs_from_args(f"experimental.run {method}", script_args) if has_script_rewards else []
            extra["reward_funcs"] = [*funcs, config_reward_model]
        elif config_reward_model and not has_script_rewards:  # PPOTrainer reads its reward_model_path itself
            extra["reward_funcs"] = None
        else:
            extra["reward_funcs"] = reward_funcs_from_args(f"experimental.run {method}", script_args)
    if method in _DISTILLATION:
        apply_model_args(training_args, model_args)
        extra.update(_teacher_kwargs(method, training_args, model_args))
    build_and_train(method, _load(trainer_spec), script_args, training_args, model_args, dataset_args, **extra)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m posttrain.experimental.run METHOD [--config recipe.yaml] [--flags]``; returns the exit code."""
    from posttrain.cli.run import guarded, pop_debug_flag

    debug, argv = pop_debug_flag(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(f"\nMethods: {', '.join(METHODS)}. `python -m posttrain.experimental.run METHOD --help` lists options.")
        return 0
    method, rest = argv[0], argv[1:]
    return guarded(f"posttrain.experimental.run {method}", lambda: _train(method, rest), debug)


if __name__ == "__main__":
    sys.exit(main())
