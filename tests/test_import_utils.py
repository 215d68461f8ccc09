"""``posttrain.import_utils`` (TRL's ``trl.import_utils`` probes) and ``posttrain.scripts.utils.get_git_commit_hash``."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from posttrain import import_utils
from posttrain.scripts.utils import get_git_commit_hash


@pytest.mark.parametrize(
    "probe,module",
    [("is_deepspeed_available", "deepspeed"), ("is_math_verify_available", "math_verify"),
     ("is_vllm_available", "vllm"), ("is_requests_available", "requests"), ("is_weave_available", "weave"),
     ("is_liger_kernel_available", "liger_kernel"), ("is_mergekit_available", "mergekit")],
)
def test_probes_agree_with_find_spec(probe, module):
    assert getattr(import_utils, probe)() == (importlib.util.find_spec(module) is not None)


def test_versioned_probes(monkeypatch):
    monkeypatch.setattr(import_utils, "_available", lambda module: True)
    monkeypatch.setattr(import_utils.importlib.metadata, "version", lambda dist: "0.25.0+cu129")
    assert import_utils.is_vllm_available()
    assert import_utils.is_vllm_available(min_version="0.25.0")  # the local tag does not count
    assert not import_utils.is_vllm_available(min_version="0.26.0")
    assert import_utils.is_liger_kernel_available()  # 0.25.0 is above TRL's floor 0.8.2
    monkeypatch.setattr(import_utils.importlib.metadata, "version", lambda dist: "0.5.0")
    assert not import_utils.is_liger_kernel_available()
    assert import_utils.is_liger_kernel_available(min_version="0.5.0")
    monkeypatch.setattr(import_utils, "_available", lambda module: False)
    assert not import_utils.is_vllm_available() and not import_utils.is_liger_kernel_available()


def test_git_commit_hash(tmp_path, monkeypatch):
    pkg = tmp_path / "repo" / "fakepkg_h6"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "repo"))
    assert get_git_commit_hash("fakepkg_h6") is None  # not a checkout
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path / "repo")]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.check_output([*git, "rev-parse", "HEAD"]).decode().strip()
    assert get_git_commit_hash("fakepkg_h6") == head
    assert get_git_commit_hash("no_such_package_h6").startswith("Error: ")
