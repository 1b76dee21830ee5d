"""weights/provenance.py: what a checkpoint records about the versions that wrote it, and the refusal of one
written by a newer megatron-core than the installed one (one line, both versions). End to end (a stamped
training checkpoint refused at resume, exit 2, before any model is built): tests/checkpoint/test_resume.py."""

import json
from importlib import metadata

import pytest

import remax_megatron
from remax_megatron.weights.provenance import META, check_readable, installed_versions, recorded_versions


def _stamped(tmp_path, **versions):
    (tmp_path / META).write_text(json.dumps({"format_version": 1, "versions": versions}))
    return str(tmp_path)


def test_the_record_names_megatron_core_torch_and_this_project():
    assert installed_versions() == {
        "megatron_core": metadata.version("megatron-core"),
        "torch": metadata.version("torch"),
        "remax_megatron": remax_megatron.__version__,
    }


def test_a_newer_megatron_core_is_refused_naming_both_versions(tmp_path):
    path = _stamped(tmp_path, megatron_core="0.19.2", torch="2.15.0", remax_megatron="0.1.0")
    with pytest.raises(ValueError) as refused:
        check_readable(path, installed="0.16.1")
    assert str(refused.value) == (
        f"checkpoint {path} was written by megatron-core 0.19.2 and the installed megatron-core 0.16.1 cannot read a "
        "newer one's checkpoints: install megatron-core>=0.19.2 (it needs Python >= 3.12 from 0.17 on), or use a "
        "checkpoint written by this version"
    )
    with pytest.raises(ValueError, match="megatron-core 0.16.2 and the installed megatron-core 0.16.1 "):
        check_readable(_stamped(tmp_path, megatron_core="0.16.2"), installed="0.16.1")


@pytest.mark.parametrize("saved", ["0.16.1", "0.16.0", "0.19.2rc0"])
def test_the_same_or_an_older_megatron_core_reads(tmp_path, saved):
    check_readable(_stamped(tmp_path, megatron_core=saved), installed="0.19.2")  # 0.19 reads 0.16's checkpoints


def test_a_checkpoint_without_the_record_reads_as_before(tmp_path):
    check_readable(str(tmp_path), installed="0.16.1")  # no remax_checkpoint.json at all
    (tmp_path / META).write_text(json.dumps({"format_version": 1, "dtype": "float32"}))
    assert recorded_versions(str(tmp_path)) is None
    check_readable(str(tmp_path), installed="0.16.1")
