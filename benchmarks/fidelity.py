"""Differential fidelity harness: the same deterministic training run with posttrain and with TRL, step by step.

``python -m benchmarks fidelity`` (see ``benchmarks/__main__.py``) runs every scenario below twice — with posttrain's
trainers (posttrain's venv) and with TRL's (``benchmarks/.venv-trl``, built by ``benchmarks/setup_trl.sh``; TRL is
never a dependency of posttrain) — in one fresh process per library, and compares the per-step logs: loss,
grad_norm and every metric both libraries log, at a relative tolerance of 1e-4. Results: ``benchmarks/FIDELITY.md``.

Determinism: both sides load the same saved tiny model (fixed init), build the same small dataset (pure Python
here), use the same seed and sampler (data order), float32 on CPU, no dropout; GRPO/RLOO generate nothing — a
``rollout_func`` returns fixed completions (a pure function of the prompt text and the row's position) with fixed
sampling log-probs, and the reward functions are pure functions of the completion text.

This module imports only the standard library at module level (both venvs import it) and never imports posttrain
or trl itself: the runner receives the library's ``(Config, Trainer)`` classes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REL_TOL = 1e-4
ABS_TOL = 1e-6  # values near zero (e.g. a KL of 1e-9) compare absolutely

# Keys that describe the run rather than the math (or that each library counts its own way by design).
IGNORED_KEYS = frozenset(
    {"learning_rate", "epoch", "step", "numerics/skipped_steps", "step_time", "train_runtime",
     "train_tokens_per_second"}
)  # fmt: skip


def _compared(keys: set[str]) -> set[str]:
    """Logged keys that are compared: not the wall-clock ``timing/*`` stage times, nor :data:`IGNORED_KEYS`."""
    return {k for k in keys if k not in IGNORED_KEYS and not k.startswith("timing/")}


# -- datasets (pure Python, identical in both venvs) ---------------------------------------------------------------
def _rng_text(rng: random.Random, lo: int, hi: int) -> str:
    words = ("alpha", "beta", "gamma", "delta", "red", "blue", "seven", "two", "cat", "sun", "tree", "moon")
    return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))


def ds_lm_text(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": _rng_text(rng, 3, 20)} for _ in range(n)]


def ds_prompt_completion(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt": _rng_text(rng, 2, 6), "completion": " " + _rng_text(rng, 2, 12)} for _ in range(n)]


def ds_messages(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "messages": [
                {"role": "user", "content": _rng_text(rng, 2, 6)},
                {"role": "assistant", "content": _rng_text(rng, 2, 12)},
            ]
        }
        for _ in range(n)
    ]


def ds_conv_prompt_completion(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "prompt": [{"role": "user", "content": _rng_text(rng, 2, 6)}],
            "completion": [{"role": "assistant", "content": _rng_text(rng, 2, 12)}],
        }
        for _ in range(n)
    ]


def ds_preference(n: int = 16, seed: int = 0, conversational: bool = False) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, chosen, rejected = _rng_text(rng, 2, 6), _rng_text(rng, 2, 10), _rng_text(rng, 2, 10)
        if conversational:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return rows


def ds_preference_margin(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    rows = ds_preference(n, seed)
    for i, row in enumerate(rows):
        row["margin"] = 0.25 * (i % 4)
    return rows


def ds_unpaired(n: int = 16, seed: int = 0, conversational: bool = False, balance: str = "alternate"):
    """Unpaired KTO rows; ``balance``: ``alternate`` (T, F, T, ...), ``skewed`` (3 of 4 desirable, some batches
    with a single class), ``blocks`` (all desirable first, as unpairing a paired set does)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt, completion = _rng_text(rng, 2, 6), _rng_text(rng, 2, 10)
        label = {"alternate": i % 2 == 0, "skewed": i % 4 != 3, "blocks": i < n // 2}[balance]
        if conversational:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "completion": [{"role": "assistant", "content": completion}],
                    "label": label,
                }
            )
        else:
            rows.append({"prompt": prompt, "completion": " " + completion, "label": label})
    return rows


def ds_prompts(n: int = 16, seed: int = 0, conversational: bool = True) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = _rng_text(rng, 2, 6)
        rows.append({"prompt": [{"role": "user", "content": text}] if conversational else text})
    return rows


def ds_prompts_equal_length(n: int = 16, seed: int = 0, conversational: bool = True) -> list[dict[str, Any]]:
    """Prompts of three 3-letter words: the same number of tokens (the tiny tokenizer is byte-level), so a batch of
    prompts needs no padding (the ``*/varied_prompts`` scenarios use :func:`ds_prompts`, left-padded batches)."""
    rng = random.Random(seed)
    words = ("red", "two", "cat", "sun", "ant", "sky")
    rows = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(3))
        rows.append({"prompt": [{"role": "user", "content": text}] if conversational else text})
    return rows


def ds_prompts_privileged(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """:func:`ds_prompts_equal_length` plus a ``privileged_context`` (SDFT/SDPO's teacher-only text) of two 3-letter
    words: every teacher prompt has one token length too."""
    rows = ds_prompts_equal_length(n, seed)
    rng = random.Random(seed + 1)
    for row in rows:
        row["privileged_context"] = " ".join(rng.choice(("red", "two", "cat", "sun", "ant", "sky")) for _ in range(2))
    return rows


_COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "white": (245, 245, 245)}


def ds_vlm_prompts(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """VLM GRPO prompts in TRL's format: a conversational ``prompt`` whose user turn holds an ``{"type": "image"}``
    block before a question, and an ``image`` column (a solid-colour PIL image, 12..24 px a side, some not square);
    the questions vary in length, so batches are left-padded."""
    from PIL import Image

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        colour = rng.choice(list(_COLOURS))
        size = (rng.randint(12, 24), rng.randint(12, 24))
        question = "What colour? " + _rng_text(rng, 1, 3)
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        rows.append({"prompt": prompt, "image": Image.new("RGB", size, _COLOURS[colour])})
    return rows


DATASETS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "lm_text": ds_lm_text,
    "prompt_completion": ds_prompt_completion,
    "messages": ds_messages,
    "conv_prompt_completion": ds_conv_prompt_completion,
    "preference": ds_preference,
    "preference_conv": lambda **kw: ds_preference(conversational=True, **kw),
    "preference_margin": ds_preference_margin,
    "unpaired": ds_unpaired,
    "unpaired_conv": lambda **kw: ds_unpaired(conversational=True, **kw),
    "unpaired_skewed": lambda **kw: ds_unpaired(balance="skewed", **kw),
    "unpaired_blocks": lambda **kw: ds_unpaired(balance="blocks", **kw),
    "prompts": ds_prompts,
    "prompts_text": lambda **kw: ds_prompts(conversational=False, **kw),
    "prompts_equal": ds_prompts_equal_length,
    "prompts_privileged": ds_prompts_privileged,
    "prompts_equal_text": lambda **kw: ds_prompts_equal_length(conversational=False, **kw),
    "triple": lambda **kw: ds_triple(**kw),
    "vlm_prompts": ds_vlm_prompts,
}
# Tiny VLM families of the ``vlm/`` scenarios (``model="vlm-<family>"``): saved by :func:`ensure_tiny_vlm`.
VLM_FAMILIES = ("llava", "llava_next", "gemma3", "idefics3")


def ds_triple(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """TPO's triple preferences: ``ds_preference`` rows plus a ``reference`` (gold) completion."""
    rows = ds_preference(n, seed)
    rng = random.Random(seed + 1)
    for row in rows:
        row["reference"] = " " + _rng_text(rng, 2, 10)
    return rows


# Experimental trainers: scenario trainer name -> (submodule of ``<lib>.experimental``, config, trainer class).
EXPERIMENTAL: dict[str, tuple[str, str, str]] = {
    "cpo": ("cpo", "CPOConfig", "CPOTrainer"),
    "orpo": ("orpo", "ORPOConfig", "ORPOTrainer"),
    "tpo": ("tpo", "TPOConfig", "TPOTrainer"),
    "gkd": ("gkd", "GKDConfig", "GKDTrainer"),
    "distillation": ("distillation", "DistillationConfig", "DistillationTrainer"),
    "online_dpo": ("online_dpo", "OnlineDPOConfig", "OnlineDPOTrainer"),
    "gmpo": ("gmpo", "GMPOConfig", "GMPOTrainer"),
    "a2po": ("a2po", "A2POConfig", "A2POTrainer"),
    "gold": ("gold", "GOLDConfig", "GOLDTrainer"),
    "iw_opd": ("iw_opd", "IWOPDConfig", "IWOPDTrainer"),
    "sdft": ("sdft", "SDFTConfig", "SDFTTrainer"),
    "sdpo": ("sdpo", "SDPOConfig", "SDPOTrainer"),
}
# Online trainers whose completions come from ``fixed_rollout_func`` (TRL's ``rollout_func`` contract) ...
ROLLOUT_FUNC_TRAINERS = frozenset({"grpo", "gmpo"})
# ... and those whose generation step is replaced by ``patch_generation`` (same completions, both libraries).
PATCHED_TRAINERS = frozenset({"rloo"})
# ... and those that sample with model.generate (TRL) / a generation backend (posttrain): ``patch_model_generation``.
GENERATE_PATCHED_TRAINERS = frozenset({"online_dpo", "a2po", "sdpo", "sdft", "gold", "iw_opd", "gkd"})
# Trainers given the tokenizer explicitly (TRL's GKD and Online DPO do not load it from a model path; GOLD and
# IW-OPD get the same one, the no-newline template's).
TOKENIZER_TRAINERS = frozenset({"gkd", "distillation", "online_dpo", "gold", "iw_opd"})
# Trainers that take a reward_funcs argument.
REWARD_TRAINERS = frozenset({"grpo", "rloo", "gmpo", "online_dpo", "a2po", "sdpo"})


# -- GRPO/RLOO: fixed completions and rewards ----------------------------------------------------------------------
def _prompt_text(prompt: Any) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def _seed_of(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


def fixed_completion(prompt_ids: list[int], k: int, max_len: int, eos: int) -> tuple[list[int], list[float]]:
    """The ``k``-th completion of a prompt and its "sampling" log-probs: a pure function of the prompt's token ids;
    lengths 2..``max_len``, most shorter ones ending with EOS, the others truncated."""
    rng = random.Random(_seed_of(",".join(map(str, prompt_ids))) * 31 + k)
    length = rng.randint(2, max_len)
    completion = [rng.randint(32, 126) for _ in range(length)]
    if length < max_len and rng.random() < 0.7:
        completion[-1] = eos
    return completion, [-0.5 - 0.25 * rng.random() for _ in completion]


def _tokenize_prompt(tok: Any, prompt: Any, chat_template_kwargs: dict[str, Any] | None) -> list[int]:
    if isinstance(prompt, list):
        out = tok.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **(chat_template_kwargs or {})
        )
        return list(out["input_ids"])
    return list(tok(prompt, add_special_tokens=False)["input_ids"])


def fixed_rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list]:
    """TRL's ``rollout_func`` contract (GRPO): one completion per (repeated) prompt, see :func:`fixed_completion`."""
    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    prompt_ids, completion_ids, logprobs = [], [], []
    seen: dict[tuple[int, ...], int] = {}
    for prompt in prompts:
        ids = _tokenize_prompt(tok, prompt, getattr(trainer.args, "chat_template_kwargs", None))
        k = seen.get(tuple(ids), 0)
        seen[tuple(ids)] = k + 1
        completion, lps = fixed_completion(ids, k, trainer.args.max_completion_length, tok.eos_token_id)
        prompt_ids.append(ids)
        completion_ids.append(completion)
        logprobs.append(lps)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def fixed_completions(prompt_rows: list[list[int]], max_len: int, eos: int) -> list[list[int]]:
    """:func:`fixed_completion` of each row of one generation call; ``k`` counts the earlier rows with the same prompt
    in that call (a prompt repeated G times gets completions 0..G-1, whatever the row order)."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for ids in prompt_rows:
        k = seen.get(tuple(ids), 0)
        seen[tuple(ids)] = k + 1
        out.append(fixed_completion(list(ids), k, max_len, eos)[0])
    return out


def patch_generation(trainer: Any) -> None:
    """RLOO has no ``rollout_func`` in TRL 1.16: replace each library's generation step by :func:`fixed_completion`
    (TRL: ``_generate_single_turn(prompt_ids, ...)``, one row per completion; posttrain: the pipeline's backend,
    ``generate(unique_prompt_ids, sampling, num_generations)``). VLM GRPO takes this path too: a ``rollout_func``
    would have to re-render the prompts with their images, while here each library's own processed prompt ids
    (image placeholders expanded) key the completions, so a prompt-processing difference shows up. No sampling
    log-probs on either side (TRL's transformers path has none)."""
    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    max_len, eos = trainer.args.max_completion_length, tok.eos_token_id
    if hasattr(trainer, "_generate_single_turn"):  # TRL
        grpo = type(trainer).__name__ == "GRPOTrainer"  # GRPO's returns (completion_ids, sampling logprobs)

        def generate_single_turn(prompt_ids, images=None, multimodal_fields=None, *rest, **kw):
            rows = fixed_completions([list(ids) for ids in prompt_ids], max_len, eos)
            return (rows, None) if grpo else rows

        trainer._generate_single_turn = generate_single_turn
        return
    backend = trainer.pipeline.backend
    trainer.pipeline.backend = _fixed_backend(backend, lambda sampling: max_len, eos, fixed_completions)


def generated_completions(prompt_rows: list[list[int]], max_len: int, eos: int) -> list[list[int]]:
    """:func:`fixed_completions` as a sampler can return them: a completion that stopped short of ``max_len``
    without EOS is continued (a pure function of its tokens) up to ``max_len``, i.e. it is truncated."""
    out = []
    for row in fixed_completions(prompt_rows, max_len, eos):
        if row[-1] != eos and len(row) < max_len:
            row = row + [32 + (sum(row) * 7 + i) % 95 for i in range(max_len - len(row))]
        out.append(row)
    return out


def _fixed_backend(
    backend: Any, max_len_of: Callable[[Any], int], eos: int, completions: Callable[..., list[list[int]]]
) -> Any:
    """posttrain's generation ``backend`` with ``generate`` replaced by ``completions`` (:func:`fixed_completions`
    or :func:`generated_completions`) of the prompts repeated ``num_generations`` times (``[p0 g0, p0 g1, ..., p1
    g0, ...]``); weight syncs still reach it."""
    from posttrain.generation.base import Completions

    def generate(prompt_ids, sampling=None, num_generations=1, **kwargs):
        prompts = [list(ids) for ids in prompt_ids for _ in range(num_generations)]
        rows = completions(prompts, max_len_of(sampling), eos)
        return Completions(rows, None, [r[-1] == eos for r in rows], prompts)

    backend.generate = generate
    return backend


def patch_model_generation(trainer: Any) -> None:
    """Online trainers that sample with ``model.generate`` (TRL) or a generation backend (posttrain): both libraries
    get :func:`generated_completions` of the prompts they actually built, ``max_new_tokens`` from their own generation
    settings. TRL: ``generate`` of the policy and the reference model (A2PO samples its V* estimates from it) is
    replaced by a function with ``generate``'s contract (left-padded ``input_ids`` + ``attention_mask``, each row
    repeated ``num_return_sequences`` times, prompt + completion padded with the pad id, a ``.sequences`` object
    with ``return_dict_in_generate``); posttrain: the generation backend's ``generate``."""
    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    eos = tok.eos_token_id
    if type(trainer).__module__.startswith("posttrain"):
        _fixed_backend(trainer.backend, lambda sampling: sampling.max_new_tokens, eos, generated_completions)
        return
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else eos

    def generate(input_ids=None, attention_mask=None, generation_config=None, return_dict_in_generate=False, **kw):
        n = getattr(generation_config, "num_return_sequences", None) or 1
        max_len = kw.get("max_new_tokens") or generation_config.max_new_tokens
        ids = input_ids.repeat_interleave(n, dim=0)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.repeat_interleave(n, dim=0)
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        rows = generated_completions(prompts, max_len, eos)
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=ids.dtype, device=ids.device)
        sequences = torch.cat([ids, completion], dim=1)
        if return_dict_in_generate:
            from types import SimpleNamespace

            return SimpleNamespace(sequences=sequences)
        return sequences

    for name in ("model", "ref_model"):
        model = getattr(trainer, name, None)
        if model is not None and hasattr(model, "generate"):
            model.generate = generate


