"""Warm-started tiny models for the built-in ``arith`` task, built offline and cached.

``ensure_builtin_model(name)`` returns a Hugging Face directory, building it on
first use (about a minute per model on one core) and reusing it afterwards:

* ``tiny-arith``: a LlamaForCausalLM, 4 layers (so PP=2 splits it), hidden 128 (head_dim 32, a size vLLM's
  CPU attention runs), character tokenizer. Random init, then supervised on the *train* prompts with a deliberately
  miscalibrated target: the correct sum with probability ``p_correct``
  (0.25) and the systematic mistake ``a+b+1`` otherwise, each followed by
  ``</s>``. The expected cross-entropy is minimised exactly (both responses in
  every batch, weighted), so the model learns those probabilities and carries
  them to the held-out eval prompts: greedy decoding answers ``a+b+1`` (eval
  exact match ~0-0.1), while a temperature-1 sample is correct ~1/3 of the
  time. ReMax (advantage = r(sample) - r(greedy)) therefore flips greedy to
  the correct answer within a few steps.
* ``tiny-arith-moe``: ``tiny-arith`` upcycled into a MixtralForCausalLM (Komatsuzaki et al., 2022:
  every expert starts as a copy of the dense MLP): 4 experts of the dense width, 2 per token, each
  copy perturbed by 1% relative noise so that routing matters from the first step, and a random
  router. With renormalised top-2 weights the model starts as the dense warm start (same greedy
  mistakes, same sampling odds) and RL trains its experts apart: the embedded MoE default
  (configs/tiny_cpu_moe.yaml, expert parallel over 2 processes). Built in seconds from
  ``tiny-arith`` (which it builds first if needed).
* ``tiny-agent``: ``tiny-arith``'s shape with the tokenizer's tool-using variant, supervised on the
  ``multiply`` task to call ``builtin:calculator`` (then copy its answer) with probability 0.25 and to guess
  otherwise (builtin/agent.py): greedy never calls the tool, a sample often does. About 80 s to build.
* ``tiny-arith-rm``: a LlamaForSequenceClassification (num_labels=1) of the
  same shape, scored HF style at the last non-pad token (pad id 0, right
  padding) of ``prompt + response + </s>``. Trained by squared error to 1 for
  the correct answer and 0 for wrong ones (off by one or two, or random in
  0..19), jointly with an auxiliary next-token loss on the correct answers
  through the tied input embedding (used only while training; not saved),
  which makes the backbone compute the sum and lets the score generalise to
  held-out prompts. Scores are on the 0-1 scale of the exact-match reward.

Prompts are the raw text ``"a+b="`` with no BOS and no chat template (the
character tokenizer adds no special tokens).

The cache is ``<root>/<name>-<hash>``, with root = ``cache_dir`` or
``$REMAX_CACHE`` or ``$XDG_CACHE_HOME/remax_megatron`` or ``~/.cache/remax_megatron``; the hash covers the recipe
constants and ``BUILTIN_VERSION``, so changing a recipe builds a new
directory. Builds happen in a temporary directory beside the target and are
renamed into place under an ``fcntl`` lock, so concurrent callers (several
torchrun ranks) build once and share it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers

from remax_megatron.builtin.agent import evaluate_agent, train_agent
from remax_megatron.builtin.tasks import builtin_task
from remax_megatron.builtin.tiny import make_tiny_model, tiny_config

BUILTIN_VERSION = "3"  # 3: built on one thread (2: on min(2, cores) threads)
MARKER = "remax_builtin.json"  # written last inside the directory: its presence marks a complete build

ARCH = dict(
    family="llama", hidden=128, layers=4, heads=4, kv_heads=2, ffn=256, tie=False
)  # head_dim 32: vLLM CPU runs it
# The dense default's shape with its MLP as 4 experts, 2 per token (Mixtral: Llama's attention, so the
# upcycled model starts as exactly the dense one up to the experts' noise).
MOE_ARCH = dict(ARCH, family="mixtral", options=dict(experts=4, top_k=2))
# The supervised builds' AdamW with warmup then cosine decay, and gradient clipping
OPTIMIZER = dict(lr=3e-3, warmup_frac=0.1, betas=(0.9, 0.98), clip=1.0)
RECIPES = {
    "tiny-arith": dict(
        kind="actor", task="arith", arch=ARCH, seed=0, p_correct=0.25, wrong_offset=1, steps=400, **OPTIMIZER
    ),
    "tiny-arith-moe": dict(
        kind="upcycled", base="tiny-arith", task="arith", arch=MOE_ARCH, seed=0, expert_noise=0.01, router_std=0.02
    ),
    # The tool-using default (configs/tiny_cpu_agent.yaml; builtin/agent.py): tiny-arith's shape, the tokenizer's
    # tool-using variant, supervised to call builtin:calculator a quarter of the time on builtin:multiply.
    "tiny-agent": dict(
        kind="agent",
        task="multiply",
        arch=dict(ARCH, tools=True),
        seed=0,
        p_tool=0.25,
        steps=300,
        batch=32,
        **OPTIMIZER,
    ),
    "tiny-arith-rm": dict(
        kind="reward",
        task="arith",
        arch=ARCH,
        seed=0,
        negatives_per_prompt=1,
        max_answer=19,
        steps=600,
        **OPTIMIZER,
        lm_aux_weight=1.0,
    ),
}
# One thread: the built weights do not depend on the machine's core count (a GEMM's reduction order
# does), and these tiny GEMMs gain nothing from a second thread, which only stalls behind other work
# on a busy machine (both models: 366 s beside the test suite on 2 threads, 85 s alone; 100 actor
# steps alone: 13.8 s on 1 thread, 14.6 s on 2).
BUILD_THREADS = 1


def recipe_hash(name: str) -> str:
    recipe = RECIPES[name]
    base = recipe_hash(recipe["base"]) if "base" in recipe else None  # an upcycled model changes with its base
    blob = json.dumps({"version": BUILTIN_VERSION, "name": name, "recipe": recipe, "base": base}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def default_cache_root() -> str:
    """Where built-in models are cached: $REMAX_CACHE, else $XDG_CACHE_HOME/remax_megatron, else
    ~/.cache/remax_megatron (the XDG default)."""
    if os.environ.get("REMAX_CACHE"):
        return os.environ["REMAX_CACHE"]
    xdg = os.environ.get("XDG_CACHE_HOME")
    # the XDG spec: a relative XDG_CACHE_HOME is invalid and ignored
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "remax_megatron")


def builtin_model_path(name: str, cache_dir: str | None = None) -> str:
    """Where ``ensure_builtin_model`` keeps ``name`` (whether or not it is built yet)."""
    if name not in RECIPES:
        raise ValueError(f"unknown built-in model {name!r}: choose one of {', '.join(RECIPES)}")
    return os.path.join(cache_dir or default_cache_root(), f"{name}-{recipe_hash(name)}")


def is_built(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def ensure_builtin_model(name: str, cache_dir: str | None = None, verbose: bool = True) -> str:
    """The path of the built-in model ``name``, building and caching it first if needed."""
    final = builtin_model_path(name, cache_dir)
    if is_built(final):
        return final
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # transformers' save_pretrained writes only on rank 0 of an initialised process group: a build that
        # another rank wins would leave a directory without its config and weights (startup.prepare_models)
        raise RuntimeError(
            f"built-in model {name} is not built yet and torch.distributed is initialised: build "
            "built-in models before the process group (remax_megatron.startup.prepare_models)"
        )
    root = os.path.dirname(final)
    os.makedirs(root, exist_ok=True)
    with open(final + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also if this process dies)
        try:
            if is_built(final):  # another process built it while we waited
                return final
            if os.path.exists(final):  # an incomplete leftover (should not happen: we rename complete dirs)
                shutil.rmtree(final)
            for entry in os.listdir(root):  # builds killed mid-way (only a lock holder builds: none is live)
                if entry.startswith(f".{os.path.basename(final)}.tmp-"):
                    shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
            tmp = tempfile.mkdtemp(dir=root, prefix=f".{os.path.basename(final)}.tmp-")
            try:
                if verbose:
                    print(
                        f"[remax] building built-in model {name} into {final} (one-time, ~1 min on CPU)",
                        file=sys.stderr,
                        flush=True,
                    )
                info = build_model(name, tmp)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if verbose:
                print(
                    f"[remax] built {name} in {info['build_seconds']:.0f}s: {info['metrics']}",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def read_build_info(path: str) -> dict:
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------- building


@contextlib.contextmanager
def _torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def build_model(name: str, out: str) -> dict:
    """Build ``name`` into the existing empty directory ``out``; returns the info written to MARKER."""
    recipe = RECIPES[name]
    t0 = time.time()
    with _torch_threads(BUILD_THREADS), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])
        make_tiny_model(out, seed=recipe["seed"], **_tiny_args(recipe))
        if recipe["kind"] == "actor":
            model, tok = _train_actor(out, recipe)
            metrics = evaluate_actor(model, tok, recipe["task"])
        elif recipe["kind"] == "agent":
            model, tok = _load(out, "actor")
            train_agent(model, tok, recipe, _fit)
            metrics = evaluate_agent(model, tok, recipe["task"])
        elif recipe["kind"] == "upcycled":
            model, tok = _upcycle(out, ensure_builtin_model(recipe["base"], os.path.dirname(out)), recipe)
            metrics = evaluate_actor(model, tok, recipe["task"])
        else:
            model, tok = _train_reward(out, recipe)
            metrics = evaluate_reward(model, tok, recipe["task"])
        model.save_pretrained(out)
        tok.save_pretrained(out)
    info = dict(
        name=name,
        version=BUILTIN_VERSION,
        recipe_hash=recipe_hash(name),
        recipe=recipe,
        metrics=metrics,
        build_seconds=round(time.time() - t0, 1),
    )
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump(info, f, indent=1)
    return info


def _tiny_args(recipe: dict) -> dict:
    """remax_megatron.builtin.tiny's arguments for a recipe's architecture."""
    a = recipe["arch"]
    return dict(
        family=a["family"],
        hidden=a["hidden"],
        layers=a["layers"],
        heads=a["heads"],
        kv_heads=a["kv_heads"],
        ffn=a["ffn"],
        tie=a["tie"],
        reward=recipe["kind"] == "reward",
        tools=a.get("tools", False),
        **a.get("options", {}),
    )


def builtin_model_spec(name: str, cache_dir: str | None = None) -> str:
    """A directory with the config.json and tokenizer of built-in model ``name`` (no weights):
    what the trainer's input checks read, written in a second, before the build's minute of
    training. The built model's directory when it is already built."""
    final = builtin_model_path(name, cache_dir)
    if is_built(final):
        return final
    spec = final + ".spec"
    if not os.path.isfile(os.path.join(spec, "config.json")):
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(final), prefix=f".{os.path.basename(spec)}.tmp-")
        config, tok, _ = tiny_config(**_tiny_args(RECIPES[name]))
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, spec)
        except OSError:  # another rank put it in place first
            shutil.rmtree(tmp, ignore_errors=True)
    return spec


