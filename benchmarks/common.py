"""Benchmark plumbing shared by posttrain's runner and the TRL runner: models, timing, memory, JSON output.

This module must import with either virtual environment (posttrain's ``.venv`` or ``benchmarks/.venv-trl``), so it
imports only the standard library at module level; torch / transformers are imported inside functions, and posttrain
only where a model is *built* (which always happens in posttrain's venv — the TRL side loads the saved copy by path).

What is measured, identically on both sides:

- **step time**: seconds between consecutive ``on_step_end`` callbacks (one optimizer step, including data loading,
  generation, logging — everything the user waits for), both wall-clock and process CPU time (one torch thread, so
  CPU time is the step's cost independent of what else the shared machine runs); warm-up steps are dropped, the
  median is reported.
- **phases** (online RL): inclusive CPU seconds spent in named trainer methods (generation, rewards, no-grad
  log-probs, the loss forward); a call nested inside an already-timed phase is charged to the outer one, so phases
  never overlap. ``generation_share`` = generation CPU seconds / step CPU seconds over the timed steps.
- **tokens/s**: growth of TRL's cumulative ``num_tokens`` metric over the timed steps / their seconds.
- **peak RSS**: ``getrusage(RUSAGE_SELF).ru_maxrss`` at the end minus the RSS just before the trainer (and model)
  is built, in MiB — so import footprints of the two libraries cancel. One fresh process per run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_CACHE_DIR = Path(os.environ.get("POSTTRAIN_BENCH_CACHE", Path(tempfile.gettempdir()) / "posttrain-benchmarks"))

# Model sizes (keyword arguments of posttrain.models.tiny.build_tiny_model). "bigvocab" is the tiny model with
# Qwen2.5's 151 936-row embedding, so vocabulary-sized tensors dominate memory as with real models.
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
    "bigvocab": {"vocab_size": 151_936},
    # A tiny LLaVA (CLIP vision tower + the tiny Qwen2 text model; posttrain.models.tiny.build_tiny_vlm): 64x64
    # images in 8x8 patches = 64 image tokens per prompt. Its processor needs no torchvision, so TRL's venv loads it.
    "tiny-vlm": {"vlm": {"family": "llava", "image_size": 64, "patch_size": 8}},
    # Qwen2.5-0.5B's shape (its config.json; rope and norm constants aside, which cost nothing), random weights built
    # locally: 494M parameters, ~1.9 GiB in fp32, ~7.4 GiB fp32 Adam floor. The same shape as benchmarks.gpu.run.
    "qwen05b": {
        "hidden_size": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151_936,
        "max_position_embeddings": 32_768,
        "tie_word_embeddings": True,
    },
    # Qwen2.5-0.5B's LM-head shape (hidden 896, vocabulary 151 936, tied) on 2 of its 24 layers: vocabulary-sized
    # work at a real model's width (hidden 64 makes the head matmuls 14x shallower than they are), in CPU minutes.
    "qwen05b_2l": {
        "hidden_size": 896,
        "num_layers": 2,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151_936,
        "tie_word_embeddings": True,
    },
}
# Bump when the tiny model definition or the warm-start recipe changes, so cached copies are rebuilt.
MODEL_CACHE_VERSION = "1"


ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
    "POSTTRAIN_NO_REPORT": "1",  # no end-of-training HTML report
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def env_setup(threads: int = 1) -> None:
    """Offline, quiet, ``threads``-threaded (1 = stable timings) environment for a run."""
    for key, value in {**ENV_DEFAULTS, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}.items():
        os.environ.setdefault(key, value)
    import torch

    torch.set_num_threads(threads)
    import transformers

    transformers.logging.set_verbosity_error()
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def load_average() -> float | None:
    """One-minute load average: the machine is shared, so every record says how busy it was."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# -- models ------------------------------------------------------------------------------------------------------
def model_dir(model: str, task: str, *, warm_start: str | None = None, cache_dir: Path | str | None = None) -> Path:
    """Where the saved model for (size, task, warm start) lives."""
    cache = Path(cache_dir or DEFAULT_CACHE_DIR)
    name = f"{model}-{task}" + (f"-warm-{warm_start}" if warm_start else "") + f"-v{MODEL_CACHE_VERSION}"
    return cache / name


