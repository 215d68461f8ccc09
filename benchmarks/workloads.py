"""The benchmark configurations, written once for both posttrain and TRL.

Each :class:`Workload` is plain data: the trainer kind, the TRL config fields (the same names and values are passed to
posttrain's and to TRL's config class — that is the point of API compatibility), a dataset builder, reward functions
and an optional LoRA adapter. Datasets and reward functions are pure Python here so that the TRL runner (a separate
venv without posttrain) builds exactly the same inputs.

Imports only the standard library at module level (``datasets`` / ``torch`` inside functions): the TRL venv imports
this module too.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# ~300 bytes = ~300 tokens with the byte-level tiny tokenizer: the "shared system prompt >= 256 tokens" of the issue.
SYSTEM_PROMPT = (
    "You are a careful assistant that solves grade-school arithmetic problems. Read the question, think step by "
    "step, and check every intermediate result before you continue. Keep the reasoning short: one line per step, "
    "no repetition, no restating the question. When you are done, write the final answer as a single integer on "
    "its own line, after the words 'The answer is'. Never write anything after the final answer."
)
OPS = ("+", "-", "*")


def _question(rng: random.Random) -> tuple[str, int]:
    a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(OPS)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", value


def _answer(rng: random.Random, question: str, value: int, max_steps: int = 6) -> str:
    """A reasoning-style answer whose length varies with a random number of filler steps (0..max_steps)."""
    expr = question.removeprefix("What is ").removesuffix("?")
    lines = [f"Step {i + 1}: check {expr} again." for i in range(rng.randint(0, max_steps))]
    lines.append(f"{expr} = {value}. The answer is {value}.")
    return "\n".join(lines)


# -- datasets ----------------------------------------------------------------------------------------------------
def arithmetic_prompts(n: int = 256, seed: int = 0, system: bool = False) -> list[dict[str, Any]]:
    """Prompt-only conversational rows ``{"prompt": [messages], "answer": int}`` (GRPO/RLOO)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, value = _question(rng)
        messages = [{"role": "user", "content": question}]
        if system:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        rows.append({"prompt": messages, "answer": value})
    return rows


_COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def image_prompts(n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """VLM GRPO rows in TRL's format: a conversational ``prompt`` whose user turn is an ``{"type": "image"}`` block and
    a question, an ``image`` column (a solid-colour 64x64 PIL image) and the ``answer`` colour."""
    from PIL import Image

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        colour = rng.choice(list(_COLOURS))
        content = [{"type": "image"}, {"type": "text", "text": "What colour is this image? Answer with one word."}]
        rows.append({"prompt": [{"role": "user", "content": content}], "image": Image.new("RGB", (64, 64),
                     _COLOURS[colour]), "answer": colour})  # fmt: skip
    return rows


def sft_conversations(n: int = 512, seed: int = 0) -> list[dict[str, Any]]:
    """Conversational language-modelling rows ``{"messages": [...]}`` of varied length (40–700 tokens)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, value = _question(rng)
        answer = _answer(rng, question, value, max_steps=rng.choice((0, 2, 6, 12, 24)))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return rows


def preference_pairs(n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """Conversational preference rows ``{"prompt", "chosen", "rejected"}`` (DPO; Reward with the prompt)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, value = _question(rng)
        wrong = value + rng.choice((-10, -1, 1, 10))
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": _answer(rng, question, value, max_steps=4)}],
                "rejected": [{"role": "assistant", "content": _answer(rng, question, wrong, max_steps=4)}],
            }
        )
    return rows


def unpaired_preferences(n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """Conversational unpaired rows ``{"prompt", "completion", "label"}`` (KTO), half desirable."""
    rows = []
    for i, pair in enumerate(preference_pairs(n, seed)):
        good = i % 2 == 0
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
    return rows


DATASETS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "arithmetic_prompts": arithmetic_prompts,
    "arithmetic_prompts_system": lambda **kw: arithmetic_prompts(system=True, **kw),
    "sft_conversations": sft_conversations,
    "preference_pairs": preference_pairs,
    "unpaired_preferences": unpaired_preferences,
    "image_prompts": image_prompts,
}


def build_dataset(name: str, **kwargs):
    """A ``datasets.Dataset`` from one of :data:`DATASETS`."""
    from datasets import Dataset

    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}. Valid: {', '.join(DATASETS)}.")
    return Dataset.from_list(DATASETS[name](**kwargs))


# -- reward functions (TRL's contract: keyword arguments, one float per completion) ------------------------------
def _text(completion: Any) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


