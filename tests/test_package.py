"""Package-level behaviour: lazy imports, version, console script."""

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_import_posttrain_is_lazy():
    out = _run(
        "import sys, posttrain; "
        "print(','.join(m for m in ['torch','transformers','accelerate','datasets','vllm'] if m in sys.modules))"
    )
    assert out.strip() == ""


def test_lazy_name_resolves_on_access():
    out = _run("import sys, posttrain; posttrain.disable_dropout_in_model; print('torch' in sys.modules)")
    assert out.strip() == "True"


def test_unknown_attribute_raises():
    import posttrain

    try:
        posttrain.NoSuchThing  # noqa: B018
    except AttributeError as err:
        assert "NoSuchThing" in str(err)
    else:
        raise AssertionError("expected AttributeError")


def test_console_script_version_and_help():
    version = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert version.startswith("posttrain ")
    help_text = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "usage: posttrain" in help_text and "env" in help_text


def test_env_command_lists_versions():
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "env"], capture_output=True, text=True, check=True
    ).stdout
    for key in ["posttrain version", "PyTorch version", "Transformers version", "vLLM version"]:
        assert key in out


def test_test_module_basenames_are_unique():
    """Test folders have no __init__.py, so two test files with one basename break collection on a clean run."""
    from collections import Counter
    from pathlib import Path

    names = Counter(p.name for p in Path(__file__).parent.rglob("*.py") if p.name != "conftest.py")
    assert not [n for n, c in names.items() if c > 1]
