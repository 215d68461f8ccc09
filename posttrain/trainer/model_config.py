"""TRL's ``trl.trainer.model_config``: ``ModelConfig`` (defined in :mod:`posttrain.cli.configs`)."""

from posttrain.cli.configs import ModelConfig

__all__ = ["ModelConfig"]
