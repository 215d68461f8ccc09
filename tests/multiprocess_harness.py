"""What the 2-process ≡ 1-process tests share: one torchrun launch of a scenario script (gloo on CPU), the
1-process reference run single-threaded in the test process, and a deterministic ``rollout_func``.

The launch runs many scenarios in one pair of processes (imports dominate the cost); the reference runs the same
scenarios in-process with twice the per-device batch, so both see the same global batch.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# Plain SGD with a constant rate: parameter differences stay proportional to gradient differences (Adam's first step
# is ~lr·sign(g), which turns float noise in tiny gradients into lr-sized differences).
SGD_ARGS = dict(max_steps=2, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=7)
SGD_ARGS.update(optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", gradient_checkpointing=False)
# position k of a prompt's group → completion text (different lengths and rewards)
COMPLETIONS = ["a", "bb bb", "ccc ccc ccc", "d"]


def finish_rank() -> None:
    """End a torchrun scenario script's rank once its results are on disk: meet the other rank, then leave at once.

    Every rank waits at a barrier (so no rank leaves while the other still needs it), flushes its output and exits
    through ``os._exit(0)``, skipping the gloo process group's teardown. That teardown — in ``destroy_process_group()``
    or, without it, in the interpreter's finalisation — sometimes aborts a rank on a loaded machine with "terminate
    called without an active exception" (gloo worker threads still joinable when their C++ objects are destroyed;
    pytorch/pytorch#179291 describes the finalisation case). It was seen after every scenario had written its
    results (the files were complete, the abort came after), so it is an exit-time crash in torch, not in what the
    tests check; leaving through ``os._exit`` after the barrier removes it without hiding anything a test reads.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_two_processes(script: str, args: Sequence[str], timeout: float = 240) -> None:
    """Run ``script ARGS...`` under ``torchrun --nproc_per_node 2`` (gloo on CPU); fail with its stderr tail."""
    pythonpath = os.pathsep.join(p for p in (HERE, os.path.dirname(script), os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "POSTTRAIN_NO_REPORT": "1",
        "HF_HUB_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONPATH": pythonpath,
    }
    env.pop("ACCELERATE_USE_CPU", None)  # BaseConfig must pick MULTI_CPU by itself under torchrun on CPU
    # --standalone: torchrun binds its rendezvous store to a port of its own choosing (port 0) instead of one picked
    # here and bound later, which another test's server could take in between (the rank then met a stranger's
    # socket and aborted: "terminate called without an active exception")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*cmd, script, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the 1-process reference on one thread (as each torchrun process does), restoring the count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _prompt_salt(key: str) -> int:
    return sum(map(ord, key))


def group_position_rollout(prompts: list, trainer, vary_by_prompt: bool = False) -> dict:
    """A ``rollout_func`` whose completion depends only on the prompt and its position in its whole group.

    A group smaller here than ``trainer.num_generations`` was split across the 2 processes in rank order, so this
    process's k-th copy of a prompt is position ``rank * copies_here + k``: 1 and 2 processes train on identical
    completions. ``vary_by_prompt``: shift the completion by a prompt-dependent offset too (one completion per
    prompt still gets different rewards across prompts).
    """
    tokenizer = trainer.processing_class
    rank = trainer.accelerator.process_index
    group = getattr(trainer, "num_generations", 1) or 1
    copies, seen = Counter(map(str, prompts)), Counter()
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        key = str(prompt)
        k = (rank * copies[key] if copies[key] < group else 0) + seen[key]
        seen[key] += 1
        if vary_by_prompt:
            k += _prompt_salt(key)
        text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(prompt, tokenize=False)
        prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        completion = COMPLETIONS[k % len(COMPLETIONS)]
        completion_ids.append(tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


class PromptKeyedBackend:
    """A generation backend (``generate(prompt_ids, sampling, num_generations)``) answering each prompt with a fixed
    completion chosen by its ids: the distillation rollouts' on-policy samples, identical on 1 and 2 processes."""

    def __init__(self, tokenizer):
        eos = tokenizer.eos_token_id
        self.answers = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in COMPLETIONS]

    def sync_weights(self, model) -> None:
        """Nothing to load: the answers do not depend on the weights."""

    def generate(self, prompt_ids, sampling, num_generations: int = 1, **kwargs):
        from posttrain.generation.base import Completions

        rows = [ids for ids in prompt_ids for _ in range(num_generations)]
        answers = [self.answers[(sum(ids) + i % num_generations) % len(self.answers)] for i, ids in enumerate(rows)]
        return Completions([list(a) for a in answers], None, [True] * len(rows), [list(ids) for ids in rows])
