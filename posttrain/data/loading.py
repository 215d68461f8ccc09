"""Dataset loading for scripts and the CLI: local files/folders and hub names, and TRL's dataset mixtures.

``load_dataset_from_spec`` loads json/jsonl/csv/parquet/arrow/txt files, folders of such files and
``save_to_disk`` folders locally, and anything else through ``datasets.load_dataset`` (hub names, for users who
are online). A name that cannot be resolved (offline mode, no connection, unknown name) raises
``DatasetNotFoundError`` with one paragraph saying what was tried and how to fix it, not a long traceback.

``DatasetConfig`` / ``DatasetMixtureConfig`` / ``get_dataset`` are TRL's ``trl.scripts`` mixture API (YAML
``datasets:`` lists). Per-source ``fraction`` values (all-or-none) are normalised to weights w_i = f_i / Σf; the
mixture size is the largest N with w_i·N ≤ len_i for every source (no source is oversampled), and source i
contributes round(w_i·N) rows: a seeded random subset (``Dataset.shuffle(seed=seed)`` then the first rows; per
source ``shuffle: true`` and ``seed: 42`` by default, so reruns pick the same rows), or its first rows with
``shuffle: false`` (TRL 1.16 always takes the first rows). A source that keeps all its rows keeps their order. A
``fraction`` of 0 drops the source, as in TRL.

``get_dataset`` raises where TRL's raises, with TRL's exception type and phrase first, then how to fix it: an empty
mixture ("No datasets were loaded from the mixture configuration"), ``fraction`` on some entries only ("`fraction`
must be set for either all datasets in the mixture or none of them."), and ``fraction`` with ``streaming: true``
("Using a dataset `fraction` is not supported with streaming datasets.": streamed sources have no length to take a
share of).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_EXTENSION_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}


class DatasetNotFoundError(FileNotFoundError):
    """A dataset name or path could not be resolved (not a local file/folder, and not loadable from the hub)."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def is_offline() -> bool:
    """True when Hugging Face hub access is disabled (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``)."""
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("HF_DATASETS_OFFLINE")):
        return True
    try:
        import datasets

        return bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False


def _is_saved_to_disk(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").exists()
        or ((path / "state.json").exists() and (path / "dataset_info.json").exists())
    )


def _not_found(name: str, reason: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"Could not load dataset {name!r}: {reason} It is not a local file or folder (checked relative to "
        f"{os.getcwd()}). Pass a local path (json, jsonl, csv, parquet, arrow or txt file, a folder of them, or a "
        "folder written by Dataset.save_to_disk), or, to use a Hugging Face Hub dataset, check the name and go online "
        "(unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."
    )


def _select_split(dataset: Any, split: str | None, name: str) -> Any:
    import datasets

    if split is None or not isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return dataset
    if split not in dataset:
        raise ValueError(f"Dataset {name!r} has no split {split!r}; available splits: {sorted(dataset)}.")
    return dataset[split]


def load_dataset_from_spec(
    name_or_path: str,
    config: str | None = None,
    split: str | None = None,
    data_files: str | list[str] | dict[str, Any] | None = None,
    data_dir: str | None = None,
    streaming: bool = False,
) -> Any:
    """Load a dataset from a local path or a hub name.

    Args:
        name_or_path: A file (``.json``, ``.jsonl``, ``.csv``, ``.tsv``, ``.parquet``, ``.arrow``, ``.txt``), a folder
            of such files, a ``save_to_disk`` folder, or a hub dataset name.
        config: Dataset configuration name (hub datasets).
        split: Split to return (``None`` returns every split as a ``DatasetDict``). Single files have one split,
            ``"train"``; split slicing like ``"train[:10%]"`` works where ``datasets`` supports it.
        data_files: Files to load inside a folder or hub repository.
        data_dir: Sub-folder to load from.
        streaming: Return an ``IterableDataset`` (``to_iterable_dataset`` for ``save_to_disk`` folders).

    Raises:
        DatasetNotFoundError: The name is not a local path and cannot be loaded from the hub (offline, no
            connection, or unknown name).
    """
    import datasets

    path = Path(os.path.expanduser(name_or_path))
    if _is_saved_to_disk(path):
        dataset = _select_split(datasets.load_from_disk(str(path)), split, name_or_path)
        if streaming:
            if isinstance(dataset, datasets.DatasetDict):
                dataset = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dataset.items()})
            else:
                dataset = dataset.to_iterable_dataset()
        return dataset
    if path.is_file():
        builder = _EXTENSION_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"Cannot load {name_or_path!r}: unknown file type {path.suffix!r}. Supported: "
                f"{', '.join(sorted(_EXTENSION_BUILDERS))}, or a save_to_disk folder."
            )
        kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        return datasets.load_dataset(
            builder, data_files={"train": str(path)}, split=split, streaming=streaming, **kwargs
        )
    if path.is_dir():
        return datasets.load_dataset(
            str(path), name=config, data_dir=data_dir, data_files=data_files, split=split, streaming=streaming
        )
    if path.is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1:
        raise _not_found(name_or_path, "no such file or folder.")
    # Offline, datasets still serves a copy from its local cache: let it try (TRL's get_dataset does the same)
    failure = None
    try:
        return datasets.load_dataset(
            name_or_path, name=config, data_dir=data_dir, data_files=data_files, split=split, streaming=streaming
        )
    except _hub_errors() as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        failure = f"{type(err).__name__}: {reason}"
    if is_offline():
        raise _not_found(
            name_or_path,
            f"Hugging Face Hub access is disabled (offline mode) and the dataset is not in the local datasets cache "
            f"({failure}).",
        )
    raise _not_found(name_or_path, f"the hub did not return it ({failure}).")


