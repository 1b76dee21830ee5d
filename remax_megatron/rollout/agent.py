"""Multi-turn rollouts through an environment (rollout.env): ReMax over trajectories.

    dispatch = AgentDispatch(engine, groups, cfg.rollout, seed, tokenizer, load_env(cfg.rollout.env))
    rollouts = dispatch.collect(dispatch.submit(prompts, n, step))   # as RolloutDispatch: n sampled + 1 greedy

The environment contract (`rollout.env=package.module:Factory`): `Factory(**row_columns)` is called once per
trajectory with the dataset row's columns (answer, ...), so the greedy trajectory and the n sampled ones of a
prompt start from equal environments. Its instance has
    reset() -> str | list[dict] | None      optional: the first message(s) (None or absent: the row's prompt)
    step(text) -> (str | list[dict] | None, done)
                                            the assistant turn's text -> the next message(s) (user or tool
                                            turns; a str is a user turn) and whether the episode is over
    reward() -> float                       optional: the trajectory's reward; without it the configured
                                            reward functions score the trajectory's text
    special_tokens: bool                    optional (False): step() gets the turn's text with the tokenizer's
                                            special tokens kept (a tool-call marker that is one, end of turn)
An exception in step() / reward(), or a call past rollout.env_timeout_s, ends that trajectory ("env_error",
counted in agent/env_errors), never the run; its reward is then reward.timeout_value when reward() fails.

Token in, token out: a trajectory is one token sequence. Turn 1 is the single-turn request (n sampled + 1
greedy per prompt, `RolloutEngine.generate`); every later turn continues each running trajectory from its exact
ids so far (`RolloutEngine.generate_rows`: one request per turn, greedy rows at temperature 0 in it), so
generated text is never re-tokenized. An observation's tokens are the chat template's rendering of the new
message(s), appended as a token delta (`ChatDelta`); earlier turns are never re-rendered. Generated tokens get
loss_mask 1, observation and template glue 0 (batching.pad_sequences leaves them out of the loss).

Bounds: rollout.max_turns, rollout.max_new_tokens (per turn), rollout.max_total_tokens (prompt + trajectory).
A trajectory ends as `done` (the environment said so), `max_turns`, `max_total` (no room for the next
observation and one token), or `env_error`. A turn cut at max_new_tokens still goes to the environment.
Every rank of the training world runs the same number of turns (the engine's ranks decode in lockstep), with
no rows once its own trajectories have ended.
"""

from __future__ import annotations

import functools
import importlib
import pickle
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from remax_megatron.parallel import all_reduce_cpu
from remax_megatron.rollout.dispatch import RolloutDispatch, contiguous_share
from remax_megatron.rollout.engine import Completion, PromptRollout, SamplingParams, stream_seed

FINISHES = ("done", "max_turns", "max_total", "env_error")


def load_env(spec: str):
    """The factory named by rollout.env (`package.module:Name`); one-line ValueErrors."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"rollout.env={spec!r} must be package.module:Factory (a class or a function)")
    try:
        factory = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.env={spec!r}: cannot import it ({type(e).__name__}: {e})") from None
    if not callable(factory):
        raise ValueError(f"rollout.env={spec!r} is a {type(factory).__name__}, not a class or function")
    if isinstance(factory, type) and not callable(getattr(factory, "step", None)):
        raise ValueError(f"rollout.env={spec!r} has no step(text) method: see docs/guide.md, Environments")
    return factory


def check_env_reward(cfg, factory) -> None:
    """Without reward.functions or reward.model the environment's reward() is the reward: it must have one."""
    if not cfg.reward.functions and not cfg.reward.model and not callable(getattr(factory, "reward", None)):
        raise ValueError(
            f"{f'rollout.env={cfg.rollout.env!r}' if cfg.rollout.env else 'rollout.tools'} has no reward() method and "
            "no reward.functions or reward.model is set: give the environment a reward() or configure a reward"
        )


