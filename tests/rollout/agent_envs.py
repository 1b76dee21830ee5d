"""Environments for the multi-turn tests (rollout.env=tests.rollout.agent_envs:<Name>)."""

import threading
import time


class CounterEnv:
    """Answers each turn with a counter (" #1 ", " #2 ", ...); ends when the turn's text holds the keyword "end"
    or after `turns` turns. reward(): the fraction of turns whose text is the row's answer."""

    turns = 3

    def __init__(self, answer=None, **_columns):
        self.answer, self.count, self.correct = answer, 0, 0

    def step(self, text):
        self.count += 1
        self.correct += self.answer is not None and text.strip() == str(self.answer).strip()
        return f" #{self.count} ", "end" in text or self.count >= self.turns

    def reward(self):
        return self.correct / max(self.count, 1)


class RecordingEnv(CounterEnv):
    """CounterEnv that records every environment built and every call, in one list for the test to read."""

    log: list = []
    lock = threading.Lock()

    def __init__(self, **columns):
        super().__init__(**columns)
        with self.lock:
            self.id = len([e for e in self.log if e[0] == "init"])
            self.log.append(("init", self.id, dict(columns)))

    def step(self, text):
        with self.lock:
            self.log.append(("step", self.id, text))
        return super().step(text)


class NoRewardEnv:
    """Two turns, no reward(): the configured reward functions score the transcript."""

    def __init__(self, **_):
        self.count = 0

    def step(self, text):
        self.count += 1
        return "\n", self.count >= 2


class FlakyEnv(CounterEnv):
    """Raises in step() on its second turn when the row's answer is odd; hangs past any limit when it is 8."""

    def step(self, text):
        if self.count == 1 and self.answer is not None and int(self.answer) % 2:
            raise RuntimeError("tool crashed")
        if self.count == 1 and str(self.answer) == "8":
            time.sleep(5)
        return super().step(text)


class ResetEnv(CounterEnv):
    """Starts from its own first message instead of the row's prompt."""

    def reset(self):
        return f"add: {self.answer}"


class NotAnEnv:
    """Has no step()."""


def turns_reward(prompts, responses, env=None, **_):
    """A reward function that reads each trajectory's environment (rollout.env without reward()): its turns."""
    return [float(e.count) for e in env]


class BadReplyEnv(CounterEnv):
    """Replies with something that is not a message on odd answers, a role the template cannot render on 8."""

    def step(self, text):
        _, done = super().step(text)
        if self.answer is not None and int(self.answer) % 2:
            return [1, 2, {"content": None}], done
        if str(self.answer) == "8":
            return [{"role": "tool", "content": "x" * 10}], done
        return " ok ", done
