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
    assert err.__cause__ is None and err.__suppress_context__ is False and err.__context__ is None
    with pytest.raises(DatasetNotFoundError, match="no such file or folder"):
        load_dataset_from_spec("./missing/train.jsonl")


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
    with pytest.raises(ValueError, match=r"every dataset .* sets `fraction` or none.*\['b'\]"):
        DatasetMixtureConfig(datasets=[{"path": "a", "fraction": 0.5}, {"path": "b"}])
    with pytest.raises(ValueError, match="must be > 0"):
        DatasetMixtureConfig(datasets=[{"path": "a", "fraction": 0.0}])
    with pytest.raises(ValueError, match="streaming"):
        DatasetMixtureConfig(datasets=[{"path": "a", "fraction": 1.0}], streaming=True)
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
    streamed = get_dataset(DatasetMixtureConfig(datasets=mix.datasets, streaming=True))
    assert isinstance(streamed, datasets.IterableDatasetDict) and len(list(streamed["train"])) == 14


def test_get_dataset_fractions_never_oversample(files):
    big = Dataset.from_dict({"prompt": [f"p{i}" for i in range(10)], "completion": ["c"] * 10})
    big.to_json(files / "big.jsonl")
    # weights 1/2, 1/2: the 4-row source limits the mixture to 8 rows, 4 from each
    even = get_dataset(
        DatasetMixtureConfig(
            datasets=[
                {"path": str(files / "data.jsonl"), "fraction": 1},
                {"path": str(files / "big.jsonl"), "fraction": 1},
            ]
        )
    )["train"]
    assert even["prompt"] == ROWS["prompt"] + ["p0", "p1", "p2", "p3"]
    # weights 0.2, 0.8: N = min(4 / 0.2, 10 / 0.8) = 12.5 -> round(2.5) = 2 and 10 rows
    skewed = get_dataset(
        DatasetMixtureConfig(
            datasets=[
                {"path": str(files / "data.jsonl"), "fraction": 0.2},
                {"path": str(files / "big.jsonl"), "fraction": 0.8},
            ]
        )
    )["train"]
    assert len(skewed) == 12
    assert skewed["prompt"][:2] == ["a", "b"] and skewed["prompt"][-1] == "p9"


def test_get_dataset_errors(files):
    with pytest.raises(ValueError, match="empty"):
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