@dataclass
class Trajectory(Completion):
    """A multi-turn completion: token_ids are everything after the prompt (generated and observation tokens),
    logprobs 0 and loss_mask 0 on observations."""

    turns: int = 0  # assistant turns generated
    finish: str = ""  # one of FINISHES
    turn_finishes: list[str] = field(default_factory=list)  # each turn's engine finish: stop | length
    messages: list[dict] = field(default_factory=list)  # assistant turns and observations, in order
    observation_tokens: int = 0  # tokens not generated (observations and template glue)
    env_reward: float | None = None  # the environment's reward(), when it has one
    env: object = field(default=None, repr=False, compare=False)  # the environment (reward functions get it)
    error: str = ""  # what ended it with env_error
    tool_calls: int = 0  # rollout.tools: calls the model made, and those that gave it an error text
    tool_errors: int = 0
    tool_seconds: float = 0.0  # time in its tool calls (a turn's calls run side by side: summed per call)

    def __getstate__(self) -> dict:
        """Gathered over the model-parallel group: the environment travels only when reward functions need it
        (no reward() of its own); it must then pickle."""
        state = dict(self.__dict__)
        if self.env_reward is not None:
            state["env"] = None
        return state


class ChatDelta:
    """Observation messages -> the tokens that follow an assistant turn, from the chat template.

    With a template: the closing glue of the assistant turn the model did not generate itself (e.g. the "\\n"
    after "<|im_end|>", or the whole closing when the turn was cut at max_new_tokens), the new messages, and
    the generation prompt of the next assistant turn. Without one (a base model): the messages' text as it is."""

    PROBE = [{"role": "user", "content": "PROBE_Q"}, {"role": "assistant", "content": "PROBE_A"}]

    def __init__(self, tokenizer, templated: bool = True):
        """templated: data.chat_template (prompts rendered by the template: observations are too)."""
        self.tokenizer = tokenizer
        self.templated = templated and getattr(tokenizer, "chat_template", None) is not None
        if self.templated:
            base = self._render(self.PROBE, False)
            start = base.rfind("PROBE_A")
            if start < 0:
                raise ValueError("the chat template does not render an assistant turn's content as it is")
            self.closing = base[start + len("PROBE_A") :]  # e.g. "<|im_end|>\n"

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def initial(self, messages: str | list[dict]) -> list[int]:
        """reset()'s first message(s) -> the prompt's token ids."""
        if not self.templated:
            return self.tokenizer.encode(_text(messages))
        return self.tokenizer.encode(self._render(_as_messages(messages), True), add_special_tokens=False)

    def observation(self, messages: str | list[dict], last_turn: list[int], stopped: bool = True) -> list[int]:
        """The token delta after an assistant turn whose tokens were `last_turn` (`stopped`: it ended on its
        own end token or a stop, not at max_new_tokens)."""
        if not self.templated:
            return self.tokenizer.encode(_text(messages), add_special_tokens=False)
        # Only what follows the turn's content counts: a template may re-render what comes before it once a
        # message follows (Qwen3 drops the empty think block of a turn that is no longer the last), but the
        # trajectory keeps the tokens the model generated, never a re-rendering of them.
        full = self._render(self.PROBE + _as_messages(messages), True)
        after = full.find("PROBE_A") + len("PROBE_A")
        if after < len("PROBE_A") or not full.startswith(self.closing, after):
            raise ValueError("the chat template ends an assistant turn differently once a message follows it")
        closing = self.closing
        if stopped:  # the model generated the start of the closing itself (its end-of-turn token): the rest
            tail = self.tokenizer.decode(last_turn[-32:], skip_special_tokens=False)
            closing = closing[next((k for k in range(len(closing), 0, -1) if tail.endswith(closing[:k])), 0) :]
        return self.tokenizer.encode(closing + full[after + len(self.closing) :], add_special_tokens=False)


def _bad_observation(observation) -> str:
    """What is wrong with step()'s message(s) ("" when nothing): None, a string, or {role, content} dicts."""
    if observation is None or isinstance(observation, str):
        return ""
    if isinstance(observation, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content", ""), str)
        for m in observation
    ):
        return ""
    return f"step() returned {observation!r:.200} as its message(s): give a string, None or {{role, content}} dicts"


def _as_messages(messages: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)


def _text(messages: str | list[dict]) -> str:
    return messages if isinstance(messages, str) else "".join(str(m.get("content", "")) for m in messages)


