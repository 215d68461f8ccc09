"""``AsyncGRPOTrainer``: GRPO with generation decoupled from training (TRL's experimental ``AsyncGRPOTrainer``).

Two sides, overlapping in time:

- **rollout worker** (a spawned CPU process: ``rollout_worker.py`` over the shared
  ``posttrain.rollout.async_worker``, which also runs AsyncDistillation): pulls the next round of prompts (the
  ``RepeatSampler`` order GRPO uses), generates it on the server, scores rewards, computes group-relative
  advantages with the shared ``RolloutPipeline`` and puts the finished round, tagged with the server's weight
  ``version``, into a bounded queue (``queue_maxsize`` samples);
- **trainer** (this process): at the first micro-step of each optimizer step takes the next round from the queue,
  drops it when ``global_step - version > max_staleness`` (counted in ``sample/dropped_stale_total``), computes
  π_old (and π_ref when β ≠ 0) under its *current* weights, applies the importance-sampling correction of ``core/``
  (``vllm_importance_sampling_*``: π_old against the server's sampling log-probs), and trains with GRPO's loss. After
  every ``weight_sync_steps`` optimizer steps it pushes its weights to the server with ``version = global_step``.

Because π_old is the trainer's current policy, the clipped ratio π_θ/π_old is exactly on-policy within a step and the
staleness of a sample (plus any sampler/trainer mismatch) is carried by the truncated/masked IS ratio
π_old/π_sampler — a decoupled-PPO form. Deliberate difference from TRL, whose async trainer uses vLLM's log-probs
directly as π_old inside the clip.

``max_staleness=0`` is synchronous GRPO: the worker may only generate round ``r`` from weight version ``r``, so it
waits for each push, and a run equals ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` on the same server with the
same seeds (same prompts, request seeds, buffer shuffle; tested to the last bit).

Resume (``rollout_state.json`` in each checkpoint): the *trained* position ``next_round`` (first round not yet
consumed; rounds dropped as stale count as consumed), the weight version and the dropped counter. Model, optimizer,
scheduler, RNG states and the micro-batch buffer's shuffle RNG are HF/posttrain's usual resume state. On resume
the trainer pushes its checkpoint weights (``version = global_step``) and starts a fresh worker at ``next_round``;
rounds that were in flight or queued when the run stopped are lost and regenerated (from the restored weights,
with the same request seeds). The vllm_server backend's request counter (evaluation requests) is in posttrain's
resume state. Not supported: ``num_iterations > 1``.

Partial rollouts (``partial_rollout_max_tokens``, opt-in; ``posttrain.rollout.partial``): the worker generates in
passes of at most that many new tokens per row; finished groups train at once, unfinished completions continue
under the next weights; every token carries the weight version that sampled it, the IS correction is per token and
so is staleness (the round's oldest token decides), and the version-lag distribution is logged
(``sample/version_lag_frac/<k>``).

Images (TRL's VLM format: ``prompt`` plus an ``image`` / ``images`` column, checked as in ``GRPOTrainer``): the worker
renders each prompt with the model's processor and sends its images to the server in vLLM's multimodal prompt format
(the server's processor rebuilds the vision inputs); the round carries each row's processor outputs
(``vision_inputs``), which the trainer's π_old / π_ref / loss forwards get. ``max_staleness=0`` then equals
server-mode VLM GRPO bitwise, as for text. Not with partial rollouts.

``rollout_func`` runs in the worker (``WorkerTrainerView``); a streaming ``train_dataset`` is read in order by the
worker (``StreamRoundSource``; on resume the stream is re-read and the consumed rounds skipped).

Several training processes (accelerate / torchrun; DDP, FSDP2): one worker on rank 0 produces each round as one shard
per rank, rank 0 sends each rank its shard and pushes the weights (``posttrain.rollout.multiprocess``: why one worker,
the bounded waits, the distributed modes refused); ``max_staleness=0`` equals synchronous N-process server-mode GRPO.
A shard is the rank's whole pipeline batch, so per-row extras travel with it: ``keep_routing``'s prompt/completion
routing reaches every rank and is replayed there.

Agent training as in ``GRPOTrainer`` (TRL's ``tools=`` and ``environment_factory``): the tool-calling loop runs in
the rollout worker around its server requests (see ``rollout_worker``), one environment per rollout.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from posttrain.experimental.async_grpo.rollout_worker import RolloutWorkerSpec
from posttrain.rollout.async_worker import ROLLOUT_STATE, AsyncRollout, RolloutWorkerError
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.partial import PartialRolloutSpec
from posttrain.rollout.pipeline import RolloutSettings
from posttrain.trainers.grpo import GRPOTrainer

__all__ = ["ROLLOUT_STATE", "AsyncGRPOTrainer", "RolloutWorkerError"]


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with a rollout worker streaming generation rounds from a server (see the module docstring).

    The constructor is ``GRPOTrainer``'s (``tools``, ``environment_factory`` and ``rollout_func`` included; the
    worker calls a ``rollout_func`` with a ``WorkerTrainerView`` as its ``trainer``). ``train_dataset`` may be a
    streaming ``IterableDataset`` (``max_steps`` required, as in GRPO). Reward functions, tools, environment
    factories, the rollout function and the dataset must be picklable: the worker process receives them pickled.

    The rollout worker and the weight pushes are the :class:`~posttrain.rollout.async_worker.AsyncRollout` component
    (``self.async_rollout``); the loss is ``GRPOTrainer``'s.
    """

    config_class = AsyncGRPOConfig
    _trainer_name = "AsyncGRPO"
    _tag_names = ["posttrain", "async-grpo"]
    supports_vision = True  # image rows: the worker sends them to the server, the trainer's forwards get their inputs
    _picklable_hint = "reward functions, tools, environment factories, their processing classes and the dataset"

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, *a, **kwargs):
        super().__init__(model, reward_funcs, args, train_dataset, *a, **kwargs)
        if self.args.partial_rollout_max_tokens is not None:
            refused = {
                "rollout_func": self.rollout_func is not None,
                "tools / environment_factory": self.agent is not None,
                "image rows (an `image` / `images` column)": getattr(self, "_vision", False),
            }
            for option, used in refused.items():
                if used:
                    raise ValueError(
                        f"partial_rollout_max_tokens cannot be combined with {option}: a partial rollout continues a "
                        "completion from its text-only tokens on the generation server, which a rollout "
                        "function, a tool loop or an image prompt does not expose. Set partial_rollout_max_tokens=None (whole rounds)."
                    )
        check_several_processes(
            self.accelerator.num_processes, self.args, self.rollout_func, self.train_dataset,
            images=getattr(self, "_vision", False),
        )
        self.async_rollout = AsyncRollout(
            self, make_spec=self._worker_spec, score=self._score_with_current_policy, trainer_name=self._trainer_name,
            picklable_hint=self._picklable_hint,
        )  # fmt: skip

    def _make_backend(self, rollout_func: Any) -> Any:
        """The server backend; with a ``rollout_func``, the function's backend over it (``inner``): evaluation
        calls the function in this process (with this trainer), the weight pushes and versions reach the server,
        and the rollout worker calls the function with a ``WorkerTrainerView``."""
        server = super()._make_backend(None)
        if rollout_func is None:
            return server
        backend = super()._make_backend(rollout_func)
        backend.inner = server
        return backend

    # -- worker ------------------------------------------------------------------------------------------------
    def _worker_settings(self) -> RolloutSettings:
        """The pipeline settings for the worker: no policy there, so no π_old / π_ref / IS (done here on consume)."""
        settings = self._rollout_settings()
        settings.compute_old_logps = settings.compute_ref_logps = False
        settings.importance_sampling = None
        return settings

    def _worker_spec(self) -> RolloutWorkerSpec:
        estimator = self.pipeline.estimator
        if estimator.needs_old_logps or estimator.needs_ref_logps:
            raise ValueError(f"{type(estimator).__name__} needs log-probs, which the rollout worker cannot compute.")
        return RolloutWorkerSpec(
            **self.async_rollout.spec_fields(), scorer=self.scorer, estimator=estimator, settings=self._worker_settings(),
            agent=self.agent, rollout_func=self.rollout_func, args=self.args if self.rollout_func is not None else None,
            partial=self._partial_spec(),
        )  # fmt: skip

    def _partial_spec(self) -> PartialRolloutSpec | None:
        """Partial rollouts (``partial_rollout_max_tokens``): the worker's settings, resumed at the first group the
        trainer has not consumed (the consumed ones after it are skipped; see ``posttrain.rollout.partial``)."""
        args = self.args
        if args.partial_rollout_max_tokens is None:
            return None
        rollout = self.async_rollout
        if rollout.partial_next_group is None:
            rollout.partial_next_group = 0
        return PartialRolloutSpec(
            max_tokens=int(args.partial_rollout_max_tokens), max_staleness=int(args.max_staleness),
            max_completion_length=int(self.sampling.max_new_tokens), start_group=rollout.partial_next_group,
            skip_groups=sorted(rollout.partial_consumed),
        )  # fmt: skip

    # -- data path ---------------------------------------------------------------------------------------------
    def _score_with_current_policy(self, batch: RolloutBatch, record) -> RolloutBatch:
        """π_old (and π_ref) under the weights trained now, then the IS correction against the sampler (core/).

        On-policy (the default) the correction is deferred to the loss, whose forward pass under these same
        weights gives π_old: no extra pass here (``RolloutSettings.defer_importance_sampling``)."""
        pipeline, device = self.pipeline, self.accelerator.device
        settings = pipeline.settings
        importance = settings.importance_sampling if "sampling_per_token_logps" in batch else None
        if pipeline.defers_importance_sampling():
            importance = None
        if settings.compute_old_logps or importance is not None:
            batch["old_per_token_logps"] = pipeline.logps_in_chunks(self._policy_logps_no_grad, batch, device).cpu()
        if settings.compute_ref_logps and pipeline.ref_logps is not None:
            batch["ref_per_token_logps"] = pipeline.logps_in_chunks(pipeline.ref_logps, batch, device).cpu()
        if importance is not None:
            pipeline.importance_sampling(batch, importance, record)
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    # -- delegation to the async rollout -----------------------------------------------------------------------
    def train(self, *args, **kwargs):
        return self.async_rollout.run(super().train, *args, **kwargs)

    def evaluate(self, *args, **kwargs):
        self.async_rollout.join_push()  # evaluate on the newest pushed weights, not on ones still being uploaded
        return super().evaluate(*args, **kwargs)

    def _load_rng_state(self, checkpoint: Any) -> None:
        self.async_rollout.load_rng_state(checkpoint, super()._load_rng_state)

    def _save_checkpoint(self, *args, **kwargs):
        self.async_rollout.join_push()  # the checkpoint's weight_version is on the server when it is written
        return super()._save_checkpoint(*args, **kwargs)

    def _prepare_inputs(self, inputs: Any) -> Any:
        return self.async_rollout.prepare_inputs(inputs, super()._prepare_inputs)

    def _extra_checkpoint_state(self) -> dict[str, Any]:
        return self.async_rollout.checkpoint_state(super()._extra_checkpoint_state())

    def _load_extra_checkpoint_state(self, states: dict[str, Any]) -> None:
        super()._load_extra_checkpoint_state(states)
        self.async_rollout.load_checkpoint_state(states)


def check_several_processes(
    num_processes: int, args: Any, rollout_func: Any, train_dataset: Any, images: bool = False
) -> None:
    """Refuse what AsyncGRPO does not support with several training processes yet: the worker's per-rank shards are
    built from whole rounds of a map-style dataset (``ValueError`` naming the option and the fix)."""
    if num_processes <= 1:
        return
    from datasets import IterableDataset

    several = {
        "partial_rollout_max_tokens": args.partial_rollout_max_tokens is not None,
        "rollout_func": rollout_func is not None,
        "a streaming train_dataset": isinstance(train_dataset, IterableDataset),
        "image rows": images,
    }
    for option, used in several.items():
        if used:
            raise ValueError(
                f"AsyncGRPO with {num_processes} training processes does not support {option} yet (the worker's "
                "per-rank shards are built from whole rounds of a map-style dataset); train it with one process, "
                "or drop that option."
            )
