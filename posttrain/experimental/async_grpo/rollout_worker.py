"""The AsyncGRPO rollout worker: GRPO rounds for the shared async worker (``posttrain.rollout.async_worker``).

One *round* is one optimizer step's worth of rows (``generation_batch_size`` = ``per_device_train_batch_size ×
gradient_accumulation_steps`` completions, whole groups of ``num_generations``), taken from the same
``RepeatSampler`` order as ``GRPOTrainer`` (``RoundSource``). For each round the worker runs the shared
``RolloutPipeline`` (render prompts → generate through the ``vllm_server`` backend → decode → score rewards →
group-relative advantages → metrics) with no policy in this process: π_old, π_ref and the importance-sampling ratio
are computed by the trainer when it consumes the round, under the weights it trains with. Admission, request seeds,
the queue protocol and error reporting are the shared worker's (see ``posttrain.rollout.async_worker``). Reward
functions must be picklable, as in TRL.

Agent training (``tools=`` / ``environment_factory``): the trainer's ``AgentRollout`` travels in the spec, so the
worker wraps its server backend in the same tool-calling loop as ``GRPOTrainer`` (``posttrain.agents``): each
rollout's tool calls run here, in the worker, and their results enter the completion (masked out of the loss by
``tool_mask``); one environment per rollout is reset from its row before generation, and environments with
``get_reward`` add their reward column. Tools, environment factories and reward functions must be picklable.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from posttrain.rollout.async_worker import AsyncWorkerSpec, Producer, RoundSource, run_worker

__all__ = ["RolloutWorkerSpec", "RoundSource", "run_worker"]


@dataclass(kw_only=True)
class RolloutWorkerSpec(AsyncWorkerSpec):
    """The shared worker spec plus GRPO's scorer (reward functions), advantage estimator, pipeline settings and,
    for agent training, the trainer's ``AgentRollout`` (tools and environments)."""

    scorer: Any
    estimator: Any
    settings: Any
    agent: Any = None

    def make_producer(self, backend: Any, accelerator: Any = None) -> Producer:
        from posttrain.rollout.pipeline import RolloutPipeline

        # several training ranks: one producer per rank, in threads; each gets its own environments and tool loop
        agent = copy.deepcopy(self.agent) if accelerator is not None else self.agent
        generator = agent.wrap(backend) if agent is not None else backend
        pipeline = RolloutPipeline(
            tokenizer=self.tokenizer, backend=generator, scorer=self.scorer, sampling=self.sampling,
            settings=self.settings, estimator=self.estimator, policy_logps=_no_policy, agent=agent,
            accelerator=accelerator,
        )  # fmt: skip

        def produce(rows: list, record: Any) -> tuple[Any, Any]:
            batch = pipeline.run(rows, trainer_state=SimpleNamespace(global_step=backend.version), record_metric=record)
            return batch, pipeline.last_completions

        return produce


def _no_policy(batch: Any) -> Any:
    raise RuntimeError("The rollout worker has no policy: π_old / π_ref are computed by the trainer.")
