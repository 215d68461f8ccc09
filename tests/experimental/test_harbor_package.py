"""The boundary between ``posttrain.experimental.harbor`` and the ``harbor`` package: Harbor's own sandboxes
(``environment_type="docker"``, ``"e2b"``, ...) and Harbor registry dataset names (``"terminal-bench@2.0"``).

harbor requires Python >= 3.12. Forced onto Python 3.11 (``pip install --ignore-requires-python harbor``),
``import harbor`` succeeds (its ``__init__`` imports lazily) but the modules posttrain drives do not compile (PEP 695
generics such as ``def _request[T: BaseModel](``, PEP 701 multi-line f-strings); posttrain must then say so and name
the fix instead of failing inside harbor. The tests at the bottom need a harbor that imports (Python >= 3.12) and
skip with that reason elsewhere; the others run everywhere and need no network.
"""

from __future__ import annotations

import sys

import pytest
from harbor_helpers import EXAMPLE_TASKS

from posttrain.experimental.harbor import HarborBashEnv, HarborSpec, HarborTaskError
from posttrain.experimental.harbor._env import HARBOR_BACKEND_MODULES, harbor_unavailable, require_harbor
from posttrain.experimental.harbor._spec import registry_cache_dir

PY = rf"Python {sys.version_info.major}\.{sys.version_info.minor}"


def _no_harbor(monkeypatch):
    monkeypatch.setitem(sys.modules, "harbor", None)  # import harbor -> ImportError


def _forget_fake_harbor() -> None:
    """Drop the test's fake harbor modules (monkeypatch restores the entries it removed, not the ones added)."""
    for name in [m for m in sys.modules if m == "harbor" or m.startswith("harbor.")]:
        del sys.modules[name]


def test_registry_names_without_harbor_say_what_was_tried_and_the_fix(monkeypatch, tmp_path):
    _no_harbor(monkeypatch)
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    for name, module, short in [
        ("terminal-bench@2.0", "harbor.registry.client.factory", "terminal-bench"),  # Harbor's dataset registry
        ("laude-institute/terminal-bench@2.0", "harbor.registry.client.package", "terminal-bench"),  # packages
    ]:
        with pytest.raises(HarborTaskError) as caught:
            _ = HarborSpec(name, environment_type="bubblewrap").train_dataset
        message = str(caught.value)
        assert f"Harbor dataset {name!r} is not a local directory" in message
        assert f"importing {module} failed: ModuleNotFoundError" in message
        assert "`pip install harbor` (it requires Python >= 3.12; this is Python" in message
        assert f"`harbor download {name} -o DIR`" in message and f"HarborSpec('DIR/{short}'" in message
    with pytest.raises(HarborTaskError, match=r"registry name is name@version"):
        _ = HarborSpec("suite@", environment_type="bubblewrap").train_dataset


def test_names_that_are_no_directory_repo_id_or_registry_name_list_the_three_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        HarborTaskError,
        match=r"'terminal-bench' is not a local directory, nor a Hugging Face dataset repo id \(owner/name\), nor a "
        r"Harbor registry name \(name@version, e\.g\. 'terminal-bench@2\.0'",
    ):
        _ = HarborSpec("terminal-bench", environment_type="bubblewrap").train_dataset


def test_a_local_directory_named_like_a_registry_name_is_used_as_is(tmp_path, monkeypatch):
    _no_harbor(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "suite@1.0").symlink_to(EXAMPLE_TASKS, target_is_directory=True)
    assert HarborSpec("suite@1.0", environment_type="bubblewrap").train_dataset.num_rows == 5


def test_registry_downloads_go_to_a_path_safe_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_HARBOR_CACHE", str(tmp_path))
    assert registry_cache_dir("org/name@v1.0") == tmp_path / "org__name--v1.0"
    monkeypatch.delenv("POSTTRAIN_HARBOR_CACHE")
    assert registry_cache_dir("terminal-bench@2.0").parts[-3:] == ("posttrain", "harbor", "terminal-bench--2.0")


def test_a_harbor_that_does_not_compile_on_this_python_is_reported_not_raised(monkeypatch, tmp_path, request):
    """What a harbor forced onto Python 3.11 does: ``import harbor`` works, its submodules raise SyntaxError."""
    package = tmp_path / "harbor"
    (package / "environments").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "environments" / "__init__.py").write_text("")
    # PEP 695 (a SyntaxError before 3.12), then a line no Python compiles, so the test means the same everywhere.
    (package / "environments" / "factory.py").write_text("def _request[T: int](x: T) -> T:\n    return x\nclass P(:\n")
    for name in [m for m in sys.modules if m == "harbor" or m.startswith("harbor.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(_forget_fake_harbor)
    import harbor  # noqa: F401 -- the package itself imports, as harbor 0.26 does on Python 3.11

    problem = harbor_unavailable()
    assert problem.startswith("importing harbor.environments.factory failed: SyntaxError: ")
    assert str(package / "environments" / "factory.py") in problem
    with pytest.raises(ImportError, match=rf"environment_type='docker' .*pip install harbor.*{PY}.*SyntaxError"):
        require_harbor("docker")
    spec = HarborSpec(EXAMPLE_TASKS)  # TRL's default backend
    with pytest.raises(ImportError, match=r"SyntaxError.*use environment_type='bubblewrap'"):
        _ = spec.environment_factory
    with pytest.raises(ImportError, match=r"environment_type='modal' "):
        HarborBashEnv(environment_type="modal").reset(task_dir=str(EXAMPLE_TASKS / "hello-file"))


# --- with a harbor that imports (what Python >= 3.12 gives) -------------------------------------------------------
# The real package cannot be imported on this machine's Python 3.11 (it does not compile), so these tests stand its
# backend modules in sys.modules: they check posttrain's side — that an importable harbor is accepted and a harbor
# environment type is then built as TRL builds it. Driving Harbor's sandboxes themselves is untested here (README).


def test_with_harbor_importable_the_factory_builds_for_harbor_backends(monkeypatch):
    import types

    for module in HARBOR_BACKEND_MODULES:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if not isinstance(sys.modules.get(name), types.ModuleType) or not hasattr(sys.modules[name], "_stand_in"):
                stand_in = types.ModuleType(name)
                stand_in.__path__ = []  # a package, so its submodules resolve from sys.modules
                stand_in._stand_in = True
                monkeypatch.setitem(sys.modules, name, stand_in)
    spec = HarborSpec(EXAMPLE_TASKS, agent="bash", environment_type="docker")
    assert spec.train_dataset.num_rows == 5
    factory = spec.environment_factory
    assert factory.keywords == {"environment_type": "docker"} and factory.func is HarborBashEnv
