"""``TrlParser``: dataclass arguments from flags and a YAML ``--config`` file, as TRL's scripts parse them.

YAML values become parser defaults, so explicit flags override them. An optional top-level ``env:`` mapping is
exported to ``os.environ``. Keys that match no dataclass field are returned (when the caller allows it, e.g. to hand
them to ``accelerate launch``) or rejected with the list of valid names and the closest match.

Parsing happens in two stages so a launcher can validate a command line without building the configs:
:meth:`TrlParser.parse_namespace_and_config` checks every flag and YAML key and returns an ``argparse.Namespace`` plus
the strings no dataclass claimed; :meth:`TrlParser.namespace_to_dataclasses` then builds the dataclasses (running
their ``__post_init__`` validation). :meth:`TrlParser.parse_args_and_config` does both, like TRL's.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
import sys
import typing
from collections.abc import Iterable
from typing import Any, NoReturn

import yaml
from transformers import HfArgumentParser

import posttrain.legacy as legacy


class ConfigError(ValueError):
    """A recipe or command line that cannot be parsed: unreadable YAML, unknown keys, bad values."""


def _yaml_to_flags(key: str, value: Any) -> list[str]:
    """``key: value`` from a recipe as command-line strings (for keys handed on, e.g. to accelerate)."""
    if isinstance(value, bool):
        return [f"--{key}", str(value).lower()]
    if isinstance(value, (list, tuple)):
        return [f"--{key}", *[str(v) for v in value]]
    return [f"--{key}", str(value)]


def load_yaml_config(path: str) -> dict[str, Any]:
    """Read a recipe; errors say which file and why (missing, not YAML, not a mapping)."""
    if not os.path.exists(path):
        raise ConfigError(f"Config file {path!r} does not exist. Pass the path of a YAML recipe to --config.")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path!r} is not valid YAML: {err}") from err
    except OSError as err:
        raise ConfigError(f"Config file {path!r} cannot be read: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path!r} must contain a mapping of option: value, got {type(data).__name__}.")
    return data


def _pop_config_path(args: list[str]) -> str | None:
    """Remove ``--config PATH`` / ``--config=PATH`` from ``args`` (in place) and return PATH."""
    for idx, arg in enumerate(args):
        if arg == "--config":
            if idx + 1 >= len(args) or args[idx + 1].startswith("--"):
                raise ConfigError("--config needs the path of a YAML recipe, e.g. --config recipe.yaml.")
            path = args[idx + 1]
            del args[idx : idx + 2]
            return path
        if arg.startswith("--config="):
            del args[idx]
            return arg.split("=", 1)[1]
    return None


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Attributes):\s*$")
_ENTRY = re.compile(r"^(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def docstring_field_help(cls: type) -> dict[str, str]:
    """Field descriptions from the ``Args:`` / ``Parameters:`` sections of ``cls``'s docstrings (its MRO too).

    Used as ``--help`` text for fields without ``metadata["help"]``; both ``name: text`` and TRL's
    ``name (`type`, *optional*):`` + indented text are understood.
    """
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        doc = klass.__dict__.get("__doc__")
        if not doc:
            continue
        lines = inspect.cleandoc(doc).splitlines()
        in_section, entry_indent, current = False, None, None
        for line in lines:
            stripped = line.strip()
            indent = len(line) - len(line.lstrip())
            if _SECTION.match(line):
                in_section, entry_indent, current = True, None, None
                continue
            if not in_section:
                continue
            if stripped and indent == 0:
                in_section, current = False, None
                continue
            if not stripped:
                continue
            if entry_indent is None:
                entry_indent = indent
            match = _ENTRY.match(stripped) if indent == entry_indent else None
            if match:
                current = match.group(1)
                if current not in found:
                    found[current] = match.group(3).strip()
                else:
                    current = None  # a subclass already documented it
            elif current is not None and indent > entry_indent:
                found[current] = (found[current] + " " + stripped).strip()
    return found


class TrlParser(HfArgumentParser):
    """``HfArgumentParser`` with TRL's ``--config`` YAML handling and complete ``--help`` (defaults shown).

    Args:
        dataclass_types: Dataclasses to fill (e.g. ``(ScriptArguments, SFTConfig, ModelConfig)``).
        **kwargs: Passed to ``argparse.ArgumentParser`` (``prog``, ``description``, ``epilog``...).

    Bad values and unknown options raise :class:`ConfigError` (a one-paragraph message) instead of printing the full
    usage line and exiting. A field declared by several dataclasses (e.g. a script dataclass repeating a trainer
    config's field) is one option, registered by the first dataclass, whose value fills all of them. Keys of older
    TRL / transformers releases (``torch_dtype``, ``max_seq_length``, ``warmup_ratio`` ...) are mapped by
    :mod:`posttrain.legacy` with a ``FutureWarning``.
    """

    def __init__(self, dataclass_types: Iterable[type] | type | None = None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif not isinstance(dataclass_types, (list, tuple)):
            dataclass_types = [dataclass_types]
        for dc in dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(dc)}:
                raise ValueError(
                    f"Dataclass {dc.__name__} has a field named 'config', which clashes with --config (the YAML "
                    "recipe). Rename the field."
                )
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        if kwargs.get("prog"):
            # the default usage line would list all ~250 options
            kwargs.setdefault("usage", f"{kwargs['prog']} [--config RECIPE.yaml] [--OPTION VALUE ...]")
        # abbreviations would let an accelerate flag (e.g. --tpu) silently match a training option by prefix
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(dataclass_types, **kwargs)
        documented: dict[str, str] = {}
        for dc in dataclass_types:
            for name, text in docstring_field_help(dc).items():
                documented.setdefault(name, text)
        for action in self._actions:
            if action.dest == "help":
                continue
            if not (action.help or "").strip():
                # ArgumentDefaultsHelpFormatter only shows defaults for actions with some help text
                action.help = documented.get(action.dest) or " "
            # argparse %-formats help text; a literal % (e.g. "10%") would crash --help
            action.help = re.sub(r"(?<!%)%(?![(%])", "%%", action.help)
        self.add_argument("--config", type=str, default=None, help="Path to a YAML recipe; flags override it.")
        self.yaml_extra_keys: list[str] = []

    def _add_dataclass_arguments(self, dtype: type) -> None:
        """One ``--help`` section per dataclass, titled with its name and the first line of its docstring."""
        title = getattr(dtype, "_argument_group_name", None) or f"{dtype.__name__} options"
        summary = inspect.cleandoc(dtype.__doc__ or "").split("\n\n")[0].replace("\n", " ") or None
        group = self.add_argument_group(title, description=summary)
        try:
            type_hints = typing.get_type_hints(dtype)
        except NameError as err:
            raise RuntimeError(f"Cannot resolve the field types of {dtype.__name__}: {err}") from err
        for fld in dataclasses.fields(dtype):
            if not fld.init:
                continue
            fld.type = type_hints[fld.name]
            self._parse_dataclass_field(group, fld)

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
        if f"--{field.name}" in parser._option_string_actions:
            return  # shared with an earlier dataclass: one option feeds both
        HfArgumentParser._parse_dataclass_field(parser, field)

    # ------------------------------------------------------------------------------------------------------------
    def error(self, message: str) -> NoReturn:
        """argparse's hook for bad values: raise instead of printing the (very long) usage and exiting."""
        raise ConfigError(f"{message}. Run `{self.prog} --help` for every option with its default.")

    def field_names(self) -> list[str]:
        """Every option name the dataclasses define, sorted."""
        return sorted({f.name for dc in self.dataclass_types for f in dataclasses.fields(dc) if f.init})

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        """Make ``kwargs`` (e.g. a YAML recipe) the parser's defaults; return unclaimed keys as ``--key value``.

        Options given defaults stop being required. Values are converted with the option's type and checked
        against its choices, so a typo in a recipe fails here, naming the key.
        """
        claimed: set[str] = set()
        for action in self._actions:
            if action.dest not in kwargs or action.dest == "help":
                continue
            value = kwargs[action.dest]
            if action.type is not None and value is not None and not isinstance(value, (list, dict, bool)):
                try:
                    value = action.type(value)
                except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
                    raise ConfigError(
                        f"Invalid value {value!r} for {action.dest!r} in the config file: {err}"
                    ) from err
            if (
                action.choices is not None
                and value is not None
                and not isinstance(value, (list, dict))
                and value not in action.choices
                and str(value) not in {str(c) for c in action.choices}
            ):
                raise ConfigError(
                    f"Invalid value {value!r} for {action.dest!r} in the config file; choose one of: "
                    f"{', '.join(str(c) for c in action.choices)}."
                )
            action.default = value
            action.required = False
            claimed.add(action.dest)
        extra: list[str] = []
        for key, value in kwargs.items():
            if key not in claimed:
                extra += _yaml_to_flags(key, value)
        return extra

    def parse_namespace_and_config(self, args: Iterable[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
        """Check ``args`` (default ``sys.argv[1:]``) and the YAML named by ``--config``; build no dataclass.

        Returns the namespace of every option and the strings that matched no option: YAML keys first (as
        ``--key value``), then command-line strings, so a flag repeated on the command line wins over the recipe.
        """
        args = list(sys.argv[1:] if args is None else args)
        extra: list[str] = []
        self.yaml_extra_keys = []
        self._legacy_held: dict[str, Any] = {}
        config_path = _pop_config_path(args)
        if config_path is not None:
            config = load_yaml_config(config_path)
            env = config.pop("env", None)
            if env is not None:
                if not isinstance(env, dict):
                    raise ConfigError(f"`env` in {config_path!r} must be a mapping of NAME: value.")
                os.environ.update({str(k): str(v) for k, v in env.items()})
            config, held = legacy.translate_recipe(self, config)  # older TRL / transformers keys
            self._legacy_held.update(held)
            extra = self.set_defaults_with_config(**config)
            self.yaml_extra_keys = [s[2:] for s in extra if s.startswith("--")]
        args, held = legacy.translate_argv(self, args)
        self._legacy_held.update(held)
        namespace, remaining = self.parse_known_args(args)
        if hasattr(namespace, "config"):
            delattr(namespace, "config")
        return namespace, extra + list(remaining)

    def namespace_to_dataclasses(self, namespace: argparse.Namespace) -> tuple:
        """One instance per dataclass type, in order; ``__post_init__`` errors become :class:`ConfigError`."""
        values = vars(namespace)
        outputs = []
        for dtype in self.dataclass_types:
            keys = {f.name for f in dataclasses.fields(dtype) if f.init}
            inputs = {k: v for k, v in values.items() if k in keys}
            try:
                inputs.update(legacy.held_kwargs(self, dtype, getattr(self, "_legacy_held", {})))
                outputs.append(dtype(**inputs))
            except (TypeError, ValueError) as err:
                if isinstance(err, ConfigError):
                    raise
                raise ConfigError(f"Invalid {dtype.__name__} options: {err}") from err
        legacy.link_model_configs(outputs)
        return tuple(outputs)

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
    ) -> tuple:
        """Parse ``args`` (default ``sys.argv[1:]``) with the YAML named by ``--config`` as defaults.

        Returns the dataclass instances, plus the list of unrecognised strings when ``return_remaining_strings``
        (as in TRL, they are then returned rather than rejected). Otherwise unrecognised strings raise
        :class:`ConfigError` when ``fail_with_unknown_args`` (the default).
        """
        namespace, remaining = self.parse_namespace_and_config(args)
        if remaining and fail_with_unknown_args and not return_remaining_strings:
            raise ConfigError(self.unknown_args_message(remaining))
        outputs = self.namespace_to_dataclasses(namespace)
        if return_remaining_strings:
            return (*outputs, remaining)
        return outputs

    def unknown_args_message(self, remaining: list[str]) -> str:
        """A one-paragraph error naming each unknown option, its closest valid name, and all valid names."""
        names = [s[2:].split("=")[0] for s in remaining if s.startswith("--")]
        valid = self.field_names()
        hints = []
        for name in dict.fromkeys(names or remaining):
            where = " (from the config file)" if name in self.yaml_extra_keys else ""
            close = difflib.get_close_matches(name.replace("-", "_"), valid, n=1)
            hints.append(f"{name!r}{where}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return (
            f"Unknown argument(s): {', '.join(hints)}. Run `{self.prog} --help` for the full list; valid options are: "
            f"{', '.join(valid)}."
        )
