"""Dataset loading and mixtures (posttrain.data.loading); everything local and offline."""

import datasets
import pytest
from datasets import Dataset, DatasetDict

from posttrain.data.loading import (
    DatasetConfig,
    DatasetMixtureConfig,
    DatasetNotFoundError,
    get_dataset,
    load_dataset_from_spec,
)

ROWS = {"prompt": ["a", "b", "c", "d"], "completion": ["w", "x", "y", "z"]}


@pytest.fixture(autouse=True)
def _local_cache(tmp_path, monkeypatch):
    # keep datasets' cache inside the test's tmp dir and make sure nothing reaches the network
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def files(tmp_path):
    ds = Dataset.from_dict(ROWS)
    ds.to_json(tmp_path / "data.jsonl")
    ds.to_json(tmp_path / "data.json", lines=False)
    ds.to_csv(tmp_path / "data.csv", index=False)
    ds.to_parquet(tmp_path / "data.parquet")
    ds.save_to_disk(tmp_path / "saved")
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(tmp_path / "saved_dict")
    (tmp_path / "data.txt").write_text("line one\nline two\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    ds.select([0, 1]).to_json(folder / "part1.jsonl")
    ds.select([2, 3]).to_json(folder / "part2.jsonl")
    return tmp_path


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.csv", "data.parquet"])
def test_load_local_files(files, name):
    dd = load_dataset_from_spec(str(files / name))
    assert isinstance(dd, DatasetDict) and list(dd) == ["train"]
    ds = load_dataset_from_spec(str(files / name), split="train")
    assert ds.to_dict() == ROWS


def test_load_arrow_text_folder_and_saved(files):
    arrow = next((files / "saved").glob("*.arrow"))
    assert load_dataset_from_spec(str(arrow), split="train").to_dict() == ROWS
    assert load_dataset_from_spec(str(files / "data.txt"), split="train")["text"] == ["line one", "line two"]
    assert sorted(load_dataset_from_spec(str(files / "folder"), split="train")["prompt"]) == ROWS["prompt"]
    assert load_dataset_from_spec(str(files / "saved")).to_dict() == ROWS
    saved = load_dataset_from_spec(str(files / "saved_dict"))
    assert isinstance(saved, DatasetDict) and len(saved["test"]) == 1
    assert len(load_dataset_from_spec(str(files / "saved_dict"), split="test")) == 1
    with pytest.raises(ValueError, match=r"no split 'dev'; available splits: \['test', 'train'\]"):
        load_dataset_from_spec(str(files / "saved_dict"), split="dev")


def test_load_streaming(files):
    it = load_dataset_from_spec(str(files / "data.jsonl"), split="train", streaming=True)
    assert isinstance(it, datasets.IterableDataset) and [r["prompt"] for r in it] == ROWS["prompt"]
    saved = load_dataset_from_spec(str(files / "saved"), streaming=True)
    assert isinstance(saved, datasets.IterableDataset) and len(list(saved)) == 4


def test_unknown_file_type(files):
    (files / "data.xyz").write_text("?")
    with pytest.raises(ValueError, match=r"unknown file type '.xyz'"):
        load_dataset_from_spec(str(files / "data.xyz"))


def test_unresolvable_names_give_one_paragraph():
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset_from_spec("trl-lib/Capybara")
    err = info.value
    assert "'trl-lib/Capybara'" in str(err) and "offline" in str(err) and "\n" not in str(err)
    assert "not in the local datasets cache" in str(err)
    assert err.__cause__ is None and err.__suppress_context__ is False and err.__context__ is None
    with pytest.raises(DatasetNotFoundError, match="no such file or folder"):
        load_dataset_from_spec("./missing/train.jsonl")


def test_offline_hub_names_are_served_from_the_cache(monkeypatch):
    """HF_HUB_OFFLINE does not refuse a hub name: datasets serves cached copies offline (issue 18, item 8)."""
    cached = Dataset.from_dict(ROWS)
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append(path)
        return cached

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_dataset_from_spec("trl-lib/Capybara", split="train") is cached
    assert calls == ["trl-lib/Capybara"]


def test_hub_failures_are_converted(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)\nlong details")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(DatasetNotFoundError, match=r"ConnectionError: Couldn't reach 'org/name' on the Hub") as info:
        load_dataset_from_spec("org/name", config="cfg", split="train")
    assert info.value.__cause__ is None and "long details" not in str(info.value)
    assert calls == [
        ("org/name", {"name": "cfg", "data_dir": None, "data_files": None, "split": "train", "streaming": False})
    ]


def test_mixture_config_validation():
    mix = DatasetMixtureConfig(datasets=[{"path": "a"}, DatasetConfig(path="b", split="test")])
    assert [d.path for d in mix.datasets] == ["a", "b"] and mix.datasets[0].split == "train"
    with pytest.raises(ValueError, match=r"datasets\[0\] has unknown keys \['paht'\]"):
        DatasetMixtureConfig(datasets=[{"paht": "a"}])
    # as in TRL, fractions are checked by get_dataset, not when the config is built
    assert DatasetMixtureConfig(datasets=[{"path": "a", "fraction": 0.5}, {"path": "b"}]).datasets[1].fraction is None
    streamed = DatasetMixtureConfig(datasets=[{"path": "a", "fraction": 1.0}], streaming=True)
    assert streamed.datasets[0].shuffle is True and streamed.datasets[0].seed == 42
    with pytest.raises(ValueError, match=r"datasets\[1\]\.shuffle must be true or false, got 'no' \(b\)"):
        DatasetMixtureConfig(datasets=[{"path": "a"}, {"path": "b", "shuffle": "no"}])
    with pytest.raises(ValueError, match=r"datasets\[0\]\.seed must be an integer, got '7' \(a\)"):
        DatasetMixtureConfig(datasets=[{"path": "a", "seed": "7"}])
    with pytest.raises(ValueError, match=r"valid keys: .*fraction, shuffle, seed"):
        DatasetMixtureConfig(datasets=[{"path": "a", "sed": 1}])
    with pytest.raises(TypeError, match="DatasetConfig or a dict"):
        DatasetMixtureConfig(datasets=["a"])


def test_get_dataset_mixture(files):
    big = Dataset.from_dict({"prompt": [f"p{i}" for i in range(10)], "completion": ["c"] * 10, "extra": [0] * 10})
    big.to_json(files / "big.jsonl")
    mix = DatasetMixtureConfig(
        datasets=[
            {"path": str(files / "data.jsonl")},
            {"path": str(files / "big.jsonl"), "columns": ["prompt", "completion"]},
        ]
    )
    out = get_dataset(mix)
    assert (
        isinstance(out, DatasetDict)
        and len(out["train"]) == 14
        and out["train"].column_names == ["prompt", "completion"]
    )
    split = get_dataset(DatasetMixtureConfig(datasets=mix.datasets, test_split_size=0.25))
    assert sorted(split) == ["test", "train"] and len(split["train"]) + len(split["test"]) == 14
    again = get_dataset(DatasetMixtureConfig(datasets=mix.datasets, test_split_size=0.25))
    assert again["test"].to_list() == split["test"].to_list()  # seeded: the same held-out rows every run
    streamed = get_dataset(DatasetMixtureConfig(datasets=mix.datasets, streaming=True))
    assert isinstance(streamed, datasets.IterableDatasetDict) and len(list(streamed["train"])) == 14


def _mix(files, *sources, streaming=False):
    """get_dataset's train split for (file name, fraction, extra DatasetConfig keys) sources."""
    entries = [{"path": str(files / name), "fraction": fraction, **extra} for name, fraction, extra in sources]
    return get_dataset(DatasetMixtureConfig(datasets=entries, streaming=streaming))["train"]


@pytest.fixture
def big(files):
    Dataset.from_dict({"prompt": [f"p{i}" for i in range(10)], "completion": ["c"] * 10}).to_json(files / "big.jsonl")
    return files


def test_get_dataset_fractions_never_oversample(big):
    first_rows = {"shuffle": False}
    # weights 1/2, 1/2: the 4-row source limits the mixture to 8 rows, 4 from each
    even = _mix(big, ("data.jsonl", 1, first_rows), ("big.jsonl", 1, first_rows))
    assert even["prompt"] == ROWS["prompt"] + ["p0", "p1", "p2", "p3"]
    # weights 0.2, 0.8: N = min(4 / 0.2, 10 / 0.8) = 12.5 -> round(2.5) = 2 and 10 rows
    skewed = _mix(big, ("data.jsonl", 0.2, first_rows), ("big.jsonl", 0.8, first_rows))
    assert len(skewed) == 12
    assert skewed["prompt"][:2] == ["a", "b"] and skewed["prompt"][2:] == [f"p{i}" for i in range(10)]


def test_get_dataset_fractions_draw_seeded_random_subsets(big):
    # the default: each source's rows are a random subset drawn with seed 42, the same on every run
    even = _mix(big, ("data.jsonl", 1, {}), ("big.jsonl", 1, {}))
    assert even["prompt"][:4] == ROWS["prompt"]  # the 4-row source keeps all its rows, in file order
    drawn = even["prompt"][4:]
    assert len(drawn) == len(set(drawn)) == 4 and set(drawn) <= {f"p{i}" for i in range(10)}
    assert drawn != ["p0", "p1", "p2", "p3"]
    assert drawn == Dataset.from_dict({"prompt": [f"p{i}" for i in range(10)]}).shuffle(seed=42)["prompt"][:4]
    assert _mix(big, ("data.jsonl", 1, {}), ("big.jsonl", 1, {}))["prompt"] == even["prompt"]
    # explicit seed 42 is the default; another seed draws other rows; the prompt/completion pairs stay together
    assert _mix(big, ("data.jsonl", 1, {}), ("big.jsonl", 1, {"seed": 42}))["prompt"] == even["prompt"]
    other = _mix(big, ("data.jsonl", 1, {}), ("big.jsonl", 1, {"seed": 7}))
    assert other["prompt"][4:] != drawn
    skewed = _mix(big, ("data.jsonl", 0.2, {}), ("big.jsonl", 0.8, {}))
    assert len(skewed) == 12 and set(skewed["prompt"][:2]) <= set(ROWS["prompt"])
    assert skewed["prompt"][2:] == [f"p{i}" for i in range(10)]  # all 10 rows: kept in order


def test_get_dataset_fraction_errors_are_trls(big):
    """Where TRL 1.16 raises, get_dataset raises the same type with TRL's phrase first, then the fix."""
    with pytest.raises(
        ValueError, match=r"^`fraction` must be set for either all datasets in the mixture or none of them\. .*big"
    ):
        get_dataset(
            DatasetMixtureConfig(
                datasets=[{"path": str(big / "data.jsonl"), "fraction": 0.5}, {"path": str(big / "big.jsonl")}]
            )
        )
    with pytest.raises(
        ValueError, match=r"^Using a dataset `fraction` is not supported with streaming datasets\. Set"
    ):
        _mix(big, ("data.jsonl", 1, {}), ("big.jsonl", 1, {}), streaming=True)
    with pytest.raises(ValueError, match=r"^`fraction` must be set for either all"):  # TRL checks this one first
        get_dataset(
            DatasetMixtureConfig(
                datasets=[{"path": str(big / "data.jsonl"), "fraction": 1}, {"path": str(big / "big.jsonl")}],
                streaming=True,
            )
        )
    with pytest.raises(ValueError, match=r">= 0 with a positive sum"):
        _mix(big, ("data.jsonl", -1, {}), ("big.jsonl", 1, {}))
    # a fraction of 0 drops the source (TRL: round(0 * N) rows)
    assert _mix(big, ("data.jsonl", 1, {}), ("big.jsonl", 0, {}))["prompt"] == ROWS["prompt"]


def test_get_dataset_errors(files):
    with pytest.raises(ValueError, match=r"^No datasets were loaded from the mixture configuration: .* empty"):
        get_dataset(DatasetMixtureConfig())
    Dataset.from_dict({"text": ["x"]}).to_json(files / "text.jsonl")
    with pytest.raises(ValueError, match="different columns"):
        get_dataset(
            DatasetMixtureConfig(datasets=[{"path": str(files / "data.jsonl")}, {"path": str(files / "text.jsonl")}])
        )
    with pytest.raises(ValueError, match=r"has no columns \['answer'\]"):
        get_dataset(DatasetMixtureConfig(datasets=[{"path": str(files / "data.jsonl"), "columns": ["answer"]}]))
    with pytest.raises(DatasetNotFoundError):
        get_dataset(DatasetMixtureConfig(datasets=[{"path": "org/unknown"}]))
