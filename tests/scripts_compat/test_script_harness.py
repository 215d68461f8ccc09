"""The harness that runs third-party scripts: these run without the fetched sources."""

from __future__ import annotations

import pytest
import script_harness as h
import test_third_party_recipes as recipes


def test_import_rewrite_touches_only_trl_imports():
    src = (
        "import trl\n"
        "from trl import SFTTrainer, TrlParser\n"
        "from trl.experimental.cpo import CPOConfig\n"
        "    from trl.rewards import (\n        accuracy_reward,\n    )\n"
        "import trlx_like\n"
        "x = 'from trl import nothing'  # a string, not an import\n"
    )
    out = h.rewrite_trl_imports(src)
    assert out.splitlines()[:4] == [
        "import posttrain as trl",
        "from posttrain import SFTTrainer, TrlParser",
        "from posttrain.experimental.cpo import CPOConfig",
        "    from posttrain.rewards import (",
    ]
    assert "import trlx_like" in out and "x = 'from trl import nothing'" in out


@pytest.mark.parametrize("line", ["import trl.experimental", "import trl as t"])
def test_import_rewrite_refuses_forms_it_does_not_handle(line):
    with pytest.raises(AssertionError, match="unhandled trl import"):
        h.rewrite_trl_imports(line + "\n")


def test_local_dataset_keeps_hub_config_and_split_names(tmp_path):
    from datasets import load_dataset

    path = h.write_dataset(tmp_path / "d", {"train_sft": h.messages_rows(3), "test_sft": h.messages_rows(2)},
                           config_name="SFT")
    ds = load_dataset(path, "SFT", split="train_sft", cache_dir=str(tmp_path / "cache"))
    assert ds.column_names == ["messages"] and len(ds) == 3


def test_recipe_override_changes_only_paths_budget_and_hardware(tmp_path):
    recipe = {
        "model_name_or_path": "org/big-model",
        "torch_dtype": "bfloat16",
        "attn_implementation": "flash_attention_2",
        "bf16": True,
        "optim": "paged_adamw_8bit",
        "max_seq_length": 2048,
        "warmup_ratio": 0.1,
        "learning_rate": 2.0e-5,
        "dataset_mixture": {
            "datasets": [
                {"id": "org/data", "config": "default", "split": "train_sft", "columns": ["messages"], "weight": 0.5},
                {"id": "org/data", "config": "default", "split": "test_sft", "columns": ["messages"]},
            ],
            "test_split_size": 1000,
            "seed": 0,
        },
        "push_to_hub": True,
        "report_to": ["wandb"],
    }
    out = recipes.override(recipe, model="/m", output_dir="/o", data_root=tmp_path, kind="sft")
    # Renamed keys and the rest pass through as written.
    assert out["torch_dtype"] == "bfloat16" and out["warmup_ratio"] == 0.1 and out["learning_rate"] == 2.0e-5
    assert out["model_name_or_path"] == "/m" and out["output_dir"] == "/o"
    assert out["max_seq_length"] == 64 and out["max_steps"] == 2 and out["push_to_hub"] is False
    assert out["bf16"] is False and out["attn_implementation"] is None and out["optim"] == "adamw_torch"
    entries = out["dataset_mixture"]["datasets"]
    assert {e["id"] for e in entries} == {str(tmp_path / "mix0")}
    assert [e["split"] for e in entries] == ["train_sft", "test_sft"] and entries[0]["weight"] == 0.5
    assert out["dataset_mixture"]["test_split_size"] == 4
    assert recipe["model_name_or_path"] == "org/big-model"  # the loaded recipe itself is untouched


def _sdist(path, members):
    """A trl-1.16.0.tar.gz stand-in: ``members`` maps names under ``trl-1.16.0/`` to file text (None: a symlink)."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            info = tarfile.TarInfo(f"trl-1.16.0/{name}")
            if text is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                data = text.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize("with_filter", [True, False])
def test_sdist_extraction_with_and_without_tarfile_filters(tmp_path, monkeypatch, with_filter):
    """`script_sources.py trl-scripts` extracts the pinned paths on Pythons with extraction filters and on those
    without (Debian 12's python3 3.11.2, which .ci/run uses: `filter=` raised TypeError there, and CI skipped the
    9 TRL-script tests), and refuses a link in either case."""
    import tarfile

    import script_sources as src

    if not with_filter:  # this Python as 3.11.2: no data_filter, and extractall takes no `filter=`
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
        extractall = tarfile.TarFile.extractall

        def extractall_without_filter(self, path=".", members=None, *, numeric_owner=False):
            return extractall(self, path, members, numeric_owner=numeric_owner)

        monkeypatch.setattr(tarfile.TarFile, "extractall", extractall_without_filter)
    monkeypatch.setenv("POSTTRAIN_SCRIPT_SOURCES", str(tmp_path / "sources"))
    good = _sdist(tmp_path / "good.tar.gz", {"trl/scripts/sft.py": "print(1)\n", "LICENSE": "Apache\n", "setup.py": ""})
    dest = src.fetch("trl-scripts", sdist=good)
    assert (dest / "trl" / "scripts" / "sft.py").read_text() == "print(1)\n" and (dest / "LICENSE").is_file()
    assert not (dest / "setup.py").exists()  # only the pinned paths
    bad = _sdist(tmp_path / "bad.tar.gz", {"trl/scripts/sft.py": "", "trl/scripts/evil": None, "LICENSE": ""})
    with pytest.raises((ValueError, tarfile.TarError)):
        src.fetch("trl-scripts", sdist=bad)
