"""Deferred importance sampling (``RolloutSettings.defer_importance_sampling``): on a fixed rollout, the ratio the
GRPO loss computes from its own forward pass gives the loss, gradients and ``sampling/*`` metrics of the ratio the
pipeline computes eagerly, and the pipeline's extra no-grad π_old forward pass is gone."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward

from posttrain.generation.base import Completions


class _Replay:
    """The first rollout's completions every time, with sampling log-probs moved off π_old (ratio ≠ 1)."""

    def __init__(self, inner, kept_mass: bool = False):
        self.inner, self.cached, self.kept_mass = inner, None, kept_mass

    def sync_weights(self, model):
        pass

    def generate(self, prompt_ids, sampling, num_generations=1):
        if self.cached is None:
            out = self.inner.generate(prompt_ids, sampling, num_generations)
            g = torch.Generator().manual_seed(0)
            shifted = [[lp + 0.3 * float(torch.randn((), generator=g)) for lp in row] for row in out.logprobs]
            # a truncating sampler's log kept mass (TRL 1.17's correction must be applied by both paths alike)
            kept = [[-0.1 * (t % 3) for t in range(len(row))] for row in out.logprobs] if self.kept_mass else None
            self.cached = Completions(out.completion_ids, shifted, out.finished, out.prompt_ids, log_kept_mass=kept)
        return copy.deepcopy(self.cached)


@pytest.mark.parametrize("kept_mass", [False, True], ids=["full", "truncated"])
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_deferred_equals_eager_on_a_fixed_rollout_without_the_extra_forward(tiny_model_path, tmp_path, mode, kept_mass):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", gradient_checkpointing=False,
        write_report=False, disable_tqdm=True, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, max_steps=1, seed=3, rollout_importance_sampling=True,
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=1.5, vllm_importance_sampling_clip_min=0.5,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(4)])
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset)
    pipeline, model = trainer.pipeline, trainer.model
    pipeline.backend = _Replay(pipeline.backend, kept_mass)
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    rows = [dict(r) for r in dataset.select(range(2)) for _ in range(2)]
    model.train()

    def rollout_and_loss(defer: bool):
        pipeline.settings.defer_importance_sampling = defer
        trainer._metrics["train"].clear()
        start = len(forwards)
        batch = pipeline.run(rows, record_metric=trainer._record("train"))
        rollout_forwards = len(forwards) - start
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        sampling = {k: v for k, v in trainer._metrics["train"].items() if k.startswith("sampling/")}
        return batch, rollout_forwards, loss.detach(), grads, sampling

    pipeline.backend.generate(*_first_request(trainer, rows))  # fill the replay cache (generation forwards)
    eager_batch, eager_forwards, eager_loss, eager_grads, eager_metrics = rollout_and_loss(False)
    deferred_batch, deferred_forwards, deferred_loss, deferred_grads, deferred_metrics = rollout_and_loss(True)

    assert "importance_sampling_ratio" in eager_batch and "old_per_token_logps" in eager_batch
    assert "importance_sampling_ratio" not in deferred_batch and "old_per_token_logps" not in deferred_batch
    assert eager_forwards == 1 and deferred_forwards == 0  # one no-grad π_old pass of 4 rows, gone when deferred
    ratio = eager_batch["importance_sampling_ratio"]
    assert not torch.allclose(ratio, torch.ones_like(ratio))  # the correction matters for this loss
    torch.testing.assert_close(deferred_loss, eager_loss, rtol=1e-6, atol=1e-7)
    assert eager_grads.keys() == deferred_grads.keys() and eager_grads
    for name, grad in eager_grads.items():
        torch.testing.assert_close(deferred_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert eager_metrics.keys() == deferred_metrics.keys() and eager_metrics
    assert ("sampling/uncorrected_importance_sampling_ratio/mean" in eager_metrics) == kept_mass
    for name, values in eager_metrics.items():  # one micro-batch = the whole batch here: the same values
        assert deferred_metrics[name] == pytest.approx(values, rel=1e-5, abs=1e-6), name


def _first_request(trainer, rows):
    from posttrain.rollout.pipeline import render_prompts

    _, ids = render_prompts(rows, trainer.processing_class)
    return ids[::2], trainer.pipeline.sampling, 2


def test_deferral_only_when_pi_old_is_needed_for_nothing_else(tiny_model_path, tmp_path):
    """steps_per_generation > GA needs π_old anyway: the pipeline computes the ratio eagerly (no pass is saved)."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    common = dict(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2, num_generations=2,
                  max_completion_length=4, rollout_importance_sampling=True)  # fmt: skip
    dataset = Dataset.from_list([{"prompt": f"Q {i}:"} for i in range(4)])
    stale = GRPOTrainer(tiny_model_path, varied_reward, GRPOConfig(**common, steps_per_generation=2),
                        train_dataset=dataset)  # fmt: skip
    stale.pipeline.settings.defer_importance_sampling = True
    assert stale.pipeline.settings.compute_old_logps and not stale.pipeline.defers_importance_sampling()
    local = GRPOTrainer(tiny_model_path, varied_reward, GRPOConfig(**common), train_dataset=dataset)
    assert not local.pipeline.settings.defer_importance_sampling  # in-process: eager, as before