def ensure_model(
    model: str, task: str = "causal-lm", *, warm_start: str | None = None, cache_dir: Path | str | None = None
) -> str:
    """Build (once) and save the offline tiny model ``model`` for ``task``; return its directory.

    Must run in posttrain's venv (it uses ``posttrain.models.tiny``). ``warm_start`` names a recipe in
    ``benchmarks.workloads.WARM_STARTS`` (a few supervised steps so sampled completions end at varied lengths).
    Writes are atomic (temporary directory + rename), so concurrent runs never see a half-saved model.
    """
    if model not in MODEL_SPECS:
        raise ValueError(f"Unknown --model {model!r}. Valid: {', '.join(MODEL_SPECS)}.")
    target = model_dir(model, task, warm_start=warm_start, cache_dir=cache_dir)
    if (target / "config.json").is_file():
        return str(target)
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    if "vlm" in MODEL_SPECS[model]:
        from posttrain.models.tiny import save_tiny_vlm

        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        save_tiny_vlm(tmp, **MODEL_SPECS[model]["vlm"])
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        return str(target)
    tokenizer = build_tiny_tokenizer()
    net = build_tiny_model("qwen2", task, tokenizer=tokenizer, **MODEL_SPECS[model])
    if warm_start:
        from benchmarks.workloads import WARM_STARTS

        WARM_STARTS[warm_start](net, tokenizer)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    net.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


# -- timing ------------------------------------------------------------------------------------------------------
class PhaseTimer:
    """Inclusive wall-clock and CPU seconds per named phase; a call inside an active phase counts for the outer one."""

    def __init__(self, profile: bool = False):
        self.totals: dict[str, float] = {}
        self.cpu_totals: dict[str, float] = {}
        self._active: str | None = None
        self._profile = profile

    def wrap(self, owner: Any, attr: str, phase: str) -> bool:
        """Replace ``owner.attr`` (a bound method or function attribute) by a timed wrapper; False if absent."""
        func = getattr(owner, attr, None)
        if func is None or not callable(func):
            return False

        @functools.wraps(func)
        def timed(*args, **kwargs):
            if self._active is not None:
                return func(*args, **kwargs)
            self._active = phase
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                with self._record_function(phase):
                    return func(*args, **kwargs)
            finally:
                self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start
                self.cpu_totals[phase] = self.cpu_totals.get(phase, 0.0) + time.process_time() - cpu_start
                self._active = None

        setattr(owner, attr, timed)
        return True

    def _record_function(self, name: str):
        if not self._profile:
            return contextlib.nullcontext()
        import torch

        return torch.profiler.record_function(f"phase::{name}")

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        """(wall, CPU) totals so far."""
        return dict(self.totals), dict(self.cpu_totals)


# Logged metrics (TRL's names, logged by both libraries) copied into the record as their mean over the timed steps:
# they show the workloads really match (same completion lengths, same truncation).
TRACKED_METRICS = ("completions/mean_length", "completions/clipped_ratio", "reward")


