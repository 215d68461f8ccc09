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

``rollout_func`` (TRL's ``rollout_func(prompts, trainer)``): called here once per round on the round's raw prompts
(one per completion), with a :class:`WorkerTrainerView` as ``trainer`` (its ``backend`` is this worker's server
backend); the round is tagged with the server's version read just before the call. Partial rollouts
(``spec.partial``) render each group's prompt here (:meth:`RolloutWorkerSpec.partial_prompt_ids`) and replay the
finished groups through the same pipeline (``posttrain.rollout.partial``).
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
    rollout_func: Any = None  # TRL's rollout_func(prompts, trainer), called here with a WorkerTrainerView
    args: Any = None  # the trainer's config (the view's ``args``)

    def make_producer(self, backend: Any, accelerator: Any = None) -> Producer:
        from posttrain.rollout.pipeline import RolloutPipeline

        # several training ranks: one producer per rank, in threads; each gets its own environments and tool loop
        agent = copy.deepcopy(self.agent) if accelerator is not None else self.agent
        generator = agent.wrap(backend) if agent is not None else backend
        view = None
        if self.rollout_func is not None:
            from posttrain.generation.rollout_func import RolloutFuncBackend

            view = WorkerTrainerView(args=self.args, processing_class=self.tokenizer, backend=backend,
                                     sampling=self.sampling, state=SimpleNamespace(global_step=0))  # fmt: skip
            generator = RolloutFuncBackend(self.rollout_func, view, tokenizer=self.tokenizer)
        pipeline = RolloutPipeline(
            tokenizer=self.tokenizer, backend=generator, scorer=self.scorer, sampling=self.sampling,
            settings=self.settings, estimator=self.estimator, policy_logps=_no_policy, agent=agent,
            accelerator=accelerator,
        )  # fmt: skip

        def produce(rows: list, record: Any) -> tuple[Any, Any]:
            if view is not None:
                # the function may generate elsewhere: tag the round with the server's version *before* it runs
                # (a lower bound of the weights that sampled it; staleness is then never under-counted)
                backend.version = view.state.global_step = _version_now(backend)
            batch = pipeline.run(rows, trainer_state=SimpleNamespace(global_step=backend.version), record_metric=record)
            return batch, pipeline.last_completions

        return produce

    def partial_prompt_ids(self, rows: list) -> list[int]:
        """A group's prompt ids, rendered as the pipeline renders them (chat template, ``max_prompt_length``)."""
        from posttrain.rollout.pipeline import render_prompts

        _, ids = render_prompts(rows[:1], self.tokenizer, self.settings.chat_template_kwargs)
        if self.settings.max_prompt_length:
            ids = [row[-self.settings.max_prompt_length :] for row in ids]
        return ids[0]


@dataclass
class WorkerTrainerView:
    """What a ``rollout_func`` receives as its ``trainer`` argument in AsyncGRPO's rollout worker (there is no
    trainer in that process): the trainer's ``args`` and ``processing_class``, ``state.global_step`` (the weight
    version the server reported when the round started), ``sampling`` (the resolved ``SamplingConfig``) and
    ``backend``, the worker's server backend — ``backend.generate(prompt_ids, sampling, n)`` samples from the
    generation server, whose weights the trainer keeps in sync. A function that generates elsewhere (its own
    server, an environment) only needs to be picklable."""

    args: Any
    processing_class: Any
    backend: Any
    sampling: Any
    state: Any


def _version_now(backend: Any) -> int:
    from posttrain.rollout.async_worker import _server_version

    return _server_version(backend)


def _no_policy(batch: Any) -> Any:
    raise RuntimeError("The rollout worker has no policy: π_old / π_ref are computed by the trainer.")
