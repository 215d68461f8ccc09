"""How ``posttrain <verb>`` runs: in this process, under ``torchrun`` (CPU), or under ``accelerate launch`` (GPU).

Options no config dataclass claims are ``accelerate launch`` options (``--num_processes``, ``--config_file``,
``--main_process_port``, ``--num_machines``, ``--machine_rank``, ``--mixed_precision``, ...), recognised from
accelerate's own parser, plus ``--accelerate_config NAME|PATH`` (a bundled preset in ``posttrain/accelerate_configs``
or a file), rewritten to ``--config_file``. :func:`plan_launch` turns them into one of three launchers:

- ``inprocess``: one process on one machine, no DeepSpeed/FSDP: the script's ``main`` runs here, no subprocess. The
  few launch options that matter for one process (``--cpu``, ``--mixed_precision``, ``--gpu_ids``,
  ``--num_cpu_threads_per_process``, ``--dynamo_backend``) are applied as the environment variables accelerate's simple
  launcher would set.
- ``torchrun`` (no CUDA, or ``--cpu``): ``python -m torch.distributed.run --nproc_per_node N ... -m
  posttrain.scripts.<verb>``. Measured on CPU: ``accelerate launch --cpu --num_processes 2`` starts a single process,
  while torchrun gives accelerate's MULTI_CPU mode (gloo) with working collectives.
- ``accelerate``: ``python -m accelerate.commands.launch <launch options> -m posttrain.scripts.<verb>`` with CUDA
  (or whenever DeepSpeed / FSDP / Megatron / TPU is asked for).

As with ``accelerate launch``, the process count comes from ``--num_processes``, else the config file (``--config_file``
or accelerate's default config), else every visible CUDA device, else 1.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.cli.parser import ConfigError

ACCELERATE_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "accelerate_configs"

# launch options posttrain sets itself: the training script is always ``-m posttrain.scripts.<verb>``
_RESERVED = {"help", "module", "no_python", "training_script", "training_script_args"}

# accelerate distributed types that need accelerate's launcher even for a single process
_LAUNCHER_TYPES = {"DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "TPU"}

# launch options (dests) that a single in-process run can honour through environment variables
_INPROCESS_OK = {
    "config_file",
    "accelerate_config",
    "quiet",
    "cpu",
    "mixed_precision",
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "same_network",
    "num_cpu_threads_per_process",
    "gpu_ids",
    "dynamo_backend",
    "debug",
    "tee",
    "log_dir",
    "role",
    "rdzv_backend",
    "rdzv_conf",
    "max_restarts",
    "monitor_interval",
}


def bundled_accelerate_configs() -> dict[str, Path]:
    """Name → path of the accelerate config presets shipped with posttrain (``zero3``, ``fsdp2``, ...)."""
    return {p.stem: p for p in sorted(ACCELERATE_CONFIGS_DIR.glob("*.yaml"))}


def resolve_accelerate_config(name_or_path: str) -> str:
    """Path of the accelerate config for ``--accelerate_config``: a bundled preset name or an existing file."""
    bundled = bundled_accelerate_configs()
    if name_or_path in bundled:
        return str(bundled[name_or_path])
    if os.path.isfile(name_or_path):
        return name_or_path
    raise ConfigError(
        f"--accelerate_config {name_or_path!r} is neither a bundled preset nor an existing file. Presets: "
        f"{', '.join(bundled)} (see {ACCELERATE_CONFIGS_DIR}); or pass the path of an accelerate YAML config."
    )


@functools.cache
def accelerate_options() -> dict[str, tuple[str, bool]]:
    """Every ``accelerate launch`` option string → (dest, takes a value), plus ``--accelerate_config``."""
    from accelerate.commands.launch import launch_command_parser

    table: dict[str, tuple[str, bool]] = {}
    for action in launch_command_parser()._actions:
        if action.dest in _RESERVED:
            continue
        for opt in action.option_strings:
            table[opt] = (action.dest, action.nargs != 0)
    table["--accelerate_config"] = ("accelerate_config", True)
    table["--accelerate-config"] = ("accelerate_config", True)
    return table


def split_launch_args(strings: list[str]) -> tuple[list[str], list[str]]:
    """Split strings no dataclass claimed into ``accelerate launch`` options and truly unknown strings.

    Switches written YAML-style (``--cpu true`` / ``--cpu false``) are normalised to ``--cpu`` / dropped. A value is
    always kept next to its option, and ``--opt=value`` is split, so the result can be handed to accelerate's parser.
    """
    table = accelerate_options()
    launch: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(strings):
        token = strings[i]
        opt, eq, value = token.partition("=") if token.startswith("--") else (token, "", "")
        spec = table.get(opt)
        if spec is None:
            unknown.append(token)
            i += 1
            continue
        _, takes_value = spec
        if takes_value:
            if eq:
                launch += [opt, value]
                i += 1
            elif i + 1 < len(strings):
                launch += [opt, strings[i + 1]]
                i += 2
            else:
                raise ConfigError(f"Launch option {opt} needs a value (e.g. {opt} 2).")
        else:
            nxt = value if eq else (strings[i + 1] if i + 1 < len(strings) else None)
            explicit = nxt is not None and nxt.lower() in ("true", "false")
            if not explicit or nxt.lower() == "true":
                launch.append(opt)
            i += 1 + (1 if explicit and not eq else 0)
    return launch, unknown


def _parse_launch_args(launch_args: list[str]) -> argparse.Namespace:
    """accelerate's own parser over the launch options (later repeats win, so the command line beats the YAML)."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()

    def error(message: str):
        raise ConfigError(f"Invalid launch option: {message}. See `accelerate launch --help`.")

    parser.error = error  # type: ignore[method-assign]
    config_name, args = _pop_accelerate_config(launch_args)
    namespace = parser.parse_args([*args, "posttrain_script"])
    if config_name is not None:
        if namespace.config_file is not None:
            raise ConfigError("Give either --accelerate_config or --config_file, not both.")
        namespace.config_file = resolve_accelerate_config(config_name)
    return namespace