@dataclass
class StepRecorder:
    """Per-optimizer-step wall and CPU time, phase seconds, cumulative ``num_tokens`` and loss (fed by a callback).

    CPU time (``time.process_time``; runs use one torch thread) is what a single-threaded step costs whatever else
    the machine runs; wall time is what the user waits for. On a shared, loaded machine compare CPU times.
    """

    phases: PhaseTimer = field(default_factory=PhaseTimer)
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)
    step_phases: list[dict[str, float]] = field(default_factory=list)
    step_phases_cpu: list[dict[str, float]] = field(default_factory=list)
    num_tokens: dict[int, float] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    metrics: dict[str, dict[int, float]] = field(default_factory=dict)
    _last: tuple[float, float] | None = None
    _last_phases: tuple[dict[str, float], dict[str, float]] = ({}, {})

    def begin(self) -> None:
        self._last = (time.perf_counter(), time.process_time())
        self._last_phases = self.phases.snapshot()

    def step_end(self) -> None:
        now = (time.perf_counter(), time.process_time())
        last = self._last if self._last is not None else now
        phases = self.phases.snapshot()
        self.step_seconds.append(now[0] - last[0])
        self.step_cpu_seconds.append(now[1] - last[1])
        self.step_phases.append({k: v - self._last_phases[0].get(k, 0.0) for k, v in phases[0].items()})
        self.step_phases_cpu.append({k: v - self._last_phases[1].get(k, 0.0) for k, v in phases[1].items()})
        self._last, self._last_phases = now, phases

    def on_log(self, step: int, logs: dict[str, float]) -> None:
        for key in TRACKED_METRICS:
            if key in logs:
                self.metrics.setdefault(key, {})[step] = float(logs[key])
        if "num_tokens" in logs:
            self.num_tokens[step] = float(logs["num_tokens"])
        if "loss" in logs:
            self.losses[step] = float(logs["loss"])

    def callback(self):
        """A ``transformers.TrainerCallback`` feeding this recorder (works with any Trainer subclass)."""
        from transformers import TrainerCallback

        recorder = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                recorder.begin()

            def on_step_end(self, args, state, control, **kwargs):
                recorder.step_end()

            def on_log(self, args, state, control, logs=None, **kwargs):
                recorder.on_log(state.global_step, logs or {})

        return _Callback()

    def _tokens_at(self, step: int) -> float | None:
        """Cumulative ``num_tokens`` after ``step`` (the last value logged at or before it; some steps log none)."""
        if step == 0:
            return 0.0
        logged = [s for s in self.num_tokens if s <= step]
        return self.num_tokens[max(logged)] if logged else None

    def summary(self, warmup: int) -> dict[str, Any]:
        """Medians and shares over the steps after ``warmup``."""
        timed = self.step_seconds[warmup:]
        if not timed:
            raise RuntimeError(f"No timed steps: {len(self.step_seconds)} steps ran, warm-up is {warmup}.")
        total = sum(timed)
        timed_cpu = self.step_cpu_seconds[warmup:] or [0.0]
        total_cpu = sum(timed_cpu)
        out: dict[str, Any] = {
            "median_step_s": round(statistics.median(timed), 5),
            "mean_step_s": round(total / len(timed), 5),
            "step_s": [round(s, 5) for s in timed],
            "median_step_cpu_s": round(statistics.median(timed_cpu), 5),
            "mean_step_cpu_s": round(total_cpu / len(timed_cpu), 5),
            "step_cpu_s": [round(s, 5) for s in timed_cpu],
        }
        for key, per_step, denominator in (
            ("phase_share", self.step_phases_cpu, total_cpu),
            ("phase_share_wall", self.step_phases, total),
        ):
            totals: dict[str, float] = {}
            for phases in per_step[warmup:]:
                for k, v in phases.items():
                    totals[k] = totals.get(k, 0.0) + v
            if totals and denominator > 0:
                out[key] = {k: round(v / denominator, 4) for k, v in sorted(totals.items())}
        if "phase_share" in out:
            out["generation_share"] = out["phase_share"].get("generation")
        n_steps = len(self.step_seconds)
        start_tokens = self._tokens_at(warmup)
        end_tokens = self._tokens_at(n_steps)
        if start_tokens is not None and end_tokens is not None and end_tokens > start_tokens:
            out["tokens_per_s"] = round((end_tokens - start_tokens) / total, 1)
            out["tokens_per_cpu_s"] = round((end_tokens - start_tokens) / max(total_cpu, 1e-9), 1)
            out["tokens_per_step"] = round((end_tokens - start_tokens) / len(timed), 1)
        else:
            out["tokens_per_s"] = None
        out["final_loss"] = self.losses[max(self.losses)] if self.losses else None
        for key, by_step in sorted(self.metrics.items()):
            values = [v for step, v in by_step.items() if step > warmup]
            if values:
                out[key] = round(statistics.mean(values), 4)
        return out


def versions(impl: str) -> dict[str, str]:
    """Library versions of this process (posttrain or trl, plus the shared stack)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in (impl, "torch", "transformers", "accelerate", "datasets", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            if name == "posttrain":
                from posttrain import __version__

                out[name] = __version__
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` → config overrides; values are read as JSON when they parse (numbers, true/false)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set/--both expects key=value, got {item!r}.")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line (the benchmark's output contract) and flush."""
    print(json.dumps(record, sort_keys=False), flush=True)


