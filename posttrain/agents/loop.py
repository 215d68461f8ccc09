"""The multi-turn tool-calling loop, as a generation backend wrapper: ``ToolCallingBackend``.

``ToolCallingBackend(inner_backend, tokenizer, tools, ...)`` implements the ``GenerationBackend`` protocol
(``generate(prompt_ids, sampling, num_generations) -> Completions``) around any inner backend (``GroupSampler``,
``TransformersBackend``, vLLM):

1. the inner backend generates the first assistant turn of every rollout;
2. each turn that ended with EOS is parsed for tool calls (``tool_calls.TOOL_CALL_PARSERS``); a turn whose
   tool-call markup does not parse is plain text and final, as in TRL (``tool_calls.assistant_message``), and string
   arguments are cast with the tool's schema;
3. the calls of all rollouts run together (async tools concurrently; errors become error messages, see ``tools``);
4. the tool messages are rendered into *suffix tokens* by diffing two renders of a dummy conversation (with and
   without the tool messages + generation prompt), so the earlier tokens are never re-tokenised;
5. generation continues from ``prompt + completion so far + suffix`` (the concatenated ids) for the rollouts that
   made calls, with the remaining budget.

It stops per rollout when a turn makes no call, the completion budget (``max_completion_length`` tokens, tool
tokens included) is spent, or ``max_tool_calling_iterations`` rounds of calls have run. A tool result that would
leave no room for another generated token (or pass ``max_model_length``) is rolled back: the rollout ends after
the turn that made the call.

``Completions.extra`` carries, per rollout, ``tool_mask`` (1 = model token, 0 = tool/template token, to be
multiplied into the loss mask and excluded from token counts; their sampling log-probs are 0),
``tool_call_count``, ``tool_failure_count`` and ``completion_messages`` (the parsed conversation: assistant turns
with ``tool_calls``, tool messages, ...), which is what conversational reward functions receive as ``completions``.

Vision-language rollouts (``generate(..., vision_inputs=...)``, a processor as ``tokenizer``): a tool may answer
with image blocks (``[{"type": "image", "image": img}, {"type": "text", ...}]``); the processor expands their
placeholders in the suffix and processes the images, which join the rollout's vision inputs (the prompt's images
first, in sequence order) for the next turn and come back as ``extra["vision_inputs"]``; their tokens are tool
tokens (``tool_mask`` 0).

The chat template must be prefix-preserving (appending a tool message must not re-render earlier turns);
:func:`prepare_tool_chat_template` checks it at start-up and swaps in a known training template or refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.tool_calls import ToolCallParser, assistant_message, detect_tool_call_parser
from posttrain.agents.tools import Tool, build_tools, execute_tool_calls
from posttrain.generation.base import Completions, SamplingConfig


def prepare_tool_chat_template(processing_class: Any) -> str | None:
    """Make sure the chat template can drive the tool loop; swap in a training template when one is known.

    Checks that the template renders tool calls and tool responses (``supports_tool_calling``) and that it is
    prefix-preserving when a tool message is appended (``is_chat_template_prefix_preserving``). A template that is
    not gets replaced, on ``processing_class.chat_template``, by its family's training template
    (``get_training_chat_template``), which is then used for all rendering and saved with the model.

    Returns:
        The template that was swapped in, or ``None`` when the original is kept.

    Raises:
        ValueError: The template cannot render tools, or is not prefix-preserving and no training template is
            known for it; the message names the problem and the fix.
    """
    from posttrain.data.chat_templates import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    if not supports_tool_calling(processing_class):
        raise ValueError(
            "Tools need a chat template that renders tool calls and tool responses, and this one does not (a probe "
            "conversation user → assistant(tool_calls) → tool lost the call's name, arguments or the tool result). "
            "Use a tool-calling model's template (e.g. Qwen2.5/Qwen3 ChatML) or pass one via "
            "processing_class.chat_template."
        )
    if is_chat_template_prefix_preserving(processing_class):
        return None
    try:
        training = get_training_chat_template(processing_class)
    except ValueError as err:
        raise ValueError(
            "The tool-calling loop needs a prefix-preserving chat template (appending a tool message must not "
            "change how earlier messages render, since generation continues from the concatenated token ids), and "
            f"this one is not. No training template is known for it: {err}"
        ) from err
    if training is None or processing_class.chat_template == training:
        raise ValueError(
            "The chat template is not prefix-preserving when a tool message is appended, and its known training "
            "template does not fix that. Pass a prefix-preserving template via processing_class.chat_template."
        )
    processing_class.chat_template = training
    inner = getattr(processing_class, "tokenizer", None)
    if inner is not None and getattr(inner, "chat_template", None) is not None:
        inner.chat_template = training
    return training


@dataclass
class _Rollout:
    """The growing state of one rollout."""

    prompt_ids: list[int]
    tools: Mapping[str, Tool]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    finished: bool = False
    pending: list = field(default_factory=list)  # calls of the latest turn, not yet executed
    vision: dict[str, Any] | None = None  # the prompt's + tool images' processor outputs (vision-language rollouts)


def tool_metrics(call_counts: Sequence[float], failure_counts: Sequence[float]) -> dict[str, float]:
    """TRL's ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency`` (failed / calls).

    Pass the counts of the whole (gathered) batch.
    """
    n, calls, failures = len(call_counts), float(sum(call_counts)), float(sum(failure_counts))
    return {
        "tools/call_frequency": calls / n if n else 0.0,
        "tools/failure_frequency": failures / calls if calls else 0.0,
    }


class ToolCallingBackend:
    """A ``GenerationBackend`` that runs the multi-turn tool-calling loop around ``inner_backend``.

    Args:
        inner_backend: Any ``GenerationBackend`` (it generates each turn).
        tokenizer: The policy's tokenizer or processor (its chat template renders the tool turns).
        tools: Functions (or :class:`~posttrain.agents.tools.Tool`) available to every rollout; per-rollout tools
            (environments) are passed to :meth:`generate` instead.
        max_tool_calling_iterations: Most rounds of tool calls per rollout (``None`` = until the budget is spent).
        max_completion_length: Token budget of a whole completion, tool tokens included (``None`` = the sampling
            config's ``max_new_tokens``).
        tool_call_parser: A registered parser name or a callable; ``None`` = detected from the chat template.
        chat_template_kwargs: Passed to every ``apply_chat_template`` call (e.g. ``{"enable_thinking": False}``).
        max_model_length: Longest ``prompt + completion`` the model accepts (``None`` = no check).
        check_chat_template: Run :func:`prepare_tool_chat_template` now (may swap the template).

    After each :meth:`generate`, ``last_stats`` holds ``iterations`` (rounds run), ``tool_call_count``,
    ``tool_failure_count`` and ``rolled_back`` (rollouts whose last tool result did not fit).
    """

    def __init__(
        self,
        inner_backend: Any,
        tokenizer: Any,
        tools: Iterable[Callable[..., Any] | Tool] | None = None,
        max_tool_calling_iterations: int | None = None,
        max_completion_length: int | None = None,
        *,
        tool_call_parser: str | ToolCallParser | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_model_length: int | None = None,
        check_chat_template: bool = True,
    ):
        if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
            raise ValueError(
                f"max_tool_calling_iterations must be >= 0 or None (unbounded), got {max_tool_calling_iterations}."
            )
        if max_completion_length is not None and max_completion_length < 1:
            raise ValueError(f"max_completion_length must be a positive integer, got {max_completion_length}.")
        self.inner = inner_backend
        self.tokenizer = tokenizer
        self.tools = build_tools(tools)
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.max_completion_length = max_completion_length
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_model_length = max_model_length
        if check_chat_template:
            prepare_tool_chat_template(tokenizer)
        self.parser = tool_call_parser or detect_tool_call_parser(tokenizer, self.chat_template_kwargs)
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        eos = tok.eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self._dummy_prefix: list[int] | None = None
        self.last_stats: dict[str, Any] = {}
        # a processor with an image processor can show tools' image blocks to the model (multimodal tool responses)
        self.supports_images = getattr(tokenizer, "image_processor", None) is not None

    def sync_weights(self, model: Any) -> None:
        """Forwarded to the inner backend."""
        self.inner.sync_weights(model)

    # -- rendering -----------------------------------------------------------------------------------------------
    def _render_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        from posttrain.data.chat_templates import render_chat

        return render_chat(
            self.tokenizer,
            messages,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )["input_ids"]

    _DUMMY = ({"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"})

    def tool_suffix_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """Token ids that follow an assistant turn's EOS: the tool messages, then the next generation prompt.

        Computed as ``render(dummy + tool_messages, add_generation_prompt=True)`` minus ``render(dummy)`` cut after
        its last EOS (what a template writes after the end-of-turn token, e.g. ``"\\n"``, belongs to the suffix
        since the generated turn stops at EOS).
        """
        if self._dummy_prefix is None:
            prefix = self._render_ids(list(self._DUMMY), add_generation_prompt=False)
            ends = [i for i, t in enumerate(prefix) if t in self.eos_token_ids]
            if not ends:
                raise ValueError(
                    "The chat template does not end an assistant turn with the EOS token "
                    f"({sorted(self.eos_token_ids)}), so the tool loop cannot tell where a turn stops. Set "
                    "tokenizer.eos_token to the template's end-of-turn token."
                )
            self._dummy_prefix = prefix[: ends[-1] + 1]
        prefix = self._dummy_prefix
        full = self._render_ids([*self._DUMMY, *tool_messages], add_generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "Appending a tool message re-rendered the earlier turns (the chat template is not prefix-preserving "
                "for these tool messages); use a prefix-preserving training template."
            )
        return full[len(prefix) :]

    def tool_suffix_multimodal(self, tool_messages: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
        """Suffix ids and vision inputs for tool messages holding image blocks: the suffix *text* is the diff of two
        renders (as :meth:`tool_suffix_ids`, cut after the dummy's last EOS), and the processor turns it and the
        images into ids (each image placeholder expanded to the model's image tokens) plus the images' processor
        outputs (per-token keys 1-D over the suffix)."""
        from posttrain.data.chat_templates import render_chat
        from posttrain.data.vision_prompts import PER_TOKEN_VISION_KEYS

        tok = getattr(self.tokenizer, "tokenizer", self.tokenizer)
        eos_text = tok.eos_token
        prefix = render_chat(self.tokenizer, list(self._DUMMY), **self.chat_template_kwargs)
        prefix = prefix[: prefix.rindex(eos_text) + len(eos_text)]
        full = render_chat(
            self.tokenizer, [*self._DUMMY, *tool_messages], add_generation_prompt=True, **self.chat_template_kwargs
        )
        if not full.startswith(prefix):
            raise ValueError(
                "Appending a tool message re-rendered the earlier turns (the chat template is not prefix-preserving "
                "for these tool messages); use a prefix-preserving training template."
            )
        images = [
            block["image"]
            for message in tool_messages
            if isinstance(message.get("content"), list)
            for block in message["content"]
            if block.get("type") == "image"
        ]
        processed = self.tokenizer(
            text=[full[len(prefix) :]], images=[images], add_special_tokens=False, return_tensors="pt"
        )
        vision = {
            key: (value[0] if key in PER_TOKEN_VISION_KEYS else value)
            for key, value in processed.items()
            if key not in ("input_ids", "attention_mask") and hasattr(value, "shape")
        }
        return [int(t) for t in processed["input_ids"][0].tolist()], vision

    def _decode_turn(self, ids: list[int]) -> str:
        end = len(ids)
        while end > 0 and ids[end - 1] in self.eos_token_ids:
            end -= 1
        return self.tokenizer.decode(ids[:end], skip_special_tokens=False)

    # -- the loop ------------------------------------------------------------------------------------------------
    def _add_turn(self, rollout: _Rollout, ids: list[int], logprobs: list[float] | None, finished: bool) -> None:
        rollout.ids.extend(ids)
        rollout.mask.extend([1] * len(ids))
        rollout.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        rollout.finished = finished
        message, calls = assistant_message(self._decode_turn(ids), self.parser, rollout.tools)
        rollout.messages.append(message)
        # A turn cut by the budget is not acted on: its call (if any) may be incomplete and there is no room left.
        rollout.pending = calls if finished else []

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        num_generations: int = 1,
        *,
        tools: Sequence[Mapping[str, Tool]] | None = None,
        vision_inputs: Sequence[Mapping[str, Any]] | None = None,
    ) -> Completions:
        """Generate ``len(prompt_ids) * num_generations`` tool-using completions, ``[p0 g0, p0 g1, ..., p1 g0, ...]``.

        Args:
            prompt_ids: Unpadded prompt ids (already rendered with the tool schemas).
            sampling: Sampling settings; ``max_new_tokens`` is the budget unless ``max_completion_length`` is set.
            num_generations: Completions per prompt (the inner backend shares each prompt's prefill).
            tools: Per output row, the tools that rollout may call (e.g. its environment's methods); ``None`` =
                this backend's ``tools`` for every row.
            vision_inputs: A vision-language batch: per prompt, its processor outputs (``{}`` for a text-only
                prompt). Tools may then answer with image blocks: the images join the rollout's vision inputs, the
                next turn is generated with all of them, and their tokens are tool tokens (mask 0, never trained).
                ``extra["vision_inputs"]`` holds each rollout's final vision inputs.

        Returns:
            ``Completions`` whose ``completion_ids`` hold model and tool tokens; see the module docstring for
            ``extra``. ``finished`` is whether the last turn ended with EOS.
        """
        s = sampling.resolved()
        budget = self.max_completion_length or s.max_new_tokens
        vision_kwargs = {} if vision_inputs is None else {"vision_inputs": list(vision_inputs)}
        first = self.inner.generate(
            prompt_ids, dataclasses.replace(s, max_new_tokens=budget), num_generations, **vision_kwargs
        )
        n = len(first)
        if tools is not None and len(tools) != n:
            raise ValueError(f"tools has {len(tools)} entries but there are {n} rollouts; give one tool set per row.")
        row_tools = list(tools) if tools is not None else [self.tools] * n
        rollouts = [_Rollout(list(first.prompt_ids[i]), row_tools[i]) for i in range(n)]
        for i, rollout in enumerate(rollouts):
            if vision_inputs is not None:
                rollout.vision = vision_inputs[i // num_generations]  # shared until a tool adds images
            self._add_turn(rollout, first.completion_ids[i], _row(first.logprobs, i), first.finished[i])

        iterations, rolled_back = 0, 0
        cap = self.max_tool_calling_iterations
        while cap is None or iterations < cap:
            acting = [r for r in rollouts if r.pending]
            if not acting:
                break
            outcomes = execute_tool_calls(
                [r.pending for r in acting],
                [r.tools for r in acting],
                supports_images=self.supports_images and vision_inputs is not None,
            )
            continuing = []
            for rollout, results in zip(acting, outcomes):
                rollout.pending = []
                rollout.calls += len(results)
                rollout.failures += sum(o.failed for o in results)
                tool_messages = [o.message for o in results]
                rollout.messages.extend(tool_messages)
                suffix_vision = None
                if any(isinstance(m.get("content"), list) for m in tool_messages):
                    suffix, suffix_vision = self.tool_suffix_multimodal(tool_messages)
                else:
                    suffix = self.tool_suffix_ids(tool_messages)
                total = len(rollout.ids) + len(suffix)
                too_long = total >= budget or (
                    self.max_model_length is not None and len(rollout.prompt_ids) + total >= self.max_model_length
                )
                if too_long:  # no room for the answer: end the rollout after the calling turn
                    rollout.messages = rollout.messages[: len(rollout.messages) - len(tool_messages)]
                    rolled_back += 1
                    continue
                if suffix_vision is not None:
                    rollout.vision = _extend_vision(
                        rollout.vision or {}, suffix_vision, len(rollout.prompt_ids) + len(rollout.ids)
                    )
                rollout.ids.extend(suffix)
                rollout.mask.extend([0] * len(suffix))
                rollout.logprobs.extend([0.0] * len(suffix))
                continuing.append(rollout)
            iterations += 1
            if not continuing:
                break
            remaining = [budget - len(r.ids) for r in continuing]
            turn_sampling = dataclasses.replace(s, max_new_tokens=max(remaining))
            turn_vision = {}
            if vision_inputs is not None:
                turn_vision["vision_inputs"] = [
                    _extend_vision(r.vision or {}, {}, len(r.prompt_ids) + len(r.ids)) for r in continuing
                ]
            out = self.inner.generate([r.prompt_ids + r.ids for r in continuing], turn_sampling, 1, **turn_vision)
            for k, (rollout, room) in enumerate(zip(continuing, remaining)):
                ids, logprobs, finished = out.completion_ids[k], _row(out.logprobs, k), out.finished[k]
                if len(ids) > room:  # the batch generated up to the largest budget; this rollout had less
                    ids, finished = ids[:room], False
                    logprobs = logprobs[:room] if logprobs is not None else None
                self._add_turn(rollout, ids, logprobs, finished)

        self.last_stats = {
            "iterations": iterations,
            "tool_call_count": sum(r.calls for r in rollouts),
            "tool_failure_count": sum(r.failures for r in rollouts),
            "rolled_back": rolled_back,
        }
        return Completions(
            completion_ids=[r.ids for r in rollouts],
            logprobs=[r.logprobs for r in rollouts] if first.logprobs is not None else None,
            finished=[r.finished for r in rollouts],
            prompt_ids=[r.prompt_ids for r in rollouts],
            extra={
                "tool_mask": [r.mask for r in rollouts],
                "tool_call_count": [r.calls for r in rollouts],
                "tool_failure_count": [r.failures for r in rollouts],
                "completion_messages": [r.messages for r in rollouts],
                **({"vision_inputs": [r.vision for r in rollouts]} if vision_inputs is not None else {}),
            },
        )


def _extend_vision(vision: Mapping[str, Any], added: Mapping[str, Any], length: int) -> dict[str, Any]:
    """A rollout's vision inputs with ``added`` (a tool suffix's processor outputs) appended at token ``length``:
    image-level outputs concatenated after the earlier images (their order in the sequence), per-token outputs
    zero-filled over the tokens between (generated text) and extended with the suffix's values."""
    import torch

    from posttrain.data.vision_prompts import PER_TOKEN_VISION_KEYS, collate_vision_inputs

    out = dict(vision)
    for key in PER_TOKEN_VISION_KEYS:
        if key in out or key in added:
            current = out.get(key)
            if current is None:
                current = torch.zeros(0, dtype=added[key].dtype)
            if current.shape[0] < length:
                current = torch.cat([current, current.new_zeros(length - current.shape[0])])
            out[key] = torch.cat([current, added[key]]) if key in added else current
    image_level = [{k: v for k, v in part.items() if k not in PER_TOKEN_VISION_KEYS} for part in (vision, added)]
    # concatenated over the images, trailing dimensions zero-padded to the larger (e.g. LLaVA-NeXT's tile counts)
    out.update(collate_vision_inputs([part for part in image_level if part], prompt_width=0))
    return out


def _row(logprobs: list[list[float]] | None, i: int) -> list[float] | None:
    return None if logprobs is None else list(logprobs[i])


class AgentRollout:
    """Agent training's part of the online-RL rollout, built once by the trainer.

    Holds the shared ``tools`` and the ``environment_factory`` pool, checks the chat template, wraps the
    generation backend in a :class:`ToolCallingBackend`, and per batch resets the environments and gives every
    rollout its prompt, tool schemas and tools (:meth:`prepare`).

    Args:
        tokenizer: The policy's tokenizer or processor.
        tools: Functions every rollout may call (TRL's ``GRPOTrainer(tools=...)``).
        environment_factory: TRL's ``environment_factory`` (callable or ``{name: callable}``), see
            ``posttrain.agents.environments``.
        max_tool_calling_iterations / max_completion_length / tool_call_parser / chat_template_kwargs /
            max_model_length: As in :class:`ToolCallingBackend`.

    Attributes:
        reward_funcs: One reward function per environment class with ``get_reward`` (append them to the trainer's).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Iterable[Callable[..., Any] | Tool] | None = None,
        environment_factory: Any = None,
        max_tool_calling_iterations: int | None = None,
        max_completion_length: int | None = None,
        tool_call_parser: str | ToolCallParser | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_model_length: int | None = None,
    ):
        from posttrain.agents.environments import EnvironmentPool

        self.tokenizer = tokenizer
        self.tools = build_tools(tools)
        self.pool = EnvironmentPool(environment_factory) if environment_factory is not None else None
        if not self.tools and self.pool is None:
            raise ValueError("AgentRollout needs tools=[...] or an environment_factory.")
        if self.pool is not None:
            for name, methods in self.pool.tool_names().items():
                clash = sorted(set(methods) & set(self.tools))
                if clash:
                    where = f"environment {name!r}" if name else self.pool.env_types[name].__name__
                    raise ValueError(
                        f"Tool name(s) {clash} are both in tools=[...] and methods of {where}; rename one."
                    )
        self.reward_funcs = self.pool.reward_functions() if self.pool is not None else []
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.max_completion_length = max_completion_length
        self.tool_call_parser = tool_call_parser
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_model_length = max_model_length
        prepare_tool_chat_template(tokenizer)

    def wrap(self, inner_backend: Any) -> ToolCallingBackend:
        """``inner_backend`` wrapped in the tool loop (the chat template was checked at construction)."""
        return ToolCallingBackend(
            inner_backend,
            self.tokenizer,
            self.tools.values(),
            self.max_tool_calling_iterations,
            self.max_completion_length,
            tool_call_parser=self.tool_call_parser,
            chat_template_kwargs=self.chat_template_kwargs,
            max_model_length=self.max_model_length,
            check_chat_template=False,
        )

    def prepare(self, rows: list[dict[str, Any]]):
        """Reset one environment per row (if any) and return the batch's ``AgentBatch`` (prompts, schemas, tools).

        Prompts must be conversational (message lists): the tool schemas are rendered by the chat template.
        """
        from posttrain.agents.environments import prepare_rows

        batch = prepare_rows(rows, self.tools, self.pool)
        for index, row in enumerate(batch.rows):
            if not isinstance(row["prompt"], list):
                raise ValueError(
                    f"Row {index} has a standard (string) prompt, but tools need conversational prompts: the chat "
                    "template renders the tool schemas. Use {'prompt': [{'role': 'user', 'content': ...}]}."
                )
        return batch