def _load(out: str, task: str):
    """The built model's HF class for `task` (its family's causal LM or reward architecture)."""
    with open(os.path.join(out, "config.json")) as f:
        cls_name = json.load(f)["architectures"][0]
    assert cls_name.endswith("ForCausalLM" if task == "actor" else "ForSequenceClassification"), cls_name
    model = getattr(transformers, cls_name).from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    return model, tok


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _pad(rows: list[list[int]], value: int):
    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def _lr_at(step: int, recipe: dict) -> float:
    warm = max(1, int(recipe["steps"] * recipe["warmup_frac"]))
    if step < warm:
        return recipe["lr"] * (step + 1) / warm
    return recipe["lr"] * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, recipe["steps"] - warm)))


def _optimizer(model, recipe):
    return torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=tuple(recipe["betas"]), weight_decay=0.0)


def response_logprobs(model, tok, prompts: list[str], responses: list[str]):
    """Sum of log-probs of ``response + </s>`` after each prompt (a tensor, one per pair)."""
    eos = tok.eos_token_id
    ids, labels = [], []
    for p, r in zip(prompts, responses):
        pi, ri = _encode(tok, p), _encode(tok, r) + [eos]
        ids.append(pi + ri)
        labels.append([-100] * len(pi) + ri)
    ids, labels = _pad(ids, tok.pad_token_id), _pad(labels, -100)
    attn = (ids != tok.pad_token_id).long()  # right padding; prompts and answers hold no <pad>
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    tgt = labels[:, 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    return (lp * (tgt != -100)).sum(-1)


def _train_actor(out: str, recipe: dict):
    model, tok = _load(out, "actor")
    model.train()
    train = builtin_task(recipe["task"])["train"]
    prompts = [r["prompt"] for r in train]
    right = [r["answer"] for r in train]
    wrong = [str(int(a) + recipe["wrong_offset"]) for a in right]
    p = recipe["p_correct"]

    def loss():
        lp = response_logprobs(model, tok, prompts + prompts, right + wrong)
        n = len(prompts)
        return -(p * lp[:n] + (1 - p) * lp[n:]).mean()  # exact expected NLL of the p_correct mixture

    _fit(model, recipe, loss)
    return model, tok


@torch.no_grad()
def _upcycle(out: str, dense_dir: str, recipe: dict):
    """The dense model's weights into the MoE model at `out`: attention, norms and embeddings as they are,
    every expert's gate / up / down a copy of the dense MLP's times (1 + expert_noise * N(0, 1)), and the
    router N(0, router_std)."""
    from remax_megatron.models.families import DENSE_MLP, family_named

    model, tok = _load(out, "actor")
    dense = transformers.AutoModelForCausalLM.from_pretrained(dense_dir).state_dict()
    noise, (gate, up, down) = recipe["expert_noise"], DENSE_MLP
    family = family_named(recipe["arch"]["family"])
    moe, prefixes = family.moe, [family.hf_layer(i) for i in range(model.config.num_hidden_layers)]
    routers = {f"{p}{moe.model_router}.weight" for p in prefixes}
    # transformers' fused experts [E, ...] of each layer <- the dense layer's [gate; up] and down
    experts = {
        **{f"{p}{moe.model_gate_up}": (f"{p}{gate}", f"{p}{up}") for p in prefixes},
        **{f"{p}{moe.model_down}": (f"{p}{down}",) for p in prefixes},
    }
    for name, param in model.named_parameters():
        if name in routers:
            param.normal_(0.0, recipe["router_std"])
        elif name in experts:
            source = torch.cat([dense[k] for k in experts[name]])
            param.copy_(source.expand_as(param) * (1 + noise * torch.randn(param.shape)))
        else:
            param.copy_(dense[name])
    model.eval()
    return model, tok


def _fit(model, recipe: dict, loss_fn) -> None:
    """The warm-start loop of both built-in models: per-step LR, loss_fn(), clipped AdamW step."""
    opt = _optimizer(model, recipe)
    for step in range(recipe["steps"]):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, recipe)
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["clip"])
        opt.step()
    model.eval()