def reward_vowels(completions: list[Any], **kwargs) -> list[float]:
    """Fraction of vowels in the completion text (pure function of the text)."""
    out = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        out.append(sum(c in "aeiou" for c in text) / max(len(text), 1))
    return out


def reward_length(completions: list[Any], **kwargs) -> list[float]:
    """Length of the completion text / 32."""
    out = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        out.append(len(text) / 32.0)
    return out


def reward_has_vowel(completions: list[Any], **kwargs) -> list[float]:
    """1.0 when the completion text has a lowercase vowel, else 0.0 (A*-PO assumes binary rewards)."""
    out = []
    for completion in completions:
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        out.append(float(any(c in "aeiou" for c in text)))
    return out


REWARD_FUNCS = {"vowels": reward_vowels, "length": reward_length, "has_vowel": reward_has_vowel}


# The tool functions of the GRPO "Agent Training" example in TRL's docs.
def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


TOOLS = {"multiply": multiply, "async_add": async_add}


# -- scenarios -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    trainer: str  # sft | dpo | kto | reward | grpo | rloo
    args: dict[str, Any]
    dataset: str
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    reward_funcs: tuple[str, ...] = ()
    steps: int = 3
    tools: tuple[str, ...] = ()  # names in TOOLS; the model then generates (no rollout_func)
    compare_keys: tuple[str, ...] | None = None  # compare only these keys (sampled runs: the tool metrics)
    model: str | None = None  # a key of the runner's model paths; default from the trainer
    teacher: bool = False  # pass teacher_model= the saved teacher (a different tiny model: the warm-started one)
    # posttrain-only config fields (TRL's config has no such field), e.g. generation_backend="transformers"
    posttrain_args: dict[str, Any] = field(default_factory=dict)
    # the model samples for real (model.generate in both libraries, the global torch RNG): no fixed completions
    sample: bool = False

    @property
    def task(self) -> str:
        if self.model:
            return self.model
        return "sequence-classification" if self.trainer == "reward" else "causal-lm"