def arithmetic_reward(completions: list[Any], answer: list[int], **kwargs) -> list[float]:
    """1.0 if the last integer of the completion equals ``answer``, else the fraction of digit characters / 2.

    The shaped part keeps rewards varied on an untrained model, so advantages are not all zero.
    """
    rewards = []
    for completion, target in zip(completions, answer):
        text = _text(completion)
        numbers = re.findall(r"-?\d+", text)
        if numbers and int(numbers[-1]) == int(target):
            rewards.append(1.0)
        else:
            rewards.append(0.5 * sum(c.isdigit() for c in text) / max(len(text), 1))
    return rewards


def colour_reward(completions: list[Any], answer: list[str], **kwargs) -> list[float]:
    """1.0 if the completion names the image's colour, else the fraction of letters / 2 (varied on an untrained
    model, so advantages are not all zero)."""
    rewards = []
    for completion, colour in zip(completions, answer):
        text = _text(completion)
        rewards.append(1.0 if colour in text.lower() else 0.5 * sum(c.isalpha() for c in text) / max(len(text), 1))
    return rewards


REWARD_FUNCS: dict[str, Callable[..., list[float]]] = {
    "arithmetic_reward": arithmetic_reward,
    "colour_reward": colour_reward,
}


# -- warm starts (posttrain venv only: they run before the model is saved) ---------------------------------------
def warm_start_varied_eos(model, tokenizer, steps: int = 60, batch_size: int = 8, lr: float = 3e-3) -> None:
    """A few supervised steps on system-prompt + question + variable-length answer, so sampled completions stop
    (EOS) at varied lengths instead of always running to ``max_completion_length``. Plain torch loop, seeded."""
    import torch

    rng = random.Random(1)
    rows = []
    for _ in range(steps * batch_size):
        question, value = _question(rng)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": _answer(rng, question, value, max_steps=3)},
        ]
        rows.append(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    torch.manual_seed(1)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id
    for step in range(steps):
        batch = rows[step * batch_size : (step + 1) * batch_size]
        width = max(len(r) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


WARM_STARTS: dict[str, Callable[..., None]] = {"varied_eos": warm_start_varied_eos}


# -- workloads ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One benchmark configuration (the same for posttrain and TRL).

    Args:
        name: CLI name (``--config``).
        trainer: ``grpo`` | ``rloo`` | ``sft`` | ``dpo`` | ``kto`` | ``reward``.
        description: One line for RESULTS.md.
        args: Config fields, TRL's names, passed to both libraries' ``<Trainer>Config``.
        dataset: Key of :data:`DATASETS` (+ ``dataset_kwargs``).
        model: Default ``--model`` (tiny | small | bigvocab).
        warm_start: Key of :data:`WARM_STARTS` applied to the model before it is saved (None = random init).
        reward_funcs: Keys of :data:`REWARD_FUNCS` (online RL).
        lora: Wrap the policy in a LoRA adapter (the reference is then the base model with adapters disabled).
        steps / warmup: Default timed steps and warm-up steps.
    """

    name: str
    trainer: str
    description: str
    args: dict[str, Any]
    dataset: str
    model: str = "tiny"
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    warm_start: str | None = None
    reward_funcs: tuple[str, ...] = ()
    lora: bool = False
    steps: int = 10
    warmup: int = 2

    @property
    def task(self) -> str:
        if self.model.endswith("-vlm"):
            return "image-text-to-text"
        return "sequence-classification" if self.trainer == "reward" else "causal-lm"


# GRPO as the issue states it: num_generations 8, 16 completions per device step (2 prompts x 8), short prompts.
_GRPO = {
    "num_generations": 8,
    "per_device_train_batch_size": 16,
    "max_completion_length": 32,
    "learning_rate": 1e-6,
}
LORA_KWARGS = {
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "lora_dropout": 0.0,
}

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "grpo",
            "grpo",
            "GRPO short: G=8, 16 completions/step, arithmetic prompts (~25 tokens), 32 new tokens, beta=0",
            {**_GRPO, "beta": 0.0},
            "arithmetic_prompts",
            reward_funcs=("arithmetic_reward",),
        ),
        Workload(
            "grpo_beta",
            "grpo",
            "GRPO short with a reference model: beta=0.04",
            {**_GRPO, "beta": 0.04},
            "arithmetic_prompts",
            reward_funcs=("arithmetic_reward",),
        ),
        Workload(
            "grpo_iter2",
            "grpo",
            "GRPO short with num_iterations=2 (old log-probs computed, each batch used twice)",
            {**_GRPO, "beta": 0.0, "num_iterations": 2},
            "arithmetic_prompts",
            reward_funcs=("arithmetic_reward",),
        ),
        Workload(
            "grpo_realistic",
            "grpo",
            "GRPO realistic: ~330-token shared system prompt, G=8, 16 completions/step, up to 128 new tokens, "
            "warm-started model that stops at varied lengths, beta=0",
            {**_GRPO, "beta": 0.0, "max_completion_length": 128},
            "arithmetic_prompts_system",
            model="small",
            warm_start="varied_eos",
            reward_funcs=("arithmetic_reward",),
            steps=4,
            warmup=1,
        ),
        Workload(
            "grpo_long",
            "grpo",
            "GRPO long shared prompt: the ~330-token system prompt of grpo_realistic, G=8, 16 completions/step, "
            "32 new tokens, beta=0, no warm start (random weights: every completion runs to 32 tokens). The "
            "long-prompt row of the model-size sweep: grpo_realistic's warm start costs ~1 h of CPU at 0.5B",
            {**_GRPO, "beta": 0.0},
            "arithmetic_prompts_system",
            reward_funcs=("arithmetic_reward",),
        ),
        Workload(
            "grpo_vlm",
            "grpo",
            "VLM GRPO: tiny LLaVA, one 64x64 image per prompt (64 image tokens), G=8, 16 completions/step, "
            "32 new tokens, beta=0",
            {**_GRPO, "beta": 0.0},
            "image_prompts",
            model="tiny-vlm",
            reward_funcs=("colour_reward",),
            steps=6,
            warmup=1,
        ),
        Workload(
            "rloo",
            "rloo",
            "RLOO: G=8, 16 completions/step, 32 new tokens, TRL's default beta=0.05 (KL in the reward)",
            {**_GRPO},
            "arithmetic_prompts",
            reward_funcs=("arithmetic_reward",),
        ),
        Workload(
            "sft_packed",
            "sft",
            "SFT, packing=True (BFD, padding-free), max_length 512, batch 4, conversations of 40-700 tokens",
            {"packing": True, "max_length": 512, "per_device_train_batch_size": 4},
            "sft_conversations",
        ),
        Workload(
            "sft_unpacked",
            "sft",
            "SFT, packing=False (padded batches), max_length 512, batch 4, conversations of 40-700 tokens",
            {"packing": False, "max_length": 512, "per_device_train_batch_size": 4},
            "sft_conversations",
        ),
        Workload(
            "dpo",
            "dpo",
            "DPO sigmoid, batch 8, with a reference copy of the model",
            {"per_device_train_batch_size": 8, "max_length": 1024},
            "preference_pairs",
        ),
        Workload(
            "dpo_lora",
            "dpo",
            "DPO sigmoid, batch 8, LoRA r=8: no reference copy (adapters disabled = reference)",
            {"per_device_train_batch_size": 8, "max_length": 1024, "learning_rate": 1e-4},
            "preference_pairs",
            lora=True,
        ),
        Workload(
            "kto",
            "kto",
            "KTO, batch 8 (4 desirable / 4 undesirable), with a reference copy",
            {"per_device_train_batch_size": 8, "max_length": 1024},
            "unpaired_preferences",
        ),
        Workload(
            "reward",
            "reward",
            "Reward model (Bradley-Terry), batch 8 pairs, sequence classifier",
            {"per_device_train_batch_size": 8, "max_length": 1024},
            "preference_pairs",
        ),
    ]
}

# The trainer names of the CLI's --trainer, each with its default workload.
DEFAULT_FOR_TRAINER = {
    "grpo": "grpo",
    "rloo": "rloo",
    "sft": "sft_packed",
    "dpo": "dpo",
    "kto": "kto",
    "reward": "reward",
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"Unknown --config {name!r}. Valid: {', '.join(WORKLOADS)}.")
    return WORKLOADS[name]


def trainer_args(workload: Workload, *, output_dir: str, max_steps: int, seed: int = 0) -> dict[str, Any]:
    """The full config kwargs (TRL names) for ``workload``: its own fields plus the benchmark's fixed settings."""
    return {
        "output_dir": output_dir,
        "max_steps": max_steps,
        "logging_steps": 1,  # num_tokens and loss at every step
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "bf16": False,  # CPU float32 on both sides
        "seed": seed,
        "dataloader_num_workers": 0,
        **workload.args,
    }