def _reward_scores(model, ids):
    """(scores at the last non-pad token, hidden states), as LlamaForSequenceClassification scores."""
    attn = (ids != model.config.pad_token_id).long()
    h = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
    last = (torch.arange(ids.shape[1]) * attn).argmax(-1)
    return model.score(h)[torch.arange(len(ids)), last, 0].float(), h


def _wrong_answer(a: int, gen, max_answer: int) -> int:
    u = torch.rand((), generator=gen).item()
    side = torch.rand((), generator=gen).item() < 0.5
    if u < 0.5:
        return a + 1 if side or a == 0 else a - 1
    if u < 0.7:
        return a + 2 if side or a < 2 else a - 2
    v = a
    while v == a:
        v = int(torch.randint(0, max_answer + 1, (), generator=gen))
    return v


def _train_reward(out: str, recipe: dict):
    model, tok = _load(out, "reward")
    model.train()
    train = builtin_task(recipe["task"])["train"]
    gen = torch.Generator().manual_seed(recipe["seed"])
    eos, k, n = tok.eos_token_id, recipe["negatives_per_prompt"], len(train)
    plen = len(_encode(tok, train[0]["prompt"]))
    assert all(len(_encode(tok, r["prompt"])) == plen for r in train)
    good = [_encode(tok, r["prompt"] + r["answer"]) + [eos] for r in train]

    def loss():
        bad = [
            _encode(tok, r["prompt"] + str(_wrong_answer(int(r["answer"]), gen, recipe["max_answer"]))) + [eos]
            for _ in range(k)
            for r in train
        ]
        ids = _pad(good + bad, tok.pad_token_id)
        scores, h = _reward_scores(model, ids)
        target = torch.cat([torch.ones(n), torch.zeros(n * k)])
        weight = torch.cat([torch.ones(n), torch.full((n * k,), 1.0 / k)])
        mse = (weight * (scores - target) ** 2).sum() / weight.sum()
        # auxiliary LM loss on the correct answers via the tied embedding: teaches the backbone to add
        logits = h[:n, plen - 1 : -1] @ model.model.embed_tokens.weight.T
        tgt = ids[:n, plen:]
        return mse + recipe["lm_aux_weight"] * F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), ignore_index=tok.pad_token_id
        )

    _fit(model, recipe, loss)
    return model, tok


