"""What the libraries may print (remax_megatron/console.py): vLLM's known notices and its per-sync rotary
warning are dropped, precisely; the environment knobs follow logging.level and the rank; a user's own
setting wins. (The whole default run's console: tests/train/test_console_e2e.py.)"""

import logging

import pytest

from remax_megatron.console import (
    ROTARY_LOGGER,
    STACK_NOISE,
    VLLM_NOISE,
    VllmNoise,
    quiet_console,
    quiet_library_warnings,
)


def _record(name, msg, *args, level=logging.WARNING):
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_the_rotary_reload_warning_is_dropped_and_no_other_layer_s():
    keep = VllmNoise()
    assert not keep.filter(_record(ROTARY_LOGGER, "%s: Failed to load weights", "RotaryEmbedding"))
    assert not keep.filter(_record(ROTARY_LOGGER, "%s: Failed to load weights", "Llama3RotaryEmbedding"))
    # a layer with real weights that failed to reload must still be seen
    assert keep.filter(_record(ROTARY_LOGGER, "%s: Failed to load weights", "QKVParallelLinear"))
    assert keep.filter(_record(ROTARY_LOGGER, "Allocating %.1f MB of device memory to buffers", 3.0))


def test_known_vllm_notices_are_dropped_and_other_warnings_kept():
    cpu_worker = VllmNoise(VLLM_NOISE["vllm.v1.worker.cpu_worker"])
    assert not cpu_worker.filter(
        _record("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD. For best performance, ...", "libtcmalloc")
    )
    assert not cpu_worker.filter(
        _record(
            "vllm.v1.worker.cpu_worker",
            "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
        )
    )
    assert cpu_worker.filter(
        _record("vllm.v1.worker.cpu_worker", "Node %s is not in available memory nodes %s.", 1, [0])
    )


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "level,rank,vllm,cpp",
    [
        ("warning", 0, "WARNING", "ERROR"),
        ("warning", 1, "ERROR", "ERROR"),
        ("info", 0, "INFO", "WARNING"),
        ("debug", 0, "DEBUG", "INFO"),
    ],
)
def test_levels_follow_the_config_on_rank_0_and_errors_elsewhere(clean_env, level, rank, vllm, cpp):
    import os

    quiet_console(level, rank)
    assert os.environ["VLLM_LOGGING_LEVEL"] == vllm and os.environ["TORCH_CPP_LOG_LEVEL"] == cpp
    assert os.environ["TRANSFORMERS_VERBOSITY"] == vllm.lower() and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_a_users_environment_wins(clean_env):
    import os

    clean_env.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    quiet_console("warning", 0)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_filters_sit_on_vllm_s_own_loggers(clean_env):
    """vLLM's init_logger(name) is logging.getLogger(name): the filters installed before vLLM is imported
    are on the loggers it will use."""
    quiet_console("warning", 0)
    assert any(isinstance(f, VllmNoise) for f in logging.getLogger(ROTARY_LOGGER).filters)
    for name in VLLM_NOISE:
        assert any(isinstance(f, VllmNoise) for f in logging.getLogger(name).filters), name


def test_the_newer_stacks_notices_are_dropped_and_other_records_kept(clean_env):
    """megatron-core 0.19 (GPTModel deprecated at each build, async save deprecated at each save) and PyPI's
    CUDA torch on a machine without a GPU ("No CUDA runtime is found"): dropped by message on their loggers."""
    quiet_console("warning", 0)
    for name, (message,) in STACK_NOISE.items():
        log = logging.getLogger(name)
        assert not log.filter(_record(name, message + " and the rest of the line")), name
        assert log.filter(_record(name, "a warning about something else")), name


def test_torch_dcp_warnings_about_megatrons_calls_are_dropped_and_others_kept():
    import warnings

    noise = [
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
        "single process.",
        "The argument order of load has been changed. Please check the document to avoid future breakages.",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_warnings(0)
        for message in [*noise, "another DCP warning"]:
            warnings.warn_explicit(message, UserWarning, "utils.py", 1, module="torch.distributed.checkpoint.utils")
        warnings.warn_explicit(noise[0], UserWarning, "mine.py", 1, module="mine")  # not from torch's DCP: kept
    assert [str(w.message) for w in caught] == ["another DCP warning", noise[0]]


def test_the_command_line_reads_its_config_before_torch_is_imported():
    """quiet_console's knobs (TORCH_CPP_LOG_LEVEL, VLLM_LOGGING_LEVEL, ...) are read by the libraries at import:
    the trainer's module and its config must not import torch before train.main has set them."""
    import subprocess
    import sys

    code = (
        "import sys\nimport remax_megatron.train\nfrom remax_megatron.config import load_config\n"
        "load_config('configs/tiny_cpu.yaml', ['actor.tp=1'])\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'megatron', 'vllm'}))"
    )
    root = __file__.rsplit("/tests/", 1)[0]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]
