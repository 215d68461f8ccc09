"""``TrlParser``: dataclass arguments from flags and a YAML ``--config`` file, as TRL's scripts parse them.

YAML values become parser defaults, so explicit flags override them. An optional top-level ``env:`` mapping is
exported to ``os.environ``. Keys that match no dataclass field are returned (when the caller allows it, e.g. to hand
them to ``accelerate launch``) or rejected with the list of valid names and the closest match.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
from collections.abc import Iterable
from typing import Any

import yaml
from transformers import HfArgumentParser


class ConfigError(ValueError):
    """A recipe or command line that cannot be parsed: unreadable YAML, unknown keys, bad values."""


def _yaml_to_flags(key: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [f"--{key}", str(value).lower()]
    if isinstance(value, (list, tuple)):
        return [f"--{key}", *[str(v) for v in value]]
    return [f"--{key}", str(value)]


def load_yaml_config(path: str) -> dict[str, Any]:
    """Read a recipe; errors say which file and why (missing, not YAML, not a mapping)."""
    if not os.path.exists(path):
        raise ConfigError(f"Config file {path!r} does not exist.")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path!r} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path!r} must contain a mapping of option: value, got {type(data).__name__}.")
    return data


class TrlParser(HfArgumentParser):
    """``HfArgumentParser`` with TRL's ``--config`` YAML handling and complete ``--help`` (defaults shown).

    Args:
        dataclass_types: Dataclasses to fill (e.g. ``(ScriptArguments, SFTConfig, ModelConfig)``).
    """

    def __init__(self, dataclass_types: Iterable[type] | type, **kwargs):
        if not isinstance(dataclass_types, (list, tuple)):
            dataclass_types = [dataclass_types]
        for dc in dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(dc)}:
                raise ValueError(
                    f"Dataclass {dc.__name__} has a field named 'config', which clashes with --config (the YAML "
                    "recipe). Rename the field."
                )
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(dataclass_types, **kwargs)
        for action in self._actions:
            if action.help is None and action.dest != "help":
                action.help = " "  # ArgumentDefaultsHelpFormatter only shows defaults for actions with help
        self.add_argument("--config", type=str, default=None, help="Path to a YAML recipe; flags override it.")

    # ------------------------------------------------------------------------------------------------------------
    def field_names(self) -> list[str]:
        return sorted({f.name for dc in self.dataclass_types for f in dataclasses.fields(dc)})

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
    ) -> tuple:
        """Parse ``args`` (default ``sys.argv[1:]``) with the YAML named by ``--config`` as defaults.

        Returns the dataclass instances, plus the list of unrecognised strings when ``return_remaining_strings``.
        """
        args = list(sys.argv[1:] if args is None else args)
        extra: list[str] = []
        if "--config" in args:
            idx = args.index("--config")
            if idx + 1 >= len(args):
                raise ConfigError("--config needs a path to a YAML file.")
            config_path = args[idx + 1]
            del args[idx : idx + 2]
            config = load_yaml_config(config_path)
            env = config.pop("env", None)
            if env is not None:
                if not isinstance(env, dict):
                    raise ConfigError(f"`env` in {config_path!r} must be a mapping of NAME: value.")
                os.environ.update({str(k): str(v) for k, v in env.items()})
            known = set(self.field_names())
            defaults = {}
            for key, value in config.items():
                if key in known:
                    defaults[key] = value
                else:
                    extra += _yaml_to_flags(key, value)
            self._set_yaml_defaults(defaults)
        try:
            output = self.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        *namespaces, remaining = output
        namespaces = [ns for ns in namespaces if not isinstance(ns, argparse.Namespace) or vars(ns)]
        # the --config argument itself lands in an extra Namespace; drop it
        namespaces = [ns for ns in namespaces if not (isinstance(ns, argparse.Namespace) and "config" in vars(ns))]
        remaining = list(remaining) + extra
        if remaining and fail_with_unknown_args:
            raise ConfigError(self.unknown_args_message(remaining))
        if return_remaining_strings:
            return (*namespaces, remaining)
        return tuple(namespaces)

    def _set_yaml_defaults(self, defaults: dict[str, Any]) -> None:
        for action in self._actions:
            if action.dest in defaults:
                value = defaults[action.dest]
                if action.type is not None and value is not None and not isinstance(value, (list, dict)):
                    try:
                        value = action.type(value) if not isinstance(value, bool) else value
                    except (TypeError, ValueError) as err:
                        raise ConfigError(f"Invalid value {value!r} for {action.dest!r} in the config file.") from err
                action.default = value
                action.required = False

    def unknown_args_message(self, remaining: list[str]) -> str:
        names = [s[2:].split("=")[0].replace("-", "_") for s in remaining if s.startswith("--")]
        valid = self.field_names()
        hints = []
        for name in names or remaining:
            close = difflib.get_close_matches(name, valid, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return (
            f"Unknown argument(s): {', '.join(hints)}. Run with --help for the full list; valid options are: "
            f"{', '.join(valid)}."
        )