# --------------------------------------------------------------------------------------------- evaluation


def greedy_answers(model, tok, prompts: list[str], max_new_tokens: int = 4) -> list[str | None]:
    """Greedy continuation of each prompt; the text before </s>, or None if no </s> within the budget."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = _encode(tok, p)
            new = []
            for _ in range(max_new_tokens):
                nxt = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
            else:
                out.append(None)
                continue
            out.append(tok.decode(new))
    return out


def sample_answers(
    model, tok, prompts: list[str], seed: int = 0, temperature: float = 1.0, max_new_tokens: int = 4
) -> list[str | None]:
    """One temperature sample per prompt (batched, seeded), as greedy_answers."""
    gen = torch.Generator().manual_seed(seed)
    rows = [_encode(tok, p) for p in prompts]
    assert len({len(r) for r in rows}) == 1, "sample_answers needs prompts of one length"
    ids = torch.tensor(rows)
    done = torch.zeros(len(rows), dtype=torch.bool)
    texts = [[] for _ in rows]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids).logits[:, -1].float() / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    if t == tok.eos_token_id:
                        done[i] = True
                    else:
                        texts[i].append(t)
            ids = torch.cat([ids, nxt[:, None]], 1)
    return [tok.decode(t) if d else None for t, d in zip(texts, done.tolist())]


def evaluate_actor(model, tok, task: str = "arith", split: str = "eval") -> dict:
    """greedy exact match, exact P(correct answer + </s>) (= expected T=1 sampled accuracy), P(a+b+1)."""
    recs = builtin_task(task)[split]
    prompts, answers = [r["prompt"] for r in recs], [r["answer"] for r in recs]
    greedy = greedy_answers(model, tok, prompts)
    with torch.no_grad():
        p_right = response_logprobs(model, tok, prompts, answers).exp()
        p_wrong = response_logprobs(model, tok, prompts, [str(int(a) + 1) for a in answers]).exp()
    return dict(
        split=split,
        greedy_acc=sum(g == a for g, a in zip(greedy, answers)) / len(recs),
        p_correct=round(p_right.mean().item(), 4),
        p_off_by_one=round(p_wrong.mean().item(), 4),
    )


def reward_scores(model, tok, prompts: list[str], responses: list[str]):
    """RM scores of ``prompt + response + </s>`` through the model's own HF forward."""
    ids = _pad([_encode(tok, p + r) + [tok.eos_token_id] for p, r in zip(prompts, responses)], tok.pad_token_id)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long()).logits[:, 0].float()


