"""A scalar value head on a causal LM (TRL's ``AutoModelForCausalLMWithValueHead`` / ``ValueHead``).

``ValueHead``: dropout (``summary_dropout_prob``, 0.1) then ``Linear(hidden_size, 1)``. ``AutoModelForCausalLMWithValueHead``
wraps a causal LM (``pretrained_model``) and its ``v_head``: ``forward`` returns ``(lm_logits, loss, value)`` as
TRL's, ``value`` ``(B, T)`` computed from the last hidden states. ``save_pretrained`` writes the LM with the head's
weights as ``v_head.*`` entries of its state dict; ``from_pretrained`` loads them back when present (a plain LM gets a
fresh head). :class:`~posttrain.experimental.ppo.PPOTrainer` accepts either this wrapper or a plain causal LM.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

__all__ = ["AutoModelForCausalLMWithValueHead", "ValueHead"]


class ValueHead(nn.Module):
    """``Linear(hidden_size, 1)`` after dropout; ``forward(hidden (…, H)) -> (…, 1)``."""

    def __init__(self, hidden_size: int, summary_dropout_prob: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()
        self.summary = nn.Linear(hidden_size, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = self.dropout(hidden_states)
        return self.summary(output.to(self.summary.weight.dtype))


def _hidden_size(model: nn.Module) -> int:
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    return int(getattr(text, "hidden_size", None) or text.word_embed_proj_dim)


class AutoModelForCausalLMWithValueHead(nn.Module):
    """A causal LM plus a scalar value head (TRL's class name and ``forward`` contract)."""

    def __init__(self, pretrained_model: nn.Module, summary_dropout_prob: float = 0.1):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.v_head = ValueHead(_hidden_size(pretrained_model), summary_dropout_prob)
        self.config = pretrained_model.config

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args, summary_dropout_prob: float = 0.1, **kwargs):
        """Load the LM (``AutoModelForCausalLM.from_pretrained``, or take a module) and the head's ``v_head.*``
        weights when the checkpoint has them."""
        if isinstance(pretrained_model_name_or_path, nn.Module):
            model = pretrained_model_name_or_path
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        wrapper = cls(model, summary_dropout_prob)
        path = os.path.join(str(pretrained_model_name_or_path), "model.safetensors")
        if isinstance(pretrained_model_name_or_path, (str, os.PathLike)) and os.path.isfile(path):
            from safetensors.torch import load_file

            state = {k[len("v_head.") :]: v for k, v in load_file(path).items() if k.startswith("v_head.")}
            if state:
                wrapper.v_head.load_state_dict(state)
        return wrapper

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        kwargs["output_hidden_states"] = True
        outputs = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        value = self.v_head(outputs.hidden_states[-1]).squeeze(-1)
        return outputs.logits, getattr(outputs, "loss", None), value

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """The LM's files, with the head stored as ``v_head.*`` in its state dict."""
        state = dict(self.pretrained_model.state_dict())
        state.update({f"v_head.{k}": v for k, v in self.v_head.state_dict().items()})
        self.pretrained_model.save_pretrained(save_directory, state_dict=state, **kwargs)
