"""Running a training verb: parse and validate, then train here or launch the workers; errors in one paragraph.

Two entry points share the parsing:

- :func:`run_training_command` is ``posttrain <verb>``: it checks every option (flags and YAML), splits off the
  ``accelerate launch`` options, and either calls the script's ``main`` in this process or starts the workers
  (``posttrain.cli.launch``), each running :func:`run_script`.
- :func:`run_script` is ``python -m posttrain.scripts.<verb>`` (what each worker runs, TRL's script layout): it
  trains in the current process; launch options in the recipe are ignored there.

Any error becomes a one-paragraph message on stderr and a non-zero exit code (2 for bad options, 1 otherwise, 130
when interrupted); ``--debug`` (without a value) or ``POSTTRAIN_DEBUG=1`` prints the full traceback instead.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
import traceback
from collections.abc import Callable
from typing import Any

from posttrain.cli.parser import ConfigError

TRAINING_VERBS = ("sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation")

_MAX_MESSAGE_CHARS = 2500


class TrainerUnavailableError(ImportError):
    """The trainer module behind a verb is not part of this installation."""


def pop_debug_flag(argv: list[str]) -> tuple[bool, list[str]]:
    """Remove a bare ``--debug`` (one not followed by a value) from ``argv``.

    ``--debug VALUE`` is left alone: it is ``TrainingArguments.debug`` (e.g. ``underflow_overflow``).
    """
    debug = os.environ.get("POSTTRAIN_DEBUG", "0").lower() in ("1", "true", "yes")
    out = []
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg == "--debug" and (nxt is None or nxt.startswith("-")):
            debug = True
            continue
        out.append(arg)
    return debug, out


def format_error(prog: str, err: BaseException) -> str:
    """``prog: error: message`` in one paragraph; unexpected exception types also say where they were raised."""
    message = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip()) or repr(err)
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + " [...]"
    expected = isinstance(err, (ConfigError, ValueError, OSError, ImportError, KeyError, TypeError))
    text = f"{prog}: error: {message}"
    if not isinstance(err, ConfigError):
        text += f" ({type(err).__name__})"
    if not text.endswith("."):
        text += "."
    if not expected:
        frames = traceback.extract_tb(err.__traceback__)
        if frames:
            last = frames[-1]
            text += f" Raised at {last.filename}:{last.lineno} in {last.name}."
    return text + " Run again with --debug for the full traceback."


def guarded(prog: str, fn: Callable[[], Any], debug: bool = False) -> int:
    """Run ``fn`` and turn its exceptions into an exit code plus a one-paragraph message (a traceback if ``debug``)."""
    try:
        result = fn()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted.", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as err:
        if debug:
            traceback.print_exc()
        else:
            print(format_error(prog, err), file=sys.stderr, flush=True)
        return 2 if isinstance(err, ConfigError) else 1
    return int(result or 0)


def load_script(verb: str):
    """The module ``posttrain.scripts.<verb>``."""
    if verb not in TRAINING_VERBS:
        raise ConfigError(f"Unknown training command {verb!r}; choose one of: {', '.join(TRAINING_VERBS)}.")
    return importlib.import_module(f"posttrain.scripts.{verb}")


def make_verb_parser(verb: str):
    """The script's ``TrlParser``; a trainer module missing from this installation gives a one-line error."""
    script = load_script(verb)
    try:
        return script.make_parser(prog=f"posttrain {verb}")
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("posttrain.trainers"):
            raise TrainerUnavailableError(
                f"`posttrain {verb}` needs the module {err.name}, which is not part of this posttrain installation; "
                "update posttrain to a version that has this trainer."
            ) from err
        raise


def _run_main(verb: str, parser, namespace) -> int:
    configs = parser.namespace_to_dataclasses(namespace)
    load_script(verb).main(*configs)
    return 0