def _hub_errors() -> tuple[type[BaseException], ...]:
    """Exception types meaning "the hub could not give us this dataset" (unknown name, offline, no connection)."""
    import datasets

    errors: list[type[BaseException]] = [ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError]
    try:
        from huggingface_hub import errors as hub_errors

        errors += [hub_errors.HfHubHTTPError, hub_errors.OfflineModeIsEnabled]
    except (ImportError, AttributeError):  # pragma: no cover - older huggingface_hub
        pass
    try:
        import httpx

        errors.append(httpx.TransportError)
    except ImportError:  # pragma: no cover - huggingface_hub < 1.0 uses requests (OSError subclasses)
        pass
    return tuple(errors)


@dataclass
class DatasetConfig:
    """One dataset of a mixture (TRL's ``trl.scripts.utils.DatasetConfig``).

    Args:
        path: Local path or hub name (``load_dataset_from_spec``).
        name: Dataset configuration name.
        data_dir: Sub-folder to load.
        data_files: Files to load.
        split: Split to use.
        columns: Keep only these columns (mixtures need the same columns in every source).
        fraction: Share of this source in the mixture (all sources or none must set it; not with streaming; see
            module docstring).
        shuffle: With ``fraction``, draw the source's rows as a seeded random subset (``True``, the default) rather
            than taking its first rows (``False``, the behaviour before seeded subsets).
        seed: Seed of that random subset (42 by default, like TRL's default seeds); the same seed picks the same rows.
    """

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None
    shuffle: bool = True
    seed: int = 42


@dataclass
class DatasetMixtureConfig:
    """A mixture of datasets (TRL's ``DatasetMixtureConfig``); YAML ``datasets:`` entries may be dicts.

    Args:
        datasets: The sources, as ``DatasetConfig`` objects or dicts of its fields.
        streaming: Load every source as an ``IterableDataset`` (their rows are concatenated; no ``fraction``).
        test_split_size: If set, split the mixture into ``train``/``test`` with this test size (fraction or count),
            seeded with the first source's ``seed`` so every run holds out the same rows.
    """

    datasets: list[DatasetConfig] = field(default_factory=list)
    streaming: bool = False
    test_split_size: float | None = None

    def __post_init__(self):
        converted = []
        for i, ds in enumerate(self.datasets):
            if isinstance(ds, DatasetConfig):
                converted.append(ds)
            elif isinstance(ds, dict):
                unknown = set(ds) - set(DatasetConfig.__dataclass_fields__)
                if unknown:
                    raise ValueError(
                        f"datasets[{i}] has unknown keys {sorted(unknown)}; valid keys: "
                        f"{', '.join(DatasetConfig.__dataclass_fields__)}."
                    )
                converted.append(DatasetConfig(**ds))
            else:
                raise TypeError(f"datasets[{i}] must be a DatasetConfig or a dict, got {type(ds).__name__}.")
        self.datasets = converted
        for i, ds in enumerate(self.datasets):
            if not isinstance(ds.shuffle, bool):
                raise ValueError(f"datasets[{i}].shuffle must be true or false, got {ds.shuffle!r} ({ds.path}).")
            if isinstance(ds.seed, bool) or not isinstance(ds.seed, int):
                raise ValueError(f"datasets[{i}].seed must be an integer, got {ds.seed!r} ({ds.path}).")
        # fractions are checked by get_dataset, where TRL checks them (a config may be built, then edited)