def evaluate_reward(model, tok, task: str = "arith", split: str = "eval", max_answer: int = 19) -> dict:
    """Mean score of correct vs wrong (every other 0..max_answer) and off-by-one answers, and pair ranking."""
    recs = builtin_task(task)[split]
    vals = list(range(max_answer + 1))
    prompts = [r["prompt"] for r in recs for _ in vals]
    sc = reward_scores(model, tok, prompts, [str(v) for _ in recs for v in vals]).view(len(recs), len(vals))
    right = torch.tensor([int(r["answer"]) for r in recs])
    is_right = torch.arange(len(vals))[None] == right[:, None]
    c, w = sc[is_right], sc[~is_right].view(len(recs), -1)
    off = sc[torch.arange(len(recs)), right + 1]
    return dict(
        split=split,
        correct=round(c.mean().item(), 4),
        wrong=round(w.mean().item(), 4),
        off_by_one=round(off.mean().item(), 4),
        gap=round((c.mean() - w.mean()).item(), 4),
        gap_off_by_one=round((c.mean() - off.mean()).item(), 4),
        pair_rank_acc=round((c[:, None] > w).float().mean().item(), 4),
    )


def resolve_model(spec: str, what: str, build: bool = True) -> str:
    """A model directory, or `builtin:<name>` (built offline and cached on first use).

    build=False: for a built-in model, a directory with its config and tokenizer only (the input
    checks read those; nothing is trained before every check has passed)."""
    if not spec:
        raise ValueError(f"{what} is empty: give a Hugging Face model directory or builtin:tiny-arith")
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        return ensure_builtin_model(name) if build else builtin_model_spec(name)
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"{what}={spec}: no such directory")
    return spec