class _Running:
    """One trajectory while it runs."""

    def __init__(self, env, prompt_ids: list[int], greedy: bool, seed: int):
        self.env, self.prompt_ids, self.greedy, self.seed = env, prompt_ids, greedy, seed
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.t = Trajectory(token_ids=[], logprobs=[], finish_reason="stop")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    def end(self, finish: str, error: str = "") -> None:
        self.t.finish, self.t.error = finish, error

    def trajectory(self) -> Trajectory:
        t = self.t
        t.token_ids, t.logprobs, t.loss_mask, t.env = self.ids, self.logprobs, self.mask, self.env
        t.tool_calls, t.tool_errors = getattr(self.env, "tool_calls", 0), getattr(self.env, "tool_errors", 0)
        t.tool_seconds = getattr(self.env, "tool_seconds", 0.0)
        t.observation_tokens = len(self.mask) - sum(self.mask)
        # a trajectory cut by a bound reads as cut (trainer.mask_truncated): its last turn ran out, or its total
        t.finish_reason = "length" if t.finish == "max_total" or t.turn_finishes[-1:] == ["length"] else "stop"
        return t


class AgentDispatch(RolloutDispatch):
    """RolloutDispatch whose rollouts are trajectories through the environment (module docstring)."""

    def __init__(
        self, engine, groups, rollout_cfg, seed: int, tokenizer, factory, error_reward: float = 0.0, templated=True
    ):
        super().__init__(engine, groups, rollout_cfg, seed)
        self.factory, self.chat, self.error_reward = factory, ChatDelta(tokenizer, templated), error_reward
        self.tokenizer = tokenizer
        self.env_seconds = 0.0  # time in the environment's calls for the last collect (time/env_s)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="remax-env")

    def submit(self, prompts: list, n: int, step: int, first_index: int = 0):
        """Run this replica's trajectories to their end (a local loop: turns wait on the engine), each
        model-parallel rank its contiguous share; `collect` gathers them."""
        groups = self.groups
        lo, hi = contiguous_share(len(prompts), groups.mp_size, groups.mp_rank)
        first = first_index + groups.dp_rank * len(prompts) + lo  # this share's first prompt in the step
        return self._run(prompts[lo:hi], n, step, first)

    def _local(self, ticket) -> list:
        return ticket  # submit ran the trajectories

    def _gather(self, rollouts: list) -> list:
        try:
            return super()._gather(rollouts)
        except (TypeError, AttributeError, pickle.PicklingError) as e:
            raise ValueError(
                f"rollout.env={self.rollout_cfg.env!r}: its environments cannot be pickled ({e}); without a "
                "reward() of their own they go to the reward functions on every model-parallel rank: make "
                "them picklable or give them reward()"
            ) from None

    # ---- the turn loop -------------------------------------------------------------------
    def _run(self, prompts: list, n: int, step: int, first: int) -> list[PromptRollout]:
        cfg, self.env_seconds = self.rollout_cfg, 0.0
        sampling = SamplingParams.from_config(cfg)
        rows: list[_Running] = []
        starts = []
        seeds = [stream_seed(self.seed, step, first + i) for i in range(len(prompts))]  # as RolloutDispatch's
        for q, seed in zip(prompts, seeds):
            envs = self._call_all([lambda q=q: self.factory(**q.columns) for _ in range(n + 1)], "the factory")
            starts.append(self._start(q, envs))
            for j, env in enumerate(envs):
                rows.append(_Running(env, starts[-1], greedy=j == n, seed=seed + j))
        # turn 1: the single-turn request (one prefill per prompt, n sampled + 1 greedy); every rank calls it
        turn = self.engine.generate(starts, n=n, sampling=sampling, seeds=seeds)
        self._after_turn(rows, [c for r in turn for c in r.sampled + [r.greedy]])
        for t in range(2, cfg.max_turns + 1):
            running = [r for r in rows if not r.t.finish]
            if not _anyone(bool(running)):
                break
            limits = [min(cfg.max_new_tokens, cfg.max_total_tokens - r.length) for r in running]
            completions = self.engine.generate_rows(
                [r.prompt_ids + r.ids for r in running],
                [r.greedy for r in running],
                sampling,
                [stream_seed(r.seed, t) for r in running],
                limits,
            )
            self._after_turn(running, completions)
        self._rewards(rows)
        per = n + 1
        return [
            PromptRollout(
                sampled=[r.trajectory() for r in rows[p * per : p * per + n]],
                greedy=rows[p * per + n].trajectory(),
                prompt_ids=starts[p] if starts[p] is not prompts[p].token_ids else None,
            )
            for p in range(len(prompts))
        ]

    def _start(self, prompt, envs: list) -> list[int]:
        """The trajectories' first context: reset()'s message(s) rendered, equal for every environment of the
        prompt, or the row's prompt."""
        if not callable(getattr(envs[0], "reset", None)):
            return prompt.token_ids
        first = self._call_all([env.reset for env in envs], "reset()")
        if any(m != first[0] for m in first):
            raise ValueError(
                f"rollout.env: reset() gave different first messages for prompt {prompt.index}'s environments: "
                "equal rows must start equal (seed any randomness from the row)"
            )
        return prompt.token_ids if first[0] is None else self.chat.initial(first[0])

    def _after_turn(self, rows: list[_Running], completions: list[Completion]) -> None:
        """Each row's new turn appended; the environment's step() on its text; the row's next observation
        appended, or its end recorded."""
        cfg = self.rollout_cfg
        texts = []
        for r, c in zip(rows, completions, strict=True):
            r.add(list(c.token_ids), list(c.logprobs))
            r.t.turns += 1
            r.t.turn_finishes.append(c.finish_reason)
            r.t.messages.append(
                {"role": "assistant", "content": self.tokenizer.decode(c.token_ids, skip_special_tokens=True)}
            )
            keep = getattr(r.env, "special_tokens", False)  # e.g. Mistral's [TOOL_CALLS] (rollout.tool_parser)
            texts.append(
                self.tokenizer.decode(c.token_ids, skip_special_tokens=False) if keep else r.t.messages[-1]["content"]
            )
        results = self._call_each([lambda r=r, x=x: r.env.step(x) for r, x in zip(rows, texts)])
        for r, c, (ok, result) in zip(rows, completions, results):
            if ok and not (isinstance(result, tuple) and len(result) == 2):
                ok, result = False, f"step() returned {result!r:.200}: return (next message(s) or None, done)"
            elif ok and _bad_observation(result[0]):
                ok, result = False, _bad_observation(result[0])
            if not ok:
                r.end("env_error", result)
                continue
            observation, done = result[0], bool(result[1])
            if observation is not None:
                r.t.messages += _as_messages(observation)
            if done:
                r.end("done")
            elif r.t.turns >= cfg.max_turns:
                r.end("max_turns")
            elif observation is not None:
                try:
                    delta = self.chat.observation(observation, list(c.token_ids), c.finish_reason == "stop")
                except Exception as e:  # noqa: BLE001 - what the environment said, the template cannot render
                    r.end("env_error", f"the chat template cannot render step()'s message(s): {type(e).__name__}: {e}")
                    continue
                if r.length + len(delta) + 1 > cfg.max_total_tokens:  # no room for it and one generated token
                    r.end("max_total")
                else:
                    r.add(delta, None)
            elif r.length + 1 > cfg.max_total_tokens:
                r.end("max_total")

    def _rewards(self, rows: list[_Running]) -> None:
        """The environment's reward() where it has one (a failure: env_error, reward.timeout_value)."""
        scored = [r for r in rows if callable(getattr(r.env, "reward", None))]
        for r, (ok, value) in zip(scored, self._call_each([r.env.reward for r in scored])):
            if ok and isinstance(value, (int, float)) and value == value:
                r.t.env_reward = float(value)
            else:
                r.t.env_reward = self.error_reward
                r.end("env_error", value if not ok else f"reward() returned {value!r}, not a number")

    # ---- calls into the environment --------------------------------------------------------
    def _call_each(self, calls: list) -> list[tuple[bool, object]]:
        """Every call at once in the thread pool, all under one rollout.env_timeout_s from now: (True, result)
        or (False, error). A call past the limit is left running (a thread cannot be killed: issue 42's sandbox
        runs model-written code in processes); its trajectory ends."""
        start = time.perf_counter()
        futures = [self._pool.submit(call) for call in calls]
        limit = self.rollout_cfg.env_timeout_s or None
        wait(futures, timeout=limit)
        out = []
        for f in futures:
            if not f.done():
                f.cancel()  # not started yet (the pool was full): never runs
                out.append((False, f"timed out after {limit} s"))
            elif f.exception() is not None:  # any failure of the environment ends its trajectory only
                out.append((False, f"{type(f.exception()).__name__}: {f.exception()}"))
            else:
                out.append((True, f.result()))
        self.env_seconds += time.perf_counter() - start
        return out

    def _call_all(self, calls: list, what: str) -> list:
        """Calls that must all succeed (building the environments, reset()): a failure stops the run."""
        results = self._call_each(calls)
        for ok, result in results:
            if not ok:
                raise ValueError(f"rollout.env={self.rollout_cfg.env!r}: {what} failed: {result}")
        return [result for _, result in results]