def parse_record(stdout: str) -> dict[str, Any]:
    """The last JSON object line of a runner's stdout."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith('{"') and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:  # a trainer's own printed dict, not ours
                continue
    raise ValueError(f"No JSON line in the runner's output:\n{stdout[-2000:]}")


# -- one run -----------------------------------------------------------------------------------------------------
# (owner expression, attribute, phase) triples are resolved against the trainer after it is built: "trainer" is the
# trainer itself, "trainer.pipeline" an attribute of it. Missing attributes are skipped (not every trainer has them).
PhaseTargets = list[tuple[str, str, str]]


def _resolve_owner(trainer: Any, path: str) -> Any:
    owner = trainer
    for part in path.split(".")[1:]:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def execute(
    impl: str,
    workload: Any,
    model_path: str,
    *,
    trainer_classes: dict[str, tuple[Any, Any]],
    phase_targets: PhaseTargets,
    steps: int,
    warmup: int,
    model_name: str,
    output_dir: str,
    lora_config_cls: Any = None,
    profile_path: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``workload`` for ``warmup + steps`` optimizer steps with ``impl``'s trainer; return the JSON record.

    ``trainer_classes`` maps the trainer kind (``"grpo"``, ``"sft"``, ...) to ``(ConfigClass, TrainerClass)`` of
    the library under test; everything else (dataset, config values, reward functions, LoRA) is identical for both.
    With ``profile_path``, one step after the warm-up runs under ``torch.profiler`` and its table is written there.
    """
    import gc

    from benchmarks.workloads import LORA_KWARGS, REWARD_FUNCS, build_dataset, trainer_args

    if workload.trainer not in trainer_classes:
        raise ValueError(f"{impl} has no trainer for {workload.trainer!r}; available: {sorted(trainer_classes)}.")
    config_cls, trainer_cls = trainer_classes[workload.trainer]
    dataset = build_dataset(workload.dataset, **workload.dataset_kwargs)
    max_steps = warmup + (1 if profile_path else steps)
    config = config_cls(**trainer_args(workload, output_dir=output_dir, max_steps=max_steps))
    kwargs: dict[str, Any] = {"model": model_path, "args": config, "train_dataset": dataset}
    if workload.reward_funcs:
        kwargs["reward_funcs"] = [REWARD_FUNCS[name] for name in workload.reward_funcs]
    if workload.lora:
        if lora_config_cls is None:
            raise ValueError(f"Workload {workload.name!r} needs peft (LoRA); install peft in {impl}'s venv.")
        kwargs["peft_config"] = lora_config_cls(task_type="CAUSAL_LM", **LORA_KWARGS)

    gc.collect()
    baseline = current_rss_bytes()
    load = load_average()
    with _model_load_probe() as after_model:
        trainer = trainer_cls(**kwargs)
    timer = PhaseTimer(profile=profile_path is not None)
    recorder = StepRecorder(phases=timer)
    trainer.add_callback(recorder.callback())
    wrapped = []
    for owner_path, attr, phase in phase_targets:
        owner = _resolve_owner(trainer, owner_path)
        if owner is not None and timer.wrap(owner, attr, phase):
            wrapped.append(f"{owner_path}.{attr}")
    profiler = _StepProfiler(profile_path, warmup) if profile_path else None
    if profiler is not None:
        trainer.add_callback(profiler.callback())

    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    # ru_maxrss is the kernel's lazily synced high-water mark (per-thread RSS counters fold in at intervals), so it can
    # read a few pages below a /proc/self/statm sample taken earlier; the peak is at least every sample we took.
    peak = max(peak_rss_bytes(), current_rss_bytes(), *after_model)

    import benchmarks

    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    memory: dict[str, Any] = {
        # the model's own bytes and the fp32 Adam floor: params + grads + two moments of the trainable ones
        "model_param_mib": round(params / 2**20, 1),
        "adam_floor_mib": round((params + 3 * trainable) / 2**20, 1),
    }
    if benchmarks.INTERPRETER_RSS_BYTES is not None:
        memory["peak_rss_above_interpreter_mib"] = round((peak - benchmarks.INTERPRETER_RSS_BYTES) / 2**20, 1)
        memory["interpreter_rss_mib"] = round(benchmarks.INTERPRETER_RSS_BYTES / 2**20, 1)
    if after_model:
        memory["peak_rss_above_model_mib"] = round((peak - after_model[0]) / 2**20, 1)
        memory["model_loaded_rss_mib"] = round(after_model[0] / 2**20, 1)
    record: dict[str, Any] = {
        "impl": impl,
        "config": workload.name,
        "trainer": workload.trainer,
        "model": model_name,
        "steps": len(recorder.step_seconds) - warmup,
        "warmup": warmup,
        "threads": _threads(),
        **recorder.summary(warmup),
        "peak_rss_mib": round((peak - baseline) / 2**20, 1),
        **memory,
        "baseline_rss_mib": round(baseline / 2**20, 1),
        "train_wall_s": round(wall, 3),
        "load_avg_1m": load,
        "timed_methods": wrapped,
        "versions": versions(impl),
        **(extra or {}),
    }
    if profiler is not None:
        record["profile"] = profiler.summary
    return record


