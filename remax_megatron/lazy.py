"""Packages whose names are imported on first use (PEP 562), so that importing one name does not
import every module of the package: the start-up checks read configs and weight headers without
loading megatron-core (seconds).

    __getattr__ = lazy_exports(__name__, {"read_hf_config": "remax_megatron.models.hf_config", ...})
"""

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module-level __getattr__: each name of `exports` ({name: module}) from its module."""

    def __getattr__(name):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