def _parse(verb: str, argv: list[str]):
    parser = make_verb_parser(verb)
    namespace, remaining = parser.parse_namespace_and_config(argv)
    from posttrain.cli.launch import split_launch_args

    launch_args, unknown = split_launch_args(remaining)
    if unknown:
        raise ConfigError(parser.unknown_args_message(unknown))
    return parser, namespace, launch_args


def run_training_command(verb: str, argv: list[str] | None = None) -> int:
    """``posttrain <verb> [options]``: validate, then train in this process or launch the workers.

    Returns the exit code (the workers' exit code when they were launched).
    """
    debug, argv = pop_debug_flag(list(sys.argv[2:] if argv is None else argv))
    prog = f"posttrain {verb}"

    def work() -> int:
        from posttrain.cli.launch import plan_launch, run_plan, strip_launch_args

        parser, namespace, launch_args = _parse(verb, argv)
        script_argv = strip_launch_args(argv, set(parser._option_string_actions))
        plan = plan_launch(verb, launch_args, ["--debug", *script_argv] if debug else script_argv)
        if plan.launcher == "inprocess":
            os.environ.update(plan.env)
            return _run_main(verb, parser, namespace)
        preflight(namespace)
        print(
            f"[{prog}] launching {plan.num_processes} processes on {plan.num_machines} machine(s) with "
            f"{plan.launcher}: {shlex.join(plan.command)}",
            file=sys.stderr,
            flush=True,
        )
        return run_plan(plan)

    return guarded(prog, work, debug)


def run_script(verb: str, argv: list[str] | None = None) -> int:
    """``python -m posttrain.scripts.<verb> [options]``: train in this process (a worker, or a direct run)."""
    debug, argv = pop_debug_flag(list(sys.argv[1:] if argv is None else argv))
    prog = f"posttrain.scripts.{verb}"

    def work() -> int:
        parser, namespace, launch_args = _parse(verb, argv)
        if launch_args and not os.environ.get("POSTTRAIN_LAUNCHED"):
            print(
                f"[{prog}] launch options {' '.join(a for a in launch_args if a.startswith('-'))} have no effect when "
                f"the script runs directly; use `posttrain {verb}` (or accelerate launch / torchrun) to start "
                "several processes.",
                file=sys.stderr,
            )
        return _run_main(verb, parser, namespace)

    return guarded(prog, work, debug)


def preflight(namespace) -> None:
    """Fail in the launching process, before any worker starts, on a missing model, dataset or reward function.

    Cheap checks only: model configs are read (not weights), datasets are opened in streaming mode, reward specs are
    resolved.
    """
    from posttrain.models.loading import load_config

    model = getattr(namespace, "model_name_or_path", None)
    if not model:
        raise ConfigError("--model_name_or_path is required: a hub id or a local model folder.")
    load_config(model, trust_remote_code=getattr(namespace, "trust_remote_code", False))
    for key in ("reward_model_name_or_path", "teacher_model_name_or_path"):
        other = getattr(namespace, key, None)
        if isinstance(other, str) and other:
            load_config(other, trust_remote_code=getattr(namespace, "trust_remote_code", False))
    if getattr(namespace, "reward_funcs", None):
        from posttrain.rewards.registry import resolve_reward_funcs

        resolve_reward_funcs(namespace.reward_funcs)
    from posttrain.data.loading import DatasetConfig, load_dataset_from_spec

    mixture = getattr(namespace, "datasets", None) or []
    for i, entry in enumerate(mixture):
        if isinstance(entry, dict):
            try:
                entry = DatasetConfig(**entry)
            except TypeError as err:
                raise ConfigError(f"datasets[{i}] in the recipe is not a valid dataset entry: {err}") from err
        load_dataset_from_spec(
            entry.path, config=entry.name, data_files=entry.data_files, data_dir=entry.data_dir, streaming=True
        )
    if not mixture and getattr(namespace, "dataset_name", None):
        load_dataset_from_spec(
            namespace.dataset_name, config=getattr(namespace, "dataset_config", None), streaming=True
        )
