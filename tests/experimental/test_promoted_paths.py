"""The deprecated ``experimental`` paths of promoted trainers (TRL 1.16 keeps ``trl.experimental.distillation`` and
``trl.experimental.kto``; TRL's examples/scripts/distillation.py imports the former)."""

from __future__ import annotations

import warnings

import pytest
from datasets import Dataset

import posttrain


@pytest.mark.parametrize(
    "module,config_name,trainer_name",
    [("distillation", "DistillationConfig", "DistillationTrainer"), ("kto", "KTOConfig", "KTOTrainer")],
)
def test_old_path_is_the_stable_class_and_warns_once_built(tmp_path, module, config_name, trainer_name):
    import importlib

    old = importlib.import_module(f"posttrain.experimental.{module}")
    config_class, trainer_class = getattr(old, config_name), getattr(old, trainer_name)
    assert issubclass(config_class, getattr(posttrain, config_name))
    assert issubclass(trainer_class, getattr(posttrain, trainer_name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = config_class(output_dir=str(tmp_path), report_to="none")
    messages = [str(w.message) for w in caught if w.category is FutureWarning]
    assert any(f"from posttrain import {config_name}" in m for m in messages), messages
    # The config is a full one: TRL's defaults, parseable like the stable class.
    assert config.learning_rate == getattr(posttrain, config_name)(output_dir=str(tmp_path)).learning_rate
    from transformers import HfArgumentParser

    (parsed,) = HfArgumentParser((config_class,)).parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert isinstance(parsed, getattr(posttrain, config_name))


def test_old_kto_trainer_path_trains_and_warns(tmp_path, tiny_model_path):
    from posttrain.experimental.kto import KTOConfig, KTOTrainer

    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1), "label": i % 2 == 0} for i in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = KTOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                         max_length=32, save_strategy="no")
        trainer = KTOTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    assert any("from posttrain import KTOTrainer" in str(w.message) for w in caught if w.category is FutureWarning)
    trainer.train()
    assert trainer.state.global_step == 1
