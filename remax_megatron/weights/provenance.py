"""Which versions wrote a checkpoint, and whether the installed megatron-core can read it.

Every checkpoint's remax_checkpoint.json (weights/megatron_ckpt.save_model: model checkpoints and
training checkpoints alike) records `versions`: megatron-core, torch and remax-megatron. megatron-core
reads checkpoints of older releases but not always of newer ones (0.16.1 fails on 0.19's with
"AttributeError: 'str' object has no attribute 'iterdir'", deep inside the load, after the models are
built): `check_readable` refuses a checkpoint written by a newer megatron-core than the installed one, in
one line naming both, before anything is built (resume.check_resume, the converter's
read_checkpoint_meta). A checkpoint without the record (written before it existed) is read as before.

Reads metadata only: importing this module imports neither torch nor megatron-core.
"""

from __future__ import annotations

import json
import os
import re
from importlib import metadata

import remax_megatron

META = "remax_checkpoint.json"
# the distributions whose versions a checkpoint records, by the key it records them under
RECORDED = {"megatron_core": "megatron-core", "torch": "torch"}


def installed_versions() -> dict:
    """{"megatron_core": ..., "torch": ..., "remax_megatron": ...} of this environment."""
    versions = {key: metadata.version(dist) for key, dist in RECORDED.items()}
    versions["remax_megatron"] = remax_megatron.__version__
    return versions


def recorded_versions(ckpt_dir: str) -> dict | None:
    """The versions that wrote `ckpt_dir` (its remax_checkpoint.json), None when it records none."""
    path = os.path.join(ckpt_dir, META)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            versions = json.load(f).get("versions")
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable file is named by the reader that needs its other fields
    return versions if isinstance(versions, dict) else None


def check_readable(ckpt_dir: str, installed: str | None = None) -> None:
    """ValueError (one line, both versions) when `ckpt_dir` was written by a newer megatron-core than the
    installed one (`installed`: that version, for tests)."""
    saved = (recorded_versions(ckpt_dir) or {}).get("megatron_core")
    if not saved:
        return
    installed = installed or metadata.version(RECORDED["megatron_core"])
    if _release(saved) > _release(installed):
        raise ValueError(
            f"checkpoint {ckpt_dir} was written by megatron-core {saved} and the installed megatron-core {installed} "
            f"cannot read a newer one's checkpoints: install megatron-core>={saved} (it needs Python >= 3.12 from "
            "0.17 on), or use a checkpoint written by this version"
        )


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: "0.19.2rc1" -> (0, 19, 2); () when it has none."""
    match = re.match(r"\d+(?:\.\d+)*", str(version).strip())
    return tuple(int(part) for part in match.group().split(".")) if match else ()