def _touch_weights(model: Any) -> None:
    """Make every page of the model's CPU weights resident (one read per 4 KiB page; no copy)."""
    import itertools

    import torch

    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.device.type == "cpu" and t.numel() and t.is_contiguous():
                t.detach().reshape(-1)[:: max(1, 4096 // t.element_size())].sum()


@contextlib.contextmanager
def _model_load_probe():
    """Yield a list that receives the RSS right after the first ``from_pretrained`` (the policy) returns.

    Both libraries load the policy from the saved path with ``PreTrainedModel.from_pretrained``; the RSS then is the
    zero of "peak RSS above the loaded model" (everything the trainer holds beyond imports and the weights).
    transformers maps a safetensors file's weights into memory lazily (``MAP_PRIVATE``: a page becomes resident
    when first read, and the optimizer's first write turns it into an anonymous copy in place, counted once), so
    the probe reads one element per page of every parameter and buffer first: otherwise the weights are
    resident only later, inside "above the loaded model", and adding ``model_param_mib`` to it counts them twice.
    """
    from transformers import PreTrainedModel

    seen: list[int] = []
    original = PreTrainedModel.__dict__["from_pretrained"]  # a classmethod object
    func = original.__func__

    @functools.wraps(func)
    def probed(cls, *args, **kwargs):
        model = func(cls, *args, **kwargs)
        if not seen:
            _touch_weights(model)
            seen.append(current_rss_bytes())
        return model

    PreTrainedModel.from_pretrained = classmethod(probed)
    try:
        yield seen
    finally:
        PreTrainedModel.from_pretrained = original


def _threads() -> int:
    import torch

    return torch.get_num_threads()


class _StepProfiler:
    """Profiles optimizer step ``warmup + 1`` with ``torch.profiler`` and writes the op table + phase totals."""

    def __init__(self, path: str, warmup: int):
        self.path = path
        self.warmup = warmup
        self.summary: dict[str, Any] = {}
        self._prof = None

    def callback(self):
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                if outer.warmup == 0:
                    outer._start()

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == outer.warmup:
                    outer._start()
                elif state.global_step == outer.warmup + 1:
                    outer._stop()

        return _Callback()

    def _start(self) -> None:
        import torch

        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def _stop(self) -> None:
        seconds = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        events = self._prof.key_averages()
        phases = {
            e.key.removeprefix("phase::"): round(e.cpu_time_total / 1e6, 4)
            for e in events
            if e.key.startswith("phase::")
        }
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
        self.summary = {
            "step_s": round(seconds, 4),
            "phase_s": phases,
            "top_self_cpu_ms": {e.key: round(e.self_cpu_time_total / 1e3, 1) for e in top[:12]},
        }
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(f"# one optimizer step after {self.warmup} warm-up steps: {seconds:.3f} s wall\n")
            f.write(f"# phases (inclusive CPU s): {json.dumps(phases)}\n\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
