"""Package version from installed metadata (``"unknown"`` when running from an uninstalled checkout)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("posttrain")
except PackageNotFoundError:  # pragma: no cover - source checkout without install
    __version__ = "unknown"
