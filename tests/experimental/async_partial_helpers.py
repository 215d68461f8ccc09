"""Picklable pieces for the AsyncGRPO partial-rollout / rollout_func tests (the spawned rollout worker imports them)."""

from __future__ import annotations


def length_reward(completion_ids, **kwargs):
    """Shorter completions score higher (a reward that depends on the completion, so advantages are not all 0)."""
    return [-float(len(ids)) for ids in completion_ids]


def server_rollout_func(prompts, trainer):
    """TRL's rollout_func contract: sample each prompt once on the generation server through ``trainer.backend``
    (the worker's ``WorkerTrainerView``), return ids and log-probs, plus an extra per-row key for the reward."""
    tokenizer = trainer.processing_class
    backend = trainer._inner_backend() if hasattr(trainer, "_inner_backend") else trainer.backend
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    out = backend.generate(prompt_ids, trainer.sampling, 1)
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": out.completion_ids,
        "logprobs": out.logprobs,
        "step_seen": [float(trainer.state.global_step)] * len(prompts),
    }


def step_seen_reward(completions, step_seen, **kwargs):
    """Reads the rollout function's extra column (the version it saw), plus a length term."""
    return [s + 0.01 * len(c) for s, c in zip(step_seen, completions)]