def _anyone(flag: bool) -> bool:
    """Whether any rank of the training world has `flag` (every rank runs the same number of turns)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    return bool(all_reduce_cpu(torch.tensor([int(flag)], dtype=torch.int64), op=dist.ReduceOp.MAX).item())


def trajectory_stats(rollouts: list) -> dict[str, float]:
    """Sums over this rank's trajectories (sampled and greedy): count, turns, observation tokens, tool calls,
    errors and seconds, and each finish (step_metrics turns them into agent/* means over every DP rank)."""
    out = {"count": 0.0, "turns": 0.0, "observation_tokens": 0.0, "tool_calls": 0.0, "tool_errors": 0.0}
    out["tool_seconds"] = 0.0
    out.update({f: 0.0 for f in FINISHES})
    for r in rollouts:
        for t in r.sampled + [r.greedy]:
            if isinstance(t, Trajectory):
                out["count"] += 1
                out["turns"] += t.turns
                out["observation_tokens"] += t.observation_tokens
                out["tool_calls"] += t.tool_calls
                out["tool_errors"] += t.tool_errors
                out["tool_seconds"] += t.tool_seconds
                out[t.finish] += 1
    return out


def env_factory_of(cfg):
    """The environment of every trajectory: rollout.env's factory, or rollout.tools' ToolEnv over the tools."""
    if not cfg.rollout.tools:
        return load_env(cfg.rollout.env)
    from remax_megatron.agent.tool_env import PARSERS, ToolEnv
    from remax_megatron.agent.tools import resolve_tools

    if cfg.rollout.tool_parser not in PARSERS:
        raise ValueError(f"rollout.tool_parser={cfg.rollout.tool_parser!r} is not one of {sorted(PARSERS)}")
    tools = resolve_tools(cfg.rollout.tools)
    return functools.partial(
        ToolEnv,
        tools=tools,
        parser=cfg.rollout.tool_parser,
        timeout_s=cfg.rollout.tool_timeout_s,
        max_output_chars=cfg.rollout.tool_max_output_chars,
    )


def make_dispatch(cfg, engine, groups, tokenizer) -> RolloutDispatch:
    """The step's dispatch: trajectories through rollout.env or rollout.tools, or single-turn rollouts."""
    if not cfg.rollout.multi_turn:
        return RolloutDispatch(engine, groups, cfg.rollout, seed=cfg.trainer.seed)
    factory = env_factory_of(cfg)
    return AgentDispatch(
        engine,
        groups,
        cfg.rollout,
        cfg.trainer.seed,
        tokenizer,
        factory,
        cfg.reward.timeout_value,
        templated=cfg.data.chat_template,
    )


def compact(completion) -> str:
    """A trajectory in one line for the console's eval samples: its turns and observations joined by " | "
    ("" for a single-turn completion)."""
    if not isinstance(completion, Trajectory):
        return ""
    return " | ".join(str(m.get("content", "")).strip() for m in completion.messages) + f"  [{completion.finish}]"


def scored_text(completion, tokenizer, turns: str = "all") -> str:
    """What reward.functions score for a completion: its decoded tokens; for a trajectory with reward.turns=last,
    its final assistant turn only (the transcript holds the observations too: a tool's printed result would
    otherwise pass for the model's answer)."""
    if turns == "last" and isinstance(completion, Trajectory):
        return next(m["content"] for m in reversed(completion.messages) if m["role"] == "assistant")
    return tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def env_columns(rollouts: list) -> list[list[dict]] | None:
    """Per prompt, per trajectory (samples then greedy) {"env": its environment}, for reward functions that
    score trajectories (an environment without reward()); None for single-turn rollouts."""
    if not rollouts or not isinstance(rollouts[0].greedy, Trajectory):
        return None
    return [[{"env": t.env} for t in r.sampled + [r.greedy]] for r in rollouts]


def env_scores(rollouts: list) -> list[list[float]] | None:
    """Per prompt the rewards of its sampled trajectories then its greedy one, from the environment's reward();
    None when the environment has none (the reward functions score the trajectories' text)."""
    if not rollouts or getattr(rollouts[0].greedy, "env_reward", None) is None:
        return None
    return [[t.env_reward for t in r.sampled + [r.greedy]] for r in rollouts]
