"""``inferscale_jax.__version__``: the installed distribution's version (package metadata); in a
source tree that is not installed, pyproject.toml's.  Standard library only: ``inferscale
--version`` (``inferscale_cli/main.py``) loads this file alone, without the package (which imports jax)."""

from __future__ import annotations

import os
from importlib import metadata


def _version() -> str:
    try:
        return metadata.version("inferscale-jax")
    except metadata.PackageNotFoundError:
        import tomllib

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        with open(path, "rb") as f:
            return tomllib.load(f)["project"]["version"]


__version__ = _version()
