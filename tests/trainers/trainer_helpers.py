"""Test setup shared by the offline trainer tests (DPO, KTO, Reward, GRPO, RLOO, Distillation): a quiet
single-threaded module fixture, a fast config builder, parameter-change checks and the batch-invariance check. Imported as ``trainer_helpers`` (pytest puts this
folder on ``sys.path``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def quiet_single_thread():
    """Tiny matmuls on the shared 2-core machine are much faster single-threaded; progress bars and transformers'
    info logs only add noise. Import it into a test module to apply it there (autouse)."""
    import datasets
    import transformers

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(previous)


def fast_config(config_class: type, tmp_path: Any, **overrides: Any) -> Any:
    """``config_class`` for a few-step test run in ``tmp_path``: no saving, no reporting, no progress bar, a log
    line every step, no gradient checkpointing; ``overrides`` win."""
    values = dict(
        output_dir=str(tmp_path),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        write_report=False,
        disable_tqdm=True,
    )
    values.update(overrides)
    return config_class(**values)


def trainable_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every trainable parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def params_changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    """Whether any parameter copied by :func:`trainable_params` differs in ``model`` now."""
    after = dict(model.named_parameters())
    return any(not torch.equal(before[n], after[n].detach()) for n in before)


def train_and_snapshot(trainer: Any) -> dict[str, torch.Tensor]:
    """Train ``trainer``, check that a trainable parameter moved, and return a copy of the trained parameters."""
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    return trainable_params(trainer.model)


def assert_same_params(results: list[dict[str, torch.Tensor]], atol: float = 1e-5) -> None:
    """Every snapshot in ``results`` equals the first (e.g. batch size × accumulation steps invariance)."""
    for other in results[1:]:
        for name, value in results[0].items():
            torch.testing.assert_close(other[name], value, atol=atol, rtol=0)


def save_abc_teacher(tokenizer: Any, path: str, seed: int = 1) -> str:
    """Train a tiny Qwen2 (with ``tokenizer``) to answer "abcabc..." after any "Q<n>:" prompt (80 full-batch Adam
    steps, ~1 s) and save it with its tokenizer to ``path``: the distillation tests' teacher."""
    from posttrain.models.tiny import build_tiny_model

    torch.manual_seed(0)
    teacher = build_tiny_model("qwen2", tokenizer=tokenizer, seed=seed)
    enc = tokenizer([f"Q{i}:abcabcabcabc" for i in range(16)], return_tensors="pt", padding=True)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    for _ in range(80):
        teacher(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    teacher.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