_BASE = {
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "disable_tqdm": True,
    "bf16": False,
    "seed": 0,
    "dataloader_num_workers": 0,
    "learning_rate": 1e-3,  # large enough that the trajectories move visibly between steps
    "per_device_train_batch_size": 4,
    "gradient_checkpointing": False,
}
_ONLINE = {
    "num_generations": 4,
    "per_device_train_batch_size": 8,
    "max_completion_length": 12,
    "use_bias_correction_kl": False,  # TRL 1.16 defaults it to True; explicit so results do not depend on defaults
}

DPO_LOSSES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
GRPO_LOSSES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def _scenarios() -> list[Scenario]:
    out: list[Scenario] = []

    def add(name: str, trainer: str, args: dict[str, Any], dataset: str, **kw: Any) -> None:
        out.append(Scenario(name, trainer, {**_BASE, **args}, dataset, **kw))

    # SFT: formats, packing, masks
    add("sft/lm_text", "sft", {"max_length": 64}, "lm_text")
    add("sft/prompt_completion", "sft", {"max_length": 64}, "prompt_completion")
    add(
        "sft/prompt_completion_full_loss",
        "sft",
        {"max_length": 64, "completion_only_loss": False},
        "prompt_completion",
    )
    add("sft/messages", "sft", {"max_length": 64}, "messages")
    add("sft/messages_assistant_only", "sft", {"max_length": 64, "assistant_only_loss": True}, "messages")
    add("sft/conv_prompt_completion", "sft", {"max_length": 64}, "conv_prompt_completion")
    add("sft/packed_bfd", "sft", {"max_length": 64, "packing": True}, "messages")
    add("sft/packed_wrapped", "sft", {"max_length": 64, "packing": True, "packing_strategy": "wrapped"}, "lm_text")
    add("sft/padding_free", "sft", {"max_length": None, "padding_free": True}, "prompt_completion")
    add("sft/truncation_16", "sft", {"max_length": 16}, "prompt_completion")
    add("sft/grad_accum_2", "sft", {"max_length": 64, "gradient_accumulation_steps": 2}, "prompt_completion")
    # num_input_tokens_seen of packed batches (issue 35 item 8a: posttrain summed their 4-D block-diagonal mask)
    add("sft/packed_bfd_tokens_seen", "sft", {"max_length": 64, "packing": True,
        "include_num_input_tokens_seen": "non_padding"}, "messages")  # fmt: skip
    add("sft/packed_bfd_tokens_seen_all", "sft", {"max_length": 64, "packing": True,
        "include_num_input_tokens_seen": "all"}, "messages")  # fmt: skip
    add("sft/packed_wrapped_tokens_seen", "sft", {"max_length": 64, "packing": True, "packing_strategy": "wrapped",
        "include_num_input_tokens_seen": "non_padding"}, "lm_text")  # fmt: skip

    # DPO: every loss type, then the options
    dpo = {"max_length": 64}
    for loss in DPO_LOSSES:
        extra: dict[str, Any] = {"label_smoothing": 1e-3} if loss == "exo_pair" else {}
        if loss == "robust":
            extra = {"label_smoothing": 0.1}
        add(f"dpo/{loss}", "dpo", {**dpo, "loss_type": [loss], **extra}, "preference")
    add("dpo/conversational", "dpo", dpo, "preference_conv")
    add("dpo/use_weighting", "dpo", {**dpo, "use_weighting": True}, "preference")
    add("dpo/use_weighting_ipo", "dpo", {**dpo, "use_weighting": True, "loss_type": ["ipo"]}, "preference")
    add("dpo/ld_alpha_0.5", "dpo", {**dpo, "ld_alpha": 0.5}, "preference")
    add("dpo/label_smoothing_0.1", "dpo", {**dpo, "label_smoothing": 0.1}, "preference")
    for div in ("forward_kl", "js_divergence", "alpha_divergence"):
        add(f"dpo/f_div_{div}", "dpo", {**dpo, "f_divergence_type": div}, "preference")
    add("dpo/mpo_3_losses", "dpo", {**dpo, "loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        "preference")  # fmt: skip
    add("dpo/precompute_ref", "dpo", {**dpo, "precompute_ref_log_probs": True}, "preference")
    add("dpo/beta_0.5", "dpo", {**dpo, "beta": 0.5}, "preference")
    add("dpo/truncation_keep_start_12", "dpo", {"max_length": 12, "truncation_mode": "keep_start"}, "preference")
    add("dpo/truncation_keep_end_12", "dpo", {"max_length": 12, "truncation_mode": "keep_end"}, "preference")
    add("dpo/padding_free", "dpo", {**dpo, "padding_free": True}, "preference")
    add("dpo/grad_accum_2", "dpo", {**dpo, "gradient_accumulation_steps": 2}, "preference")

    # KTO
    kto = {"max_length": 64}
    for loss in ("kto", "apo_zero_unpaired"):
        add(f"kto/{loss}", "kto", {**kto, "loss_type": loss}, "unpaired")
        add(f"kto/{loss}_conv", "kto", {**kto, "loss_type": loss}, "unpaired_conv")
    add("kto/skewed_single_class_batches", "kto", kto, "unpaired_skewed")
    add("kto/label_blocks", "kto", kto, "unpaired_blocks")
    add("kto/paired_input", "kto", kto, "preference")
    add("kto/weights", "kto", {**kto, "desirable_weight": 1.5, "undesirable_weight": 0.5}, "unpaired")
    add("kto/precompute_ref", "kto", {**kto, "precompute_ref_log_probs": True}, "unpaired")
    add("kto/truncation_12", "kto", {"max_length": 12}, "unpaired")
    add("kto/grad_accum_2", "kto", {**kto, "gradient_accumulation_steps": 2}, "unpaired_skewed")

    # Reward
    add("reward/basic", "reward", {"max_length": 64}, "preference")
    add("reward/conversational", "reward", {"max_length": 64}, "preference_conv")
    add("reward/margin", "reward", {"max_length": 64}, "preference_margin")
    add("reward/center_rewards", "reward", {"max_length": 64, "center_rewards_coefficient": 0.01}, "preference")

    # GRPO: loss type × β × μ (the full product), then scale_rewards × IS level, then the other knobs
    online = {**_ONLINE}
    for loss, beta, mu in itertools.product(GRPO_LOSSES, (0.0, 0.04), (1, 2)):
        extra = {"importance_sampling_level": "sequence"} if loss in ("luspo", "vespo") else {}
        add(f"grpo/{loss}_beta{beta}_mu{mu}", "grpo", {**online, "loss_type": loss, "beta": beta,
            "num_iterations": mu, **extra}, "prompts", reward_funcs=("vowels",))  # fmt: skip
    for scale, level in itertools.product(("group", "batch", "none"), ("token", "sequence")):
        add(f"grpo/scale_{scale}_is_{level}", "grpo", {**online, "scale_rewards": scale, "importance_sampling_level":
            level, "num_iterations": 2, "beta": 0.04}, "prompts", reward_funcs=("vowels",))  # fmt: skip
    knobs: dict[str, dict[str, Any]] = {
        "bias_correction_kl": {"beta": 0.04, "use_bias_correction_kl": True, "num_iterations": 2},
        "two_rewards_weighted": {"reward_weights": [1.0, 0.5]},
        "normalize_then_sum": {"multi_objective_aggregation": "normalize_then_sum"},
        "epsilon_high": {"epsilon_high": 0.28, "num_iterations": 2},
        "delta": {"delta": 1.5, "num_iterations": 2},
        "mask_truncated": {"mask_truncated_completions": True},
        "top_entropy_quantile": {"top_entropy_quantile": 0.2},
        "off_policy_mask": {"off_policy_mask_threshold": 0.5, "num_iterations": 2},
        "steps_per_generation_2": {"steps_per_generation": 2, "per_device_train_batch_size": 4},
        "grad_accum_2": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
        "text_prompts": {},
    }
    for name, knob in knobs.items():
        funcs = ("vowels", "length") if name in ("two_rewards_weighted", "normalize_then_sum") else ("vowels",)
        dataset = "prompts_text" if name == "text_prompts" else "prompts"
        add(f"grpo/{name}", "grpo", {**online, "beta": 0.0, **knob}, dataset, reward_funcs=funcs)

    # Gradient accumulation with a KL term and a replayed batch (issue 35 item 8b): the generation batch is split
    # over the accumulation steps, so the micro-batches' composition (the shuffle) enters kl, clip_ratio/* and
    # bnpo's per-micro-batch token mean
    for loss in ("grpo", "bnpo"):
        add(f"grpo/grad_accum_2_{loss}_beta0.04_mu2", "grpo", {**online, "gradient_accumulation_steps": 2,
            "per_device_train_batch_size": 4, "beta": 0.04, "num_iterations": 2, "loss_type": loss}, "prompts",
            reward_funcs=("vowels",), steps=4)  # fmt: skip
    # The entropy bonus with gradient accumulation: TRL 1.16 takes the plain token mean of the entropies over each
    # micro-batch (divided by GA), whatever the loss type's own aggregation (grpo: per-sequence mean; dapo: the
    # step's global token mean), so micro-batches of unequal completion lengths tell the rules apart
    for loss in ("grpo", "dapo", "bnpo"):
        add(f"grpo/entropy_coef_grad_accum_2_{loss}", "grpo", {**online, "gradient_accumulation_steps": 2,
            "per_device_train_batch_size": 4, "beta": 0.0, "entropy_coef": 0.05, "loss_type": loss}, "prompts",
            reward_funcs=("vowels",), steps=4)  # fmt: skip
    # ... and sampling for real (model.generate in both: the shuffle's draw from the global RNG precedes the next
    # generation's samples)
    add("grpo/generate_grad_accum_2_beta0.04_mu2", "grpo", {**online, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4, "beta": 0.04, "num_iterations": 2}, "prompts", reward_funcs=("vowels",),
        steps=6, sample=True, posttrain_args={"generation_backend": "transformers"})  # fmt: skip

    # Tool calling (issue 18 item 9): the docs' tools with a Qwen3 template on the untrained tiny model, which
    # emits stray <tool_call> tokens; only the tool metrics are comparable (both sides sample).
    add("grpo/tools_docs_example", "grpo", {**online, "beta": 0.0, "max_completion_length": 160,
        "chat_template_kwargs": {"enable_thinking": False}}, "prompts", reward_funcs=("vowels",),
        tools=("multiply", "async_add"), compare_keys=("tools/call_frequency", "tools/failure_frequency"),
        model="causal-lm-qwen3", steps=4)  # fmt: skip

    # VLM GRPO (issue 37): conversational prompts with an image, each library's processor (image placeholders expanded)
    # and vision forward (pixel_values, ... in old / ref / policy log-probs); completions from patch_generation
    for family in VLM_FAMILIES:
        add(f"vlm/grpo_{family}", "grpo", {**online, "beta": 0.0}, "vlm_prompts", reward_funcs=("vowels",),
            model=f"vlm-{family}")  # fmt: skip
    add("vlm/grpo_llava_beta0.04_mu2", "grpo", {**online, "beta": 0.04, "num_iterations": 2}, "vlm_prompts",
        reward_funcs=("vowels",), model="vlm-llava")  # fmt: skip
    # ... and sampling for real: model.generate with the image in both libraries (posttrain's
    # generation_backend="transformers"), the global torch RNG
    add("vlm/grpo_llava_generate", "grpo", {**online, "beta": 0.0}, "vlm_prompts", reward_funcs=("vowels",),
        model="vlm-llava", sample=True, posttrain_args={"generation_backend": "transformers"})  # fmt: skip
    add("vlm/rloo_llava", "rloo", {k: v for k, v in online.items() if k != "use_bias_correction_kl"}, "vlm_prompts",
        reward_funcs=("vowels",), model="vlm-llava")  # fmt: skip

    # RLOO
    online = {k: v for k, v in online.items() if k != "use_bias_correction_kl"}  # GRPO only
    add("rloo/default", "rloo", {**online}, "prompts", reward_funcs=("vowels",))
    add("rloo/beta0", "rloo", {**online, "beta": 0.0}, "prompts", reward_funcs=("vowels",))
    add("rloo/mu2", "rloo", {**online, "num_iterations": 2}, "prompts", reward_funcs=("vowels",))
    add("rloo/normalize_advantages", "rloo", {**online, "normalize_advantages": True}, "prompts",
        reward_funcs=("vowels",))  # fmt: skip
    add("rloo/two_rewards", "rloo", {**online, "reward_weights": [1.0, 0.5]}, "prompts",
        reward_funcs=("vowels", "length"))  # fmt: skip
    # Sampling for real through model.generate (issue 35 item 8c): both libraries draw from the global torch RNG,
    # so everything else that draws from it between two generations (the batch shuffle) must match too
    generate = {"posttrain_args": {"generation_backend": "transformers"}, "sample": True, "steps": 6}
    rloo_mu2 = {**online, "beta": 0.04, "num_iterations": 2}
    add("rloo/generate_beta0.04_mu2", "rloo", rloo_mu2, "prompts", reward_funcs=("vowels",), **generate)
    add("rloo/generate_beta0.04_mu2_grad_accum_2", "rloo", {**rloo_mu2, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4}, "prompts", reward_funcs=("vowels",), **generate)  # fmt: skip

    # -- experimental trainers (posttrain.experimental.<name> vs trl.experimental.<name>) --
    # GMPO (a GRPO subclass in both): completions from fixed_rollout_func; μ > 1 so the clipped geometric mean acts
    for beta, mu in itertools.product((0.0, 0.04), (1, 2)):
        add(f"gmpo/beta{beta}_mu{mu}", "gmpo", {**_ONLINE, "beta": beta, "num_iterations": mu}, "prompts",
            reward_funcs=("vowels",))  # fmt: skip
    add("gmpo/epsilon_high_0.6", "gmpo", {**_ONLINE, "beta": 0.0, "num_iterations": 2, "epsilon_high": 0.6},
        "prompts", reward_funcs=("vowels",))  # fmt: skip

    # CPO: every loss type (simpo = CPO-SimPO with the default cpo_alpha; "simpo_pure" = SimPO, cpo_alpha 0; AlphaPO)
    pair = {"max_length": 64}
    for loss in ("sigmoid", "hinge", "ipo", "simpo"):
        add(f"cpo/{loss}", "cpo", {**pair, "loss_type": loss}, "preference")
    add("cpo/simpo_pure", "cpo", {**pair, "loss_type": "simpo", "cpo_alpha": 0.0}, "preference")
    add("cpo/alphapo", "cpo", {**pair, "loss_type": "alphapo", "alpha": 0.25}, "preference")
    add("cpo/label_smoothing_0.1", "cpo", {**pair, "label_smoothing": 0.1}, "preference")
    add("cpo/conversational", "cpo", pair, "preference_conv")
    add("cpo/grad_accum_2", "cpo", {**pair, "gradient_accumulation_steps": 2}, "preference")
    # ORPO
    add("orpo/default", "orpo", pair, "preference")
    add("orpo/beta_0.5", "orpo", {**pair, "beta": 0.5}, "preference")
    add("orpo/conversational", "orpo", pair, "preference_conv")
    # TPO: loss types on triple preferences (chosen, rejected, reference)
    for loss in ("sigmoid", "hinge", "ipo", "tpo-l"):
        add(f"tpo/{loss}", "tpo", {**pair, "loss_type": loss}, "triple")
    # -- online experimental trainers: both libraries train on fixed_completions of the prompts each one built
    # (patch_model_generation: TRL's model.generate, posttrain's generation backend) --
    odpo = {"max_new_tokens": 12, "max_length": 64, "per_device_train_batch_size": 4}
    add("online_dpo/sigmoid", "online_dpo", odpo, "prompts_equal", reward_funcs=("vowels",))
    add("online_dpo/ipo", "online_dpo", {**odpo, "loss_type": "ipo"}, "prompts_equal", reward_funcs=("vowels",))
    add("online_dpo/missing_eos_penalty", "online_dpo", {**odpo, "missing_eos_penalty": 1.0}, "prompts_equal",
        reward_funcs=("vowels",))  # fmt: skip
    add("online_dpo/beta_list", "online_dpo", {**odpo, "beta": [0.5, 0.1]}, "prompts_equal", reward_funcs=("vowels",))
    add("online_dpo/varied_prompts", "online_dpo", odpo, "prompts", reward_funcs=("vowels",))
    add("online_dpo/text_prompts", "online_dpo", odpo, "prompts_equal_text", reward_funcs=("vowels",))
    add("online_dpo/max_length_16", "online_dpo", {**odpo, "max_length": 16}, "prompts_equal",
        reward_funcs=("vowels",))  # fmt: skip
    add("online_dpo/grad_accum_2", "online_dpo", {**odpo, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 2}, "prompts", reward_funcs=("vowels",))  # fmt: skip
    # A2PO: stage 1 samples num_value_samples completions per prompt (V*), stage 2 one per prompt; binary reward
    a2po = {"max_completion_length": 12, "per_device_train_batch_size": 4}
    add("a2po/default", "a2po", a2po, "prompts_equal", reward_funcs=("has_vowel",))
    add("a2po/beta2_0.1", "a2po", {**a2po, "beta2": 0.1, "beta1": 1.0}, "prompts_equal", reward_funcs=("has_vowel",))
    add("a2po/no_filter_4_samples", "a2po", {**a2po, "filter_all_incorrect": False, "num_value_samples": 4},
        "prompts_equal", reward_funcs=("has_vowel",))  # fmt: skip
    add("a2po/temperature_0.7", "a2po", {**a2po, "temperature": 0.7, "beta2": 0.1}, "prompts_equal",
        reward_funcs=("has_vowel",))  # fmt: skip
    add("a2po/varied_prompts", "a2po", {**a2po, "beta2": 0.1}, "prompts", reward_funcs=("has_vowel",))
    # an epoch's short last batch (7 prompts at batch 2: TRL's plain Trainer dataloader trains it as step 4)
    short = {"per_device_train_batch_size": 2}
    add("online_dpo/short_last_batch", "online_dpo", {**odpo, **short}, "prompts_equal", dataset_kwargs={"n": 7},
        steps=4, reward_funcs=("vowels",))  # fmt: skip
    add("a2po/short_last_batch", "a2po", {**a2po, **short}, "prompts_equal", dataset_kwargs={"n": 7}, steps=4,
        reward_funcs=("has_vowel",))  # fmt: skip
    add("a2po/text_prompts", "a2po", {**a2po, "beta2": 0.1}, "prompts_equal_text", reward_funcs=("has_vowel",))
    # SDFT: the student samples, the teacher (the same network) scores those completions with the privileged context
    sdft = {"max_completion_length": 12, "num_generations": 4, "per_device_train_batch_size": 8}
    add("sdft/default_topk", "sdft", sdft, "prompts_privileged")
    add("sdft/full_logits", "sdft", {**sdft, "distillation_mode": "full_logits"}, "prompts_privileged")
    add("sdft/sampled_token", "sdft", {**sdft, "distillation_mode": "sampled_token", "distillation_alpha": 1.0},
        "prompts_privileged")  # fmt: skip
    add("sdft/topk_add_tail", "sdft", {**sdft, "distillation_topk": 5, "distillation_add_tail": True},
        "prompts_privileged")  # fmt: skip
    add("sdft/teacher_live", "sdft", {**sdft, "teacher_model_kind": "live"}, "prompts_privileged")
    add("sdft/teacher_ema", "sdft", {**sdft, "teacher_model_kind": "ema", "teacher_update_rate": 0.5},
        "prompts_privileged")  # fmt: skip
    add("sdft/skip_2_loss_tokens", "sdft", {**sdft, "num_loss_tokens_to_skip": 2}, "prompts_privileged")
    add("sdft/mu2_is_clip", "sdft", {**sdft, "num_iterations": 2, "distillation_mode": "full_logits"},
        "prompts_privileged")  # fmt: skip
    # SDPO: GRPO plus self-distillation toward the policy re-prompted with a successful completion of its group
    sdpo = {k: v for k, v in _ONLINE.items() if k != "use_bias_correction_kl"}  # not an SDPOConfig field in TRL
    add("sdpo/default", "sdpo", sdpo, "prompts_equal", reward_funcs=("has_vowel",))
    add("sdpo/weight_0.5", "sdpo", {**sdpo, "distillation_weight": 0.5}, "prompts_equal", reward_funcs=("has_vowel",))
    add("sdpo/full_logits_alpha_0.5", "sdpo", {**sdpo, "distillation_mode": "full_logits", "distillation_alpha": 0.5},
        "prompts_equal", reward_funcs=("has_vowel",))  # fmt: skip
    add("sdpo/topk_5", "sdpo", {**sdpo, "distillation_mode": "topk_logits", "distillation_topk": 5}, "prompts_equal",
        reward_funcs=("has_vowel",))  # fmt: skip
    add("sdpo/reprompt_on_self_success", "sdpo", {**sdpo, "dont_reprompt_on_self_success": False}, "prompts_equal",
        reward_funcs=("has_vowel",))  # fmt: skip
    add("sdpo/privileged_feedback", "sdpo", {**sdpo, "include_environment_feedback": True}, "prompts_privileged",
        reward_funcs=("has_vowel",))  # fmt: skip
    add("sdpo/mu2", "sdpo", {**sdpo, "num_iterations": 2}, "prompts_equal", reward_funcs=("has_vowel",))
    # GKD offline (lmbda=0, seq_kd=False: no sampling): the dataset's completions, student vs teacher; with the chat
    # template that ends an assistant turn at <|im_end|> (TRL's ChatML collator also trains on the newline after it:
    # gkd/offline_turn_newline keeps that template)
    gkd = {"max_length": 256, "lmbda": 0.0, "seq_kd": False}
    nl = {"teacher": True, "model": "causal-lm-no-newline"}
    for beta in (0.0, 0.5, 1.0):
        add(f"gkd/offline_beta{beta}", "gkd", {**gkd, "beta": beta}, "messages", **nl)
    add("gkd/offline_temperature_2", "gkd", {**gkd, "temperature": 2.0}, "messages", **nl)
    add("gkd/offline_batch1", "gkd", {**gkd, "per_device_train_batch_size": 1}, "messages", **nl)
    add("gkd/offline_batch1_temperature_2", "gkd", {**gkd, "per_device_train_batch_size": 1, "temperature": 2.0},
        "messages", **nl)  # fmt: skip
    add("gkd/offline_turn_newline", "gkd", gkd, "messages", teacher=True)
    add("gkd/offline_short_last_batch", "gkd", {**gkd, "per_device_train_batch_size": 2}, "messages",
        dataset_kwargs={"n": 7}, steps=4, **nl)  # fmt: skip
    # 7 rows at 2 × gradient accumulation 2: TRL's 2 optimizer steps of micro-batches (2, 2) and (2, 1)
    add("gkd/offline_short_last_batch_ga2", "gkd",
        {**gkd, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, "messages",
        dataset_kwargs={"n": 7}, steps=2, **nl)  # fmt: skip
    add("gkd/on_policy", "gkd", {**gkd, "lmbda": 1.0, "max_new_tokens": 12}, "messages", **nl)
    add("gkd/on_policy_beta1.0", "gkd", {**gkd, "lmbda": 1.0, "max_new_tokens": 12, "beta": 1.0}, "messages",
        **nl)  # fmt: skip
    # GOLD (same tokenizer: the generalized JSD at `temperature`), offline and on-policy
    gold = {**gkd, "learning_rate": 1e-3}
    add("gold/offline", "gold", {**gold, "lmbda": 0.0}, "messages", **nl)
    add("gold/offline_beta0.0", "gold", {**gold, "lmbda": 0.0, "beta": 0.0}, "messages", **nl)
    add("gold/offline_temperature_2", "gold", {**gold, "lmbda": 0.0, "temperature": 2.0}, "messages", **nl)
    # posttrain cuts a dataset completion to max_completion_length, TRL's GOLD/GKD only to max_length
    add("gold/offline_completion_cut_12", "gold", {**gold, "lmbda": 0.0, "max_completion_length": 12}, "messages",
        **nl)  # fmt: skip
    add("gold/on_policy", "gold", {**gold, "lmbda": 1.0, "max_completion_length": 12}, "messages", **nl)
    add("gold/on_policy_beta1.0", "gold", {**gold, "lmbda": 1.0, "beta": 1.0, "max_completion_length": 12},
        "messages", **nl)  # fmt: skip
    # IW-OPD: on-policy; the sampled-token IW-OPD objective and the sparse/full JSD
    iw = {"max_length": 256, "max_completion_length": 12}
    add("iw_opd/default", "iw_opd", iw, "messages", **nl)
    add("iw_opd/gamma_0", "iw_opd", {**iw, "iw_opd_gamma": 0.0}, "messages", **nl)
    add("iw_opd/jsd_top1", "iw_opd", {**iw, "distillation_objective": "jsd"}, "messages", **nl)
    add("iw_opd/jsd_full_beta0.5", "iw_opd", {**iw, "distillation_objective": "jsd", "loss_top_k": 0, "beta": 0.5},
        "messages", **nl)  # fmt: skip
    add("iw_opd/jsd_top5_forward", "iw_opd", {**iw, "distillation_objective": "jsd", "loss_top_k": 5, "beta": 0.0},
        "messages", **nl)  # fmt: skip
    return out


SCENARIOS: dict[str, Scenario] = {s.name: s for s in _scenarios()}


def select(patterns: list[str] | None) -> list[Scenario]:
    """Scenarios whose name contains any of ``patterns`` (all when empty)."""
    if not patterns:
        return list(SCENARIOS.values())
    return [s for s in SCENARIOS.values() if any(p in s.name for p in patterns)]


# -- running one scenario (inside either venv) -----------------------------------------------------------------------
def run_scenario(scenario: Scenario, model_paths: dict[str, str], trainer_classes: Any, output_dir: str):
    """Train ``scenario`` and return its per-step logs ``[{"step": n, key: value, ...}, ...]``."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    model_path = model_paths[scenario.task]
    vlm = scenario.task.startswith("vlm-")
    config_cls, trainer_cls = trainer_classes[scenario.trainer]
    rows = DATASETS[scenario.dataset](**scenario.dataset_kwargs)
    dataset = Dataset.from_list(rows)
    extra_args = scenario.posttrain_args if config_cls.__module__.startswith("posttrain") else {}
    config = config_cls(output_dir=output_dir, max_steps=scenario.steps, **scenario.args, **extra_args)
    kwargs: dict[str, Any] = {"model": model_path, "args": config, "train_dataset": dataset}
    if scenario.teacher:
        kwargs["teacher_model"] = model_paths["teacher"]
    if scenario.trainer in TOKENIZER_TRAINERS:
        from transformers import AutoTokenizer

        kwargs["processing_class"] = AutoTokenizer.from_pretrained(model_path)
    if scenario.trainer in REWARD_TRAINERS:
        kwargs["reward_funcs"] = [REWARD_FUNCS[name] for name in scenario.reward_funcs]
        if scenario.tools:
            kwargs["tools"] = [TOOLS[name] for name in scenario.tools]
        elif scenario.trainer in ROLLOUT_FUNC_TRAINERS and not scenario.sample and not vlm:
            kwargs["rollout_func"] = fixed_rollout_func
    logs: list[dict[str, Any]] = []

    class _Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logs_out = {"step": state.global_step}
                logs_out.update({k: _jsonable(v) for k, v in logs.items()})
                record.append(logs_out)

    record = logs
    torch.manual_seed(0)
    trainer = trainer_cls(**kwargs)
    if (scenario.trainer in PATCHED_TRAINERS or vlm) and not scenario.sample:
        patch_generation(trainer)
    if scenario.trainer in GENERATE_PATCHED_TRAINERS:
        patch_model_generation(trainer)
    trainer.add_callback(_Record())
    trainer.train()
    return logs


def _jsonable(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def run_many(scenarios: list[Scenario], model_paths: dict[str, str], trainer_classes) -> dict[str, Any]:
    """``{name: {"logs": [...]} | {"error": "..."}}`` for each scenario (a failure is recorded, not raised)."""
    import tempfile
    import traceback
    import warnings

    out: dict[str, Any] = {}
    for scenario in scenarios:
        with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out[scenario.name] = {"logs": run_scenario(scenario, model_paths, trainer_classes, tmp)}
            except Exception as error:  # noqa: BLE001 (recorded in the table)
                tb = traceback.format_exc(limit=4)
                out[scenario.name] = {"error": f"{type(error).__name__}: {error}"[:400], "traceback": tb[-1500:]}
    return out


# -- comparison ------------------------------------------------------------------------------------------------------
def _close(a: Any, b: Any, rel_tol: float = REL_TOL) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) and math.isnan(fb)
        return math.isclose(fa, fb, rel_tol=rel_tol, abs_tol=ABS_TOL)
    return a == b


@dataclass
class Comparison:
    name: str
    status: str  # equal | differs | error
    first_diff_step: int | None = None
    worst_key: str | None = None
    worst_rel: float = 0.0
    detail: str = ""
    keys_compared: int = 0
    only_posttrain: list[str] = field(default_factory=list)
    only_trl: list[str] = field(default_factory=list)
    differing_keys: list[str] = field(default_factory=list)


def compare(
    name: str,
    ours: dict[str, Any],
    theirs: dict[str, Any],
    rel_tol: float = REL_TOL,
    keys: tuple[str, ...] | None = None,
) -> Comparison:
    """Compare two scenario results step by step (keys both log, or only ``keys``; keys only one side logs are
    listed)."""
    if "error" in ours and "error" in theirs and ours["error"].split(":")[0] == theirs["error"].split(":")[0]:
        return Comparison(name, "equal", detail=f"both refuse: {theirs['error'][:160]}")
    if "error" in ours or "error" in theirs:
        detail = "; ".join(
            f"{side}: {r['error']}" for side, r in (("posttrain", ours), ("TRL", theirs)) if "error" in r
        )
        return Comparison(name, "error", detail=detail)
    a_logs, b_logs = ours["logs"], theirs["logs"]
    result = Comparison(name, "equal")
    if len(a_logs) != len(b_logs):
        result.status = "differs"
        result.detail = f"{len(a_logs)} logged steps vs {len(b_logs)}"
    a_keys = _compared(set().union(*(r.keys() for r in a_logs))) if a_logs else set()
    b_keys = _compared(set().union(*(r.keys() for r in b_logs))) if b_logs else set()
    if keys is not None:
        a_keys, b_keys = a_keys & set(keys), b_keys & set(keys)
    result.only_posttrain = sorted(a_keys - b_keys)
    result.only_trl = sorted(b_keys - a_keys)
    shared = sorted(a_keys & b_keys)
    result.keys_compared = len(shared)
    differing: dict[str, int] = {}
    for a, b in zip(a_logs, b_logs):
        for key in shared:
            va, vb = a.get(key), b.get(key)
            if va is None and vb is None:
                continue
            if (va is None) != (vb is None) or not _close(va, vb, rel_tol):
                differing.setdefault(key, a["step"])
                if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
                    rel = abs(float(va) - float(vb)) / max(abs(float(vb)), 1e-12)
                    rel = rel if not math.isnan(rel) else float("inf")
                else:
                    rel = float("inf")
                if rel > result.worst_rel or result.worst_key is None:
                    result.worst_rel, result.worst_key = rel, key
                    result.detail = f"step {a['step']} {key}: posttrain {va!r} vs TRL {vb!r}"
    if differing:
        result.status = "differs"
        result.first_diff_step = min(differing.values())
        result.differing_keys = sorted(differing, key=lambda k: (differing[k], k))
    return result


def markdown_table(comparisons: list[Comparison], known: dict[str, str] | None = None) -> str:
    known = dict(known or {})
    for c in comparisons:
        reason = known_difference(c)
        if reason and c.name not in known:
            known[c.name] = reason
    lines = [
        "| scenario | result | first differing step | differing keys (first step order) | worst (posttrain vs TRL) |"
        " keys compared | logged by one side only |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in comparisons:
        one_side = []
        if c.only_posttrain:
            one_side.append("posttrain: " + ", ".join(c.only_posttrain))
        if c.only_trl:
            one_side.append("TRL: " + ", ".join(c.only_trl))
        status = {"equal": "equal", "differs": "**differs**", "error": "**error**"}[c.status]
        if c.name in known and c.status != "equal":  # a scenario that matches needs no explanation
            status += f" (known: {known[c.name]})"
        detail = c.detail.replace("|", "\\|")
        lines.append(
            f"| {c.name} | {status} | {c.first_diff_step if c.first_diff_step is not None else ''} | "
            f"{', '.join(c.differing_keys[:6])}{' …' if len(c.differing_keys) > 6 else ''} | {detail} | "
            f"{c.keys_compared} | {'; '.join(one_side)} |"
        )
    return "\n".join(lines)


# Scenarios whose difference from TRL 1.16 is understood: deliberate (README's list) or pending another fix.
KNOWN_DIFFERENCES: dict[str, str] = {
    "online_dpo/beta_list": "deliberate (TRL bug): TRL's Online DPO indexes `beta` with the float `state.epoch` "
    "(TypeError: list indices must be integers); posttrain uses the epoch's integer part (TRL's documented meaning)",
}


# Understood differences limited to some keys: a scenario (name prefix) whose differing keys all fall in the set
# is marked known; any other differing key (e.g. the loss) still shows as an unexplained difference.
_LOGITS_MEAN = (
    "deliberate: logits/* are the mean logit over the completion tokens (computed from the scored hidden states, "
    "no (B, T, V) logits); TRL averages its full logits tensor over every position, prompt and padding included"
)
_LEGACY_DOUBLE_EOS = (
    "TRL's legacy CPO/ORPO tokenizer appends EOS after a conversational completion that the chat template already "
    "closed (`<|im_end|>\\n<|im_end|>`); posttrain, like TRL's own DPO, does not add a second end-of-turn token"
)
_GKD_NEWLINE = (
    "deliberate: TRL's ChatML collator (GKD) trains on everything after the prompt, so also on the `\\n` the chat "
    "template puts after `<|im_end|>`; posttrain's completion ends at EOS, as TRL's SFT with assistant-only loss"
)
_ONLINE_DPO_UNMASKED = (
    "deliberate (TRL bug): TRL's Online DPO sums `objective/kl`, `objective/entropy` (and so `non_score_reward`, "
    "`rlhf_reward`) over every completion column, the padding after EOS included; posttrain sums the completion "
    "tokens. `rewards/accuracies` at step 1 (π = π_ref): posttrain's margins are ±1e-7 of float rounding between "
    "its training forward and its no-grad reference pass, TRL's are exactly 0 (one forward code path)"
)
_ONLINE_DPO_GA = (
    "deliberate (TRL bug): TRL's Online DPO `training_step` backpropagates each micro-batch's mean loss without "
    "dividing by the accumulation steps, so its gradient (and grad_norm) is the sum over micro-batches (Adam makes "
    "the updates nearly equal); posttrain averages, as transformers' Trainer. Plus: " + _ONLINE_DPO_UNMASKED
)
_ON_POLICY_NORMALISER = (
    "deliberate (TRL bug): on an on-policy batch TRL divides the summed token loss by `num_items_in_batch`, which "
    "the Trainer counted on the dataset completions the student's samples replaced (step 1: 134 dataset tokens "
    "vs 38 sampled; posttrain/TRL loss and grad_norm = 3.5263 = 134/38 in every on-policy GKD/GOLD/IW-OPD "
    "scenario, so the loss math itself agrees); posttrain divides by the tokens it trains on"
)
_ONLINE_DPO_KEYS = frozenset(
    {"objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "rewards/accuracies"}
)
_SDPO_TOPK_ROUNDING = (
    "float rounding, not a formula: the top-5 distillation loss is ~4e-3 and already differs by 2e-5 (step 1) and "
    "4e-5 (step 2) relative; at step 3 the difference reaches 3e-4 in TRL's row order and 2e-6 in the order of "
    "posttrain's former shuffle (the other six SDPO scenarios are equal)"
)
KNOWN_KEY_DIFFERENCES: dict[str, tuple[frozenset[str] | None, str]] = {
    "sdpo/topk_5": (
        frozenset({"grad_norm", "sdpo/distillation_loss", "self_distillation/distillation_loss"}),
        _SDPO_TOPK_ROUNDING,
    ),
    "gkd/offline_turn_newline": (frozenset({"loss", "grad_norm"}), _GKD_NEWLINE),
    "online_dpo/grad_accum_2": (_ONLINE_DPO_KEYS | {"grad_norm"}, _ONLINE_DPO_GA),
    "gkd/on_policy": (frozenset({"loss", "grad_norm"}), _ON_POLICY_NORMALISER),
    "gold/on_policy": (frozenset({"loss", "grad_norm"}), _ON_POLICY_NORMALISER),
    "iw_opd/": (frozenset({"loss", "grad_norm"}), _ON_POLICY_NORMALISER),
    "online_dpo/": (_ONLINE_DPO_KEYS, _ONLINE_DPO_UNMASKED),
    "cpo/conversational": (None, _LEGACY_DOUBLE_EOS),
    "orpo/conversational": (None, _LEGACY_DOUBLE_EOS),
    "cpo/": (frozenset({"logits/chosen", "logits/rejected"}), _LOGITS_MEAN),
    "orpo/": (frozenset({"logits/chosen", "logits/rejected"}), _LOGITS_MEAN),
}


def known_difference(comparison: Comparison) -> str | None:
    """Why a non-equal scenario differs, when that is understood (see :data:`KNOWN_DIFFERENCES` and
    :data:`KNOWN_KEY_DIFFERENCES`)."""
    if comparison.status == "equal":
        return None
    if comparison.name in KNOWN_DIFFERENCES:
        return KNOWN_DIFFERENCES[comparison.name]
    if comparison.status != "differs":
        return None
    for prefix, (keys, reason) in KNOWN_KEY_DIFFERENCES.items():
        if comparison.name.startswith(prefix) and (keys is None or set(comparison.differing_keys) <= keys):
            return reason
    return None


def _table_rows(text: str) -> dict[str, str]:
    """``{scenario: row}`` of the result table between the markers of a FIDELITY.md text (header rows left out)."""
    begin, end = "<!-- fidelity-table:begin -->", "<!-- fidelity-table:end -->"
    if begin not in text or end not in text:
        return {}
    rows = {}
    for line in text[text.index(begin) : text.index(end)].splitlines():
        cells = line.split(" | ")
        if line.startswith("| ") and len(cells) > 2 and cells[0] not in ("| scenario", "| ---"):
            rows[cells[0][2:]] = line
    return rows


def write_markdown(
    path: str, table: str, counts: dict[str, int], ours: Any, theirs: Any, rerun: list[str] | None = None
) -> None:
    """Replace the generated part of ``path`` (between the markers) with ``table``; keep the hand-written text.

    With ``rerun`` (the ``--only`` patterns of a partial run) the rows of the scenarios not run are kept from the
    existing table, the new rows replace theirs, and the counts are those of the merged table."""
    import os

    begin, end = "<!-- fidelity-table:begin -->", "<!-- fidelity-table:end -->"
    text = open(path).read() if os.path.exists(path) else f"# Fidelity with TRL\n\n{begin}\n{end}\n"
    note = ""
    if rerun:
        new_rows = _table_rows(f"{begin}\n{table}\n{end}")
        merged = {**_table_rows(text), **new_rows}
        order = [n for n in SCENARIOS if n in merged] + [n for n in merged if n not in SCENARIOS]
        header = table.splitlines()[:2]
        table = "\n".join([*header, *(merged[n] for n in order)])
        cells = [merged[n].split(" | ")[1] for n in order]
        counts = {
            "equal": sum(c == "equal" for c in cells),
            "differs": sum(c.startswith("**differs**") for c in cells),
            "error": sum(c.startswith("**error**") for c in cells),
            "known": sum("(known:" in c for c in cells),
        }
        note = (
            f" This run re-ran the {len(new_rows)} scenarios matching `{' '.join(rerun)}`; the other rows are kept "
            "from the previous run."
        )
    body = (
        f"{begin}\n\nposttrain {(ours or {}).get('posttrain', '?')} vs TRL {(theirs or {}).get('trl', '?')} "
        f"(torch {(ours or {}).get('torch', '?')}, transformers {(ours or {}).get('transformers', '?')}): "
        f"**{counts['equal']} equal, {counts['differs']} differ, {counts['error']} errors** "
        f"({counts.get('known', 0)} of those understood: marked *known* below) of "
        f"{counts['equal'] + counts['differs'] + counts['error']} scenarios, relative tolerance {REL_TOL}.{note}"
        f"\n\n{table}\n\n{end}"
    )
    if begin in text and end in text:
        text = text[: text.index(begin)] + body + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    with open(path, "w") as f:
        f.write(text)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)


def _template_copy(causal_dir: str, suffix: str, template: Callable[[str], str]) -> str:
    """A copy of the saved tiny causal LM (``<dir>-<suffix>``) whose tokenizer's chat template is
    ``template(current template)``; made once. posttrain's venv only."""
    import shutil
    from pathlib import Path

    target = Path(causal_dir).with_name(Path(causal_dir).name + "-" + suffix)
    if (target / "config.json").is_file():
        return str(target)
    from transformers import AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(causal_dir, tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    tok.chat_template = template(tok.chat_template)
    tok.save_pretrained(tmp)
    tmp.rename(target)
    return str(target)


def ensure_qwen3_copy(causal_dir: str) -> str:
    """The tiny causal LM with posttrain's bundled Qwen3 chat template (tool calls in ``<tool_call>`` tags; both
    libraries know its training template). posttrain's venv only."""
    from pathlib import Path

    import posttrain.data.chat_templates as templates

    qwen3 = (Path(templates.__file__).parent / "templates" / "qwen3.jinja").read_text()
    return _template_copy(causal_dir, "qwen3", lambda _: qwen3)


_TURN_NEWLINE = "{%- endgeneration %}\n{{- '\\n' }}"


def ensure_tiny_vlm(causal_dir: str, family: str) -> str:
    """The tiny VLM of ``family`` (``posttrain.models.tiny.save_tiny_vlm``, seed 0) saved next to the tiny causal LM
    (``<dir>-vlm-<family>``); made once. Its processor needs no torchvision, so TRL's venv loads it too. posttrain's
    venv only."""
    import shutil
    from pathlib import Path

    target = Path(causal_dir).with_name(Path(causal_dir).name + f"-vlm-{family}")
    if (target / "config.json").is_file():
        return str(target)
    from posttrain.models.tiny import save_tiny_vlm

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_tiny_vlm(tmp, family=family)
    tmp.rename(target)
    return str(target)


def ensure_no_newline_copy(causal_dir: str) -> str:
    """The tiny causal LM whose ChatML template ends an assistant turn at ``<|im_end|>`` (no ``\\n`` after it):
    TRL's GKD collator trains on everything after the prompt, that newline included, posttrain's completion ends
    at EOS; with this template both train the same tokens (see the ``gkd/`` scenarios). posttrain's venv only."""

    def drop_newline(template: str) -> str:
        if _TURN_NEWLINE not in template:
            raise ValueError("The tiny model's chat template changed: no newline after the assistant turn to drop.")
        return template.replace(_TURN_NEWLINE, "{%- endgeneration %}")

    return _template_copy(causal_dir, "no-newline", drop_newline)