def _mixture_sizes(lengths: list[int], fractions: list[float]) -> list[int]:
    """Rows taken per source: weights w_i = f_i/Σf, N = min over w_i > 0 of len_i/w_i, n_i = min(round(w_i N), len_i)."""
    total = sum(fractions)
    weights = [f / total for f in fractions]
    n = min(length / w for length, w in zip(lengths, weights) if w > 0)
    return [min(round(w * n), length) for w, length in zip(weights, lengths)]


def _fraction_subset(ds: Any, n: int, cfg: DatasetConfig) -> Any:
    """The ``n`` rows a source contributes: a seeded random subset, or its first rows with ``shuffle=False``."""
    if cfg.shuffle and n < len(ds):
        ds = ds.shuffle(seed=cfg.seed)
    return ds.select(range(n))


def _check_fractions(mixture_config: DatasetMixtureConfig) -> None:
    """TRL's fraction errors (same type, TRL's phrase first), then which entries and how to fix them."""
    configs = mixture_config.datasets
    fractions = [cfg.fraction for cfg in configs]
    if all(f is None for f in fractions):
        return
    if any(f is None for f in fractions):
        missing = [cfg.path for cfg in configs if cfg.fraction is None]
        raise ValueError(
            "`fraction` must be set for either all datasets in the mixture or none of them. It is missing for "
            f"{missing}: give every entry a fraction, or remove it from all of them to concatenate the datasets."
        )
    if mixture_config.streaming:
        raise ValueError(
            "Using a dataset `fraction` is not supported with streaming datasets. Set `streaming: false` to take "
            "each dataset's share, or remove `fraction` from every entry to concatenate the streamed datasets."
        )
    bad = [(cfg.path, f) for cfg, f in zip(configs, fractions) if isinstance(f, bool) or not f >= 0]
    if bad or sum(fractions) <= 0:
        raise ValueError(
            f"Dataset fractions must be numbers >= 0 with a positive sum (0 drops a dataset), got "
            f"{[(cfg.path, f) for cfg, f in zip(configs, fractions)]}."
        )


def get_dataset(mixture_config: DatasetMixtureConfig) -> Any:
    """Load and concatenate the mixture's datasets; returns a ``DatasetDict`` with ``train`` (and ``test`` when
    ``test_split_size`` is set)."""
    import datasets

    if not mixture_config.datasets:
        raise ValueError(
            "No datasets were loaded from the mixture configuration: its `datasets` list is empty. Add at least one "
            "entry (`- path: ...`, optionally with name, split, columns, fraction)."
        )
    _check_fractions(mixture_config)
    loaded = []
    for cfg in mixture_config.datasets:
        logger.info("Loading dataset for mixture: %s (config %s)", cfg.path, cfg.name)
        ds = load_dataset_from_spec(
            cfg.path,
            config=cfg.name,
            split=cfg.split,
            data_files=cfg.data_files,
            data_dir=cfg.data_dir,
            streaming=mixture_config.streaming,
        )
        if cfg.columns is not None:
            missing = [c for c in cfg.columns if c not in (ds.column_names or [])]
            if missing and ds.column_names is not None:
                raise ValueError(f"Dataset {cfg.path!r} has no columns {missing}; it has {ds.column_names}.")
            ds = ds.select_columns(cfg.columns)
        loaded.append(ds)
    with_fractions = mixture_config.datasets[0].fraction is not None
    if with_fractions:
        sizes = _mixture_sizes([len(ds) for ds in loaded], [cfg.fraction for cfg in mixture_config.datasets])
        loaded = [_fraction_subset(ds, n, cfg) for ds, n, cfg in zip(loaded, sizes, mixture_config.datasets)]
    names = [ds.column_names for ds in loaded]
    if any(n is not None and set(n) != set(names[0]) for n in names):
        raise ValueError(
            "The mixture's datasets have different columns: "
            + "; ".join(f"{cfg.path}: {n}" for cfg, n in zip(mixture_config.datasets, names))
            + ". Use `columns` on each entry to keep the same ones."
        )
    combined = datasets.concatenate_datasets(loaded) if len(loaded) > 1 else loaded[0]
    if mixture_config.test_split_size is not None:
        if mixture_config.streaming:
            raise ValueError("test_split_size needs a map-style dataset; it is not supported with streaming=True.")
        # Seeded (the first source's seed) so that a rerun or a resumed run evaluates on the same rows.
        seed = mixture_config.datasets[0].seed if mixture_config.datasets else 42
        return combined.train_test_split(test_size=mixture_config.test_split_size, seed=seed)
    if mixture_config.streaming:
        return datasets.IterableDatasetDict({"train": combined})
    return datasets.DatasetDict({"train": combined})
