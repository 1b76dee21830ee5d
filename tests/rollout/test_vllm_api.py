"""tools/check_vllm_api.py against the installed vLLM: every vLLM API our code uses exists, with the keyword
arguments we pass and the output attributes we read (issue 44). A vLLM upgrade that drops or renames one
fails here in about a second, before a multi-process engine test (or a GPU run) would. Source is read, not
imported; nothing is downloaded."""

import json

import pytest

from tests._needs import needs_vllm
from tools import check_vllm_api as check

pytestmark = needs_vllm


@pytest.fixture(scope="module")
def source():
    return check.VllmSource(check.installed_vllm())


def test_every_use_is_found(capsys):
    status = check.main([])
    report = json.loads(capsys.readouterr().out)
    missing = [f"{e['where']} {e['what']}: {e['vllm']}" for e in report["checks"] if e["status"] == "missing"]
    assert status == 0 and not missing, "\n".join(missing)
    whats = {e["what"] for e in report["checks"] if e["status"] == "found"}
    # The uses issue 44 names are among those checked (the checker still sees our call sites).
    for what in (
        "LLM(enable_sleep_mode=...)",
        "params_cls(structured_outputs=...)",
        "params_cls(detokenize=...)",
        "self.llm.generate(use_tqdm=...)",
        "worker.reload_weights(...) via collective_rpc(weights_iterator=...)",
        "self.llm.sleep(level=...)",
        "self.llm.wake_up(tags=...)",
        "output.token_ids",
        "output.logprobs",
        "output.finish_reason",
        "getattr(output, 'routed_experts', None)",
        "o.index",
        "step[*].logprob",
    ):
        assert what in whats, what


def _use(kind, base, name="", keywords=(), path=()):
    return check.Use(kind, base, list(path), name, [(k, 1) for k in keywords], "ours.py:1", f"{name or base[0]}(...)")


@pytest.mark.parametrize(
    "use",
    [
        _use("import", None, "vllm.no_such_module.Thing"),
        _use("import", None, "vllm.sampling_params.NoSuchClass"),
        _use("call", ("vllm.sampling_params.SamplingParams", False), keywords=["no_such_field"]),  # msgspec fields
        _use("call", ("vllm.LLM", False), keywords=["no_such_engine_arg"]),  # followed through **kwargs
        _use("method", ("vllm.LLM", True), "sleep", keywords=["no_such_param"]),
        _use("method", ("vllm.LLM", True), "no_such_method"),
        _use("attribute", ("vllm.outputs.CompletionOutput", True), "no_such_attribute"),
        _use("method", (check.WORKER, True), "reload_weights", keywords=["no_such_param"]),
    ],
    ids=["module", "class", "struct-field", "engine-arg", "param", "method", "attribute", "worker-param"],
)
def test_a_missing_api_is_reported(source, use):
    """The control: what vLLM does not have is reported missing, not found or unverified."""
    statuses = [e["status"] for e in check.check_use(source, use)]
    assert "missing" in statuses, statuses
