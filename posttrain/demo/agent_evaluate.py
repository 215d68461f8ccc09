"""Held-out evaluation for the agent demo: run the tool loop as GRPO does, score success and tool use.

Rollouts go through the same machinery GRPO trains with: ``AgentRollout`` (one :class:`CalculatorEnv` per rollout
through ``environment_factory``, its tools rendered by the chat template) wrapped around posttrain's group sampler.
For every held-out problem the model answers once greedily and ``num_samples`` times at temperature 1. Each rollout
is scored for **success** (:func:`verified_answer_reward`: the boxed final answer is the exact product) and **tool
use** (the environment's calculator was called). Per-problem scores are kept for paired standard errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.demo.evaluate import mean_and_stderr

MAX_COMPLETION_LENGTH = 128  # tool call (~48 tokens) + tool answer (~45) + boxed answer (~11), with room


@dataclass
class AgentEvalResult:
    """Per-problem scores on the held-out set (one entry per problem, in dataset order)."""

    num_samples: int
    greedy_success: list[float]
    greedy_tool_use: list[float]
    sampled_success: list[float]  # fraction of the problem's samples that succeed
    sampled_tool_use: list[float]  # fraction of the problem's samples that call the calculator
    sampled_success_with_tool: list[float]  # successes among samples that used the tool (count), for the ratio
    pass_at_k: list[float]
    lengths: list[float]  # mean completion tokens (model + tool tokens) of the problem's samples
    prompts: list[str]
    answers: list[int]
    greedy_transcripts: list[str]
    sampled_transcripts: list[str]  # the first sample of each problem
    sampled_transcript_success: list[float]  # whether that sample succeeded

    def metrics(self) -> dict[str, tuple[float, float]]:
        """``{metric: (mean, standard error)}`` over held-out problems."""
        k = self.num_samples
        used = [u * k for u in self.sampled_tool_use]
        with_tool = sum(self.sampled_success_with_tool) / max(sum(used), 1.0)
        without = sum(s * k for s in self.sampled_success) - sum(self.sampled_success_with_tool)
        without_tool = without / max(k * len(used) - sum(used), 1.0)
        return {
            "greedy: success (verified answer)": mean_and_stderr(self.greedy_success),
            "greedy: tool-use rate": mean_and_stderr(self.greedy_tool_use),
            "sampled (T=1): success": mean_and_stderr(self.sampled_success),
            "sampled (T=1): tool-use rate": mean_and_stderr(self.sampled_tool_use),
            f"pass@{k} (verified)": mean_and_stderr(self.pass_at_k),
            "sampled: success when the tool was used": (with_tool, 0.0),
            "sampled: success without the tool": (without_tool, 0.0),
            "mean completion tokens (sampled)": mean_and_stderr(self.lengths),
        }

    def row(self) -> dict[str, float]:
        """``{metric: mean}`` (what ``summary.json`` stores per stage)."""
        return {name: mean for name, (mean, _) in self.metrics().items()}


def transcript(messages: list[dict[str, Any]]) -> str:
    """A readable one-rollout transcript: tool calls as ``→ calculate()``, tool answers as ``← ...``."""
    lines = []
    for m in messages:
        if m.get("role") == "tool":
            lines.append(f"← {m.get('content')}")
            continue
        if m.get("content"):
            lines.append(str(m["content"]))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments")
            shown = ", ".join(f"{k}={v}" for k, v in args.items()) if isinstance(args, dict) else str(args)
            lines.append(f"→ {fn.get('name')}({shown})")
    return "\n".join(lines)


def copy_accuracy(model, tokenizer, problems, *, batch_size: int = 64) -> tuple[float, list[str]]:
    """How often the model copies the calculator's answer into the box: the skill GRPO cannot teach.

    Each problem is rendered as a copy drill — the question, the ``calculate()`` call and the tool's answer, then the
    assistant's turn — and the model continues greedily. GRPO only rewards verified answers, so a model that calls the
    tool but does not copy its answer never gets a reward to learn from; this measures that step alone, after SFT.

    Returns:
        ``(fraction of problems whose continuation starts with the exact \\boxed{product}, the continuations)``.
    """
    import torch

    from posttrain.demo.agent_task import calculator_tools

    tools = calculator_tools()
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    right, texts = 0, []
    try:
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p.prompt_text()}, *p.tool_trace()[:2]],
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for p in chunk
            ]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                ids = model.generate(
                    **enc, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )  # (batch, prompt + new)
            for p, row in zip(chunk, ids[:, enc["input_ids"].shape[1] :]):
                text = tokenizer.decode(row, skip_special_tokens=True)
                texts.append(text)
                right += text.startswith(f"\\boxed{{{p.answer}}}")
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    return right / max(len(problems), 1), texts


def _rollouts(agent, sampler, tokenizer, rows: list[dict], sampling, k: int):
    """``k`` tool-loop rollouts per row: ``(completions, environments)`` in ``[r0 s0, r0 s1, ..., r1 s0, ...]``."""
    from posttrain.rollout.pipeline import render_prompts

    repeated = [row for row in rows for _ in range(k)]
    batch = agent.prepare(repeated)
    _, prompt_ids = render_prompts(batch.rows, tokenizer, None, batch.tool_schemas)
    backend = agent.wrap(sampler)
    completions = backend.generate(prompt_ids[::k], sampling, k, tools=batch.tools)
    return completions, batch.environments


def evaluate_agent(model, tokenizer, dataset, *, num_samples: int = 4, seed: int = 0, batch_size: int = 64) -> Any:
    """Score ``model`` on prompt-only rows with ``a`` and ``b`` columns; returns an :class:`AgentEvalResult`."""
    import torch

    from posttrain.agents.loop import AgentRollout
    from posttrain.demo.agent_task import CalculatorEnv, verified_answer_reward
    from posttrain.generation import GroupSampler, SamplingConfig

    rows = [dict(r) for r in dataset]
    agent = AgentRollout(
        tokenizer,
        environment_factory=CalculatorEnv,
        max_tool_calling_iterations=1,
        max_completion_length=MAX_COMPLETION_LENGTH,
    )
    sampler = GroupSampler(model, tokenizer, return_logprobs=False)
    base = dict(
        max_new_tokens=MAX_COMPLETION_LENGTH,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    greedy_cfg = SamplingConfig(do_sample=False, **base)
    sample_cfg = SamplingConfig(do_sample=True, temperature=1.0, **base)
    k = num_samples
    out: dict[str, list] = {key: [] for key in ("g_ok", "g_tool", "g_text", "s_ok", "s_tool", "s_len", "s_text")}
    was_training = model.training
    model.eval()
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                for key, cfg, n in (("g", greedy_cfg, 1), ("s", sample_cfg, k)):
                    completions, envs = _rollouts(agent, sampler, tokenizer, chunk, cfg, n)
                    messages = completions.extra["completion_messages"]
                    out[f"{key}_ok"] += verified_answer_reward(messages, envs)
                    out[f"{key}_tool"] += [float(env.calls > 0) for env in envs]
                    out[f"{key}_text"] += [transcript(m) for m in messages]
                    if key == "s":
                        out["s_len"] += [float(len(ids)) for ids in completions.completion_ids]
    finally:
        torch.random.set_rng_state(state)
        model.train(was_training)

    def per_problem(values: list[float], reduce=lambda xs: sum(xs) / len(xs)) -> list[float]:
        return [reduce(values[i * k : (i + 1) * k]) for i in range(len(rows))]

    both = [ok * tool for ok, tool in zip(out["s_ok"], out["s_tool"])]
    return AgentEvalResult(
        num_samples=k,
        greedy_success=out["g_ok"],
        greedy_tool_use=out["g_tool"],
        sampled_success=per_problem(out["s_ok"]),
        sampled_tool_use=per_problem(out["s_tool"]),
        sampled_success_with_tool=per_problem(both, sum),
        pass_at_k=per_problem(out["s_ok"], max),
        lengths=per_problem(out["s_len"]),
        prompts=[r["prompt"][-1]["content"] for r in rows],
        answers=[int(r["a"]) * int(r["b"]) for r in rows],
        greedy_transcripts=out["g_text"],
        sampled_transcripts=out["s_text"][::k],
        sampled_transcript_success=out["s_ok"][::k],
    )