def _read_accelerate_config(path: str | None, *, use_default: bool = True) -> dict[str, Any]:
    """The accelerate config at ``path``, else accelerate's default config file when it exists (and
    ``use_default``), else {}."""
    import yaml

    if path is None:
        if not use_default:
            return {}
        try:
            from accelerate.commands.config import default_config_file
        except ImportError:  # pragma: no cover - accelerate always has it
            return {}
        if not os.path.isfile(default_config_file):
            return {}
        path = default_config_file
    if not os.path.isfile(path):
        raise ConfigError(f"Accelerate config file {path!r} does not exist (from --config_file).")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"Accelerate config file {path!r} cannot be read: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"Accelerate config file {path!r} must be a YAML mapping.")
    return data


def free_port() -> int:
    """A TCP port nobody listens on right now (for the rendezvous of a single-machine run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LaunchPlan:
    """What :func:`plan_launch` decided.

    Attributes:
        launcher: ``"inprocess"``, ``"torchrun"`` or ``"accelerate"``.
        num_processes: Total processes over all machines.
        num_machines: Machines taking part.
        command: The command to run (empty for ``inprocess``).
        env: Environment variables to set (in this process for ``inprocess``, for the children otherwise).
    """

    launcher: str
    num_processes: int
    num_machines: int
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0


def plan_launch(
    verb: str, launch_args: list[str], script_argv: list[str], *, cuda_devices: int | None = None
) -> LaunchPlan:
    """Decide how to run ``posttrain.scripts.<verb>`` with ``script_argv`` given the launch options.

    Args:
        verb: Script name (``sft``, ``grpo``, ...).
        launch_args: Options from :func:`split_launch_args`.
        script_argv: Arguments for the script itself (launch options removed).
        cuda_devices: Visible CUDA devices (default: asked from torch); 0 means a CPU-only machine.
    """
    ns = _parse_launch_args(launch_args)
    given = {dest for opt, (dest, _) in accelerate_options().items() if opt in launch_args}
    # like accelerate launch: --cpu ignores the default config file, an explicit --config_file never is
    config = _read_accelerate_config(ns.config_file, use_default=not ns.cpu)
    cuda = _cuda_device_count() if cuda_devices is None else cuda_devices
    use_cpu = bool(ns.cpu or config.get("use_cpu", False) or cuda == 0)

    num_processes = ns.num_processes if ns.num_processes is not None else config.get("num_processes")
    if num_processes is None:
        num_processes = cuda if (cuda > 1 and not use_cpu) else 1
    num_machines = ns.num_machines if ns.num_machines is not None else config.get("num_machines", 1)
    machine_rank = ns.machine_rank if ns.machine_rank is not None else config.get("machine_rank", 0)
    main_ip = ns.main_process_ip or config.get("main_process_ip")
    main_port = ns.main_process_port or config.get("main_process_port")
    try:
        num_processes, num_machines, machine_rank = int(num_processes), int(num_machines), int(machine_rank)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"num_processes, num_machines and machine_rank must be integers: {err}") from err
    if num_processes < 1 or num_machines < 1:
        raise ConfigError(f"--num_processes ({num_processes}) and --num_machines ({num_machines}) must be >= 1.")
    if num_machines > 1 and (main_ip is None or main_port is None):
        raise ConfigError(
            f"A run over {num_machines} machines needs --main_process_ip (address of machine 0) and "
            "--main_process_port on every machine, plus --machine_rank (0 .. num_machines-1)."
        )
    distributed_type = str(config.get("distributed_type", "NO")).upper()
    needs_accelerate = (
        distributed_type in _LAUNCHER_TYPES
        or bool(ns.use_deepspeed or ns.use_fsdp or ns.use_megatron_lm or ns.tpu)
        or ns.mpirun_hostfile is not None
        or bool(given - _INPROCESS_OK)
    )

    env: dict[str, str] = {}
    mixed_precision = ns.mixed_precision if "mixed_precision" in given else None
    if mixed_precision is not None:
        env["ACCELERATE_MIXED_PRECISION"] = str(mixed_precision).lower()
    if ns.debug:
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if ns.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(ns.num_cpu_threads_per_process)
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "true"

    if num_processes * num_machines == 1 and num_machines == 1 and not needs_accelerate:
        if ns.gpu_ids not in (None, "all"):
            env["CUDA_VISIBLE_DEVICES"] = str(ns.gpu_ids)
        if "dynamo_backend" in given:
            env["ACCELERATE_DYNAMO_BACKEND"] = str(ns.dynamo_backend).upper()
        return LaunchPlan("inprocess", 1, 1, env=env)

    env["POSTTRAIN_LAUNCHED"] = "1"
    module = f"posttrain.scripts.{verb}"
    if use_cpu and not needs_accelerate:
        if num_processes % num_machines:
            raise ConfigError(
                f"--num_processes ({num_processes}) is the total over all machines and must be a multiple of "
                f"--num_machines ({num_machines})."
            )
        port = main_port if main_port is not None else free_port()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(num_processes // num_machines),
            "--nnodes",
            str(num_machines),
            "--node_rank",
            str(machine_rank),
            "--master_addr",
            str(main_ip or "127.0.0.1"),
            "--master_port",
            str(port),
            "-m",
            module,
            *script_argv,
        ]
        # one BLAS thread per process unless asked otherwise: processes share the cores
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, num_processes // num_machines))))
        return LaunchPlan("torchrun", num_processes, num_machines, command=command, env=env)

    config_name, args = _pop_accelerate_config(launch_args)
    if config_name is not None:
        args = ["--config_file", str(ns.config_file), *args]
    if num_machines == 1 and main_port is None:
        args += ["--main_process_port", str(free_port())]
    if ns.num_processes is None and "num_processes" not in config:
        args += ["--num_processes", str(num_processes)]
    command = [sys.executable, "-m", "accelerate.commands.launch", *args, "-m", module, *script_argv]
    return LaunchPlan("accelerate", num_processes, num_machines, command=command, env=env)


def _pop_accelerate_config(args: list[str]) -> tuple[str | None, list[str]]:
    """Remove every ``--accelerate_config X`` from ``args``; return the last X (repeats: the last one wins)."""
    value, out, i = None, [], 0
    while i < len(args):
        if args[i] in ("--accelerate_config", "--accelerate-config") and i + 1 < len(args):
            value = args[i + 1]
            i += 2
            continue
        out.append(args[i])
        i += 1
    return value, out


def strip_launch_args(argv: list[str], claimed: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """``argv`` without the launch options given on the command line (YAML ones stay in the recipe).

    Args:
        argv: The command line of the verb.
        claimed: Option strings the training parser owns; they stay even where accelerate has an option of the same
            name (``--gradient_accumulation_steps`` belongs to the training config, as with TRL).
    """
    table = accelerate_options()
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        opt = token.partition("=")[0] if token.startswith("--") else token
        spec = None if opt in claimed else table.get(opt)
        if spec is None:
            out.append(token)
            i += 1
            continue
        takes_value = spec[1]
        if "=" in token:
            i += 1
        elif takes_value:
            i += 2
        else:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            i += 2 if (nxt is not None and nxt.lower() in ("true", "false")) else 1
    return out


def run_plan(plan: LaunchPlan) -> int:
    """Run a ``torchrun`` / ``accelerate`` plan as a child process; return its exit code."""
    import subprocess

    env = {**os.environ, **plan.env}
    # the children must import this posttrain even when it is not installed (e.g. run from a checkout)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH", "")] if p)
    try:
        return subprocess.run(plan.command, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130
