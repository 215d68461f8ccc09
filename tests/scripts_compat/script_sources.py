"""Where the third-party training scripts that tests/scripts_compat runs come from, and how to fetch them.

The scripts (TRL's example scripts and ``trl/scripts``, open-r1's and alignment-handbook's entry points and recipes)
are other projects' code (all Apache-2.0). They are test data, never part of posttrain, and they are not committed
here: this module pins each source (repository, commit or release, license) and copies it, verbatim, into a local
directory that the tests read. Tests whose source is missing skip and name the command that fetches it.

    python tests/scripts_compat/script_sources.py                      # fetch every source from GitHub and PyPI
    python tests/scripts_compat/script_sources.py --git trl=/path/to/trl/.git --git open-r1=... --trl-sdist trl-1.16.0.tar.gz

The directory is ``$POSTTRAIN_SCRIPT_SOURCES`` or ``.script-sources`` at the repository root (git-ignored; outside
``tests/``, so the fetched files are never collected or counted as test modules). Nothing is
rewritten on disk: the harness rewrites ``trl`` imports to ``posttrain`` in a temporary copy at test time.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Source:
    """One pinned third-party source tree.

    ``name`` is its directory under the sources root; ``paths`` are the repository paths copied (directories are
    copied recursively). ``commit`` pins a git source; ``pypi`` pins a release whose source distribution holds the
    paths (TRL's ``trl/scripts`` ship in its sdist, its ``examples/`` do not).
    """

    name: str
    repository: str
    paths: tuple[str, ...]
    license: str = "Apache-2.0"
    commit: str | None = None
    pypi: str | None = None

    @property
    def origin(self) -> str:
        return f"{self.repository}@{self.commit}" if self.commit else f"PyPI {self.pypi} ({self.repository})"


SOURCES: dict[str, Source] = {
    # TRL 1.16.0's own scripts (`trl sft`, `trl dpo`, ...), exactly as released.
    "trl-scripts": Source(
        name="trl-scripts",
        repository="huggingface/trl",
        pypi="trl==1.16.0",
        paths=("trl/scripts", "LICENSE"),
    ),
    # TRL's examples/scripts are not in any release artifact; this is the newest TRL commit available to this
    # project (2026-07-24, VERSION 1.10.0.dev0). Scripts whose trainer TRL 1.16 no longer ships are listed as such
    # in the test module.
    "trl-examples": Source(
        name="trl-examples",
        repository="huggingface/trl",
        commit="f2cd57710ae345ea6428ae95363267fcf38a3dc8",
        paths=("examples/scripts", "LICENSE"),
    ),
    "open-r1": Source(
        name="open-r1",
        repository="huggingface/open-r1",
        commit="1416fa0cf21595d2083b399a2a0bbddd7f6e9563",
        paths=("src/open_r1", "recipes", "LICENSE"),
    ),
    "alignment-handbook": Source(
        name="alignment-handbook",
        repository="huggingface/alignment-handbook",
        commit="925acdfe4b2b4e38c3dabd1851bc418f0b656351",
        paths=("scripts", "src/alignment", "recipes", "LICENSE"),
    ),
}

FETCH_HINT = "python tests/scripts_compat/script_sources.py (see its docstring for offline use)"


def sources_root() -> Path:
    return Path(os.environ.get("POSTTRAIN_SCRIPT_SOURCES") or HERE.parents[1] / ".script-sources")


def source_dir(name: str) -> Path | None:
    """The fetched copy of ``SOURCES[name]``, or None when it has not been fetched (the ORIGIN stamp is written
    last, so a half-copied tree counts as missing)."""
    path = sources_root() / name
    return path if (path / "ORIGIN").is_file() else None


def _extract_git(source: Source, git_dir: str, dest: Path) -> None:
    archive = subprocess.run(
        ["git", "--git-dir", git_dir, "archive", "--format=tar", source.commit, *source.paths],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        safe_extract(tar, dest, tar.getmembers(), source.origin)


def safe_extract(tar: tarfile.TarFile, dest: Path, members: list[tarfile.TarInfo], origin: str) -> None:
    """Extract ``members`` into ``dest`` with the ``"data"`` extraction filter where this Python has it; on Pythons
    without extraction filters (3.10, and 3.11 before 3.11.4 — Debian 12's ``python3`` is 3.11.2) make the refusals
    that matter for these sources by hand: only regular files and directories, relative paths with no ``..``."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    for member in members:
        path = Path(member.name)
        if not (member.isfile() or member.isdir()) or path.is_absolute() or ".." in path.parts:
            raise ValueError(f"{origin}: refusing to extract {member.name!r} (only plain files under the root)")
    tar.extractall(dest, members=members)


def _clone(source: Source, workdir: Path) -> str:
    repo = workdir / source.name
    url = f"https://github.com/{source.repository}.git"
    subprocess.run(["git", "init", "-q", "--bare", str(repo)], check=True)
    subprocess.run(
        ["git", "--git-dir", str(repo), "fetch", "-q", "--depth", "1", url, source.commit], check=True
    )
    return str(repo)


def _extract_sdist(source: Source, sdist: str | None, dest: Path, workdir: Path) -> None:
    if sdist is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", source.pypi,
             "-d", str(workdir)],
            check=True,
        )
        sdist = str(next(workdir.glob("*.tar.gz")))
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        members = [
            m for m in tar.getmembers()
            if any(m.name == f"{top}/{p}" or m.name.startswith(f"{top}/{p}/") for p in source.paths)
        ]
        for member in members:
            member.name = member.name[len(top) + 1:]
        safe_extract(tar, dest, members, sdist)


def fetch(name: str, git_dir: str | None = None, sdist: str | None = None) -> Path:
    """Copy ``SOURCES[name]`` into the sources root (replacing an older copy); returns its directory."""
    source = SOURCES[name]
    dest = sources_root() / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        if source.pypi:
            _extract_sdist(source, sdist, dest, Path(tmp))
        else:
            _extract_git(source, git_dir or _clone(source, Path(tmp)), dest)
    missing = [p for p in source.paths if not (dest / p).exists()]
    if missing:
        raise SystemExit(f"{name}: {missing} not found in {source.origin}")
    (dest / "ORIGIN").write_text(f"{source.origin}\nlicense: {source.license}\npaths: {', '.join(source.paths)}\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"sources to fetch (default: all of {', '.join(SOURCES)})")
    parser.add_argument("--git", action="append", default=[], metavar="NAME=GIT_DIR",
                        help="read NAME's pinned commit from a local git directory instead of cloning")
    parser.add_argument("--trl-sdist", help="a local trl-1.16.0.tar.gz instead of downloading it")
    args = parser.parse_args(argv)
    git_dirs = dict(item.split("=", 1) for item in args.git)
    for name in args.names or list(SOURCES):
        git_dir = git_dirs.get(name) or (git_dirs.get("trl") if name == "trl-examples" else None)
        path = fetch(name, git_dir=git_dir, sdist=args.trl_sdist if name == "trl-scripts" else None)
        print(f"{name}: {SOURCES[name].origin} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
