"""SDPO's rollout stage: which samples get a teacher, and the teacher's prompt (TRL's
``SuccessfulRolloutTeacherContextBuilder``).

For every completion of a generation batch (all processes, groups of ``num_generations`` consecutive rows):

- its *demonstration* is the first other completion of its group whose reward is ``>= success_reward_threshold``
  (``use_successful_as_teacher``; with ``dont_reprompt_on_self_success=False`` the completion itself may be its own
  demonstration);
- its *feedback* is the row's ``privileged_context`` when it is a non-blank string and
  ``include_environment_feedback`` is set (with ``environment_feedback_only_without_solution``: only when there is no
  demonstration);
- a completion with a demonstration or feedback gets ``self_distillation_mask = 1`` and the teacher prompt
  ``reprompt_template.format(prompt=..., solution=solution_template.format(successful_previous_attempt=demo),
  feedback=feedback_template.format(feedback_raw=feedback))`` (an empty string for a missing part). A
  conversational prompt keeps its leading messages and has its last user turn replaced by that text; the others keep
  their own prompt (mask 0, not distilled).

The demonstration is the completion's decoded text (special tokens skipped); ``remove_thinking_from_demonstration``
strips ``<think>...</think>`` blocks from it. Rewards that are NaN (every reward function returned None) never count
as successes.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.experimental._self_distillation import fill_teacher_prompt, last_user_text

__all__ = ["SuccessfulRolloutTeacherContextBuilder", "TeacherContexts", "extract_last_user_text"]

logger = logging.getLogger(__name__)
_THINK = re.compile(r"<think>.*?</think>", flags=re.DOTALL)


def extract_last_user_text(messages: list[dict[str, Any]]) -> str:
    """The text of the final user turn of a conversational prompt (text parts of a list content joined by spaces);
    the shared builder's :func:`~posttrain.experimental._self_distillation.last_user_text`."""
    return last_user_text(messages)


@dataclass
class TeacherContexts:
    """The stage's output for this process's rows.

    Attributes:
        teacher_prompts: One prompt per local row, in the dataset's format (text, or messages): the re-prompt for
            rows with a teacher, the row's own prompt otherwise.
        self_distillation_mask: ``(B_local,)`` float, 1 = the row is distilled.
        demonstration_indices: Per local row, the global index of its demonstration (None: none).
        metrics: TRL's ``self_distillation/*`` fractions over the whole batch.
    """

    teacher_prompts: list[Any]
    self_distillation_mask: torch.Tensor
    demonstration_indices: list[int | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class SuccessfulRolloutTeacherContextBuilder:
    """Builds teacher contexts from successful rollouts (and optional environment feedback); see the module docstring.

    Args:
        args: An :class:`~posttrain.experimental.sdpo.SDPOConfig` (or any object with its re-prompting fields), or
            a trainer holding one as ``.args`` (TRL's constructor takes the trainer).
    """

    def __init__(self, args: Any):
        self.args = args if hasattr(args, "reprompt_template") else args.args
        self.last_metrics: dict[str, float] = {}
        self._warned_ignored_feedback = False

    def _reprompt(self, prompt: Any, solution: str, feedback: str) -> Any:
        """The re-prompt through SDFT's and SDPO's one teacher-prompt builder (``fill_teacher_prompt``)."""
        return fill_teacher_prompt(prompt, self.args.reprompt_template, solution=solution, feedback=feedback)

    def demonstration_text(self, completion: str) -> str:
        if self.args.remove_thinking_from_demonstration:
            return _THINK.sub("", completion).strip()
        return completion

    def build(
        self,
        prompts: list[Any],
        rewards: torch.Tensor,
        completions: list[str],
        num_generations: int,
        feedbacks: list[Any] | None = None,
        local: slice | None = None,
    ) -> TeacherContexts:
        """Teacher contexts of the rows in ``local`` from the whole (gathered) generation batch.

        Args:
            prompts: ``N`` prompts (text or messages), each repeated for the ``num_generations`` rows of its group.
            rewards: ``(N,)`` combined rewards (NaN = unscorable).
            completions: ``N`` decoded completion texts (the demonstrations' source).
            num_generations: Group size G (``N`` is a multiple of it).
            feedbacks: ``N`` ``privileged_context`` values (None / blank = no feedback), or None.
            local: This process's rows (default: all).
        """
        args = self.args
        total = len(prompts)
        if rewards.numel() != total or len(completions) != total:
            raise ValueError(
                f"build() needs one reward and one completion per prompt; got {total} prompts, {rewards.numel()} "
                f"rewards and {len(completions)} completions."
            )
        if total % num_generations:
            raise ValueError(f"{total} rows do not form whole groups of num_generations={num_generations}.")
        feedbacks = list(feedbacks) if feedbacks is not None else [None] * total
        local = local if local is not None else slice(0, total)
        values = [float(r) for r in rewards.detach().float().cpu().tolist()]
        successful_row = [not math.isnan(r) and r >= args.success_reward_threshold for r in values]

        mask = torch.zeros(total)
        demo: list[int | None] = [None] * total
        use_feedback = [False] * total
        groups_with_success = with_solution = feedback_available = feedback_used = 0
        for i in range(total):
            start = i - i % num_generations
            group = range(start, start + num_generations)
            if i == start and any(successful_row[j] for j in group):
                groups_with_success += 1
            if args.use_successful_as_teacher:
                skip_self = args.dont_reprompt_on_self_success
                candidates = [j for j in group if successful_row[j] and not (skip_self and j == i)]
                demo[i] = candidates[0] if candidates else None
            has_solution = demo[i] is not None
            has_feedback = isinstance(feedbacks[i], str) and feedbacks[i].strip() != ""
            feedback_available += has_feedback
            use_feedback[i] = bool(
                args.include_environment_feedback
                and has_feedback
                and (not args.environment_feedback_only_without_solution or not has_solution)
            )
            feedback_used += use_feedback[i]
            with_solution += has_solution
            if has_solution or use_feedback[i]:
                mask[i] = 1.0

        if feedback_available and not args.include_environment_feedback and not self._warned_ignored_feedback:
            self._warned_ignored_feedback = True
            logger.warning(
                "SDPO received environment feedback (`privileged_context`) in the batch, but "
                "`include_environment_feedback=False`, so it is being ignored (no reprompting from feedback). Set "
                "`include_environment_feedback=True` to use it."
            )

        teacher_prompts = []
        for i in range(total)[local]:
            if not mask[i]:
                teacher_prompts.append(prompts[i])
                continue
            solution = ""
            if demo[i] is not None:
                text = self.demonstration_text(completions[demo[i]])
                solution = args.solution_template.format(successful_previous_attempt=text)
            feedback = args.feedback_template.format(feedback_raw=feedbacks[i]) if use_feedback[i] else ""
            teacher_prompts.append(self._reprompt(prompts[i], solution, feedback))

        n = max(total, 1)
        self.last_metrics = {
            "self_distillation/success_group_fraction": groups_with_success / max(1, total // num_generations),
            "self_distillation/success_sample_fraction": with_solution / n,
            "self_distillation/feedback_available_fraction": feedback_available / n,
            "self_distillation/feedback_used_fraction": feedback_used / n,
            "self_distillation/reprompt_sample_fraction": float(mask.mean()) if total else 0.0,
        }
        return TeacherContexts(
            teacher_prompts=teacher_prompts,
            self_distillation_mask=mask[local].clone(),
            demonstration_indices=demo[local],
            metrics=dict(self.last_metrics),
        )
