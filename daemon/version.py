"""The installed kvguard's version, for `kvguard --version`, the start log line and
kvguard_build_info: every rank of a model and every daemon sharing an audit database should run
the same one, and an operator checks that from outside the venv."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

NOT_INSTALLED = "unknown"


def kvguard_version() -> str:
    """The distribution's version, or "unknown" for a source tree run without installing it
    (on PYTHONPATH): there is no metadata to read then, and no version to make up."""
    try:
        return version("kvguard")
    except PackageNotFoundError:
        return NOT_INSTALLED
