"""Reward functions written for TRL's GRPOTrainer, unchanged (its docs' conventions), for the tests: imported
by name (`tests.reward.trl_rewards:<fn>`) in this process and in training processes.

`calls` records what each got (in the process that called it)."""

calls: list[dict] = []


def _content(completion):
    """TRL: a completion is a string, or [{"role": "assistant", "content": ...}] for conversational data."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def accuracy(completions, answer, **kwargs):
    """TRL style with a dataset column by name and **kwargs (prompts, completion_ids, other columns)."""
    calls.append({"completions": completions, "answer": answer, **kwargs})
    return [1.0 if _content(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    """TRL style, completions only."""
    return [-len(_content(c)) / 100 for c in completions]


def maybe(completions, answer, **kwargs):
    """Returns None where it does not apply (TRL: no gold answer to compare with)."""
    return [None if a is None else float(_content(c).strip() == a) for c, a in zip(completions, answer)]


def named_only(prompts, completions):
    """No **kwargs: gets only the keywords it names."""
    return [float(len(p) > 0) for p, _ in zip(prompts, completions)]


def one_value(completions, **kwargs):
    return [1.0]


def text_values(completions, **kwargs):
    return ["1.0" for _ in completions]


def typo(completion, answer, **kwargs):
    """`completion` for `completions`: not TRL's convention, so it is called as this project's
    f(prompts, responses, **columns), and `answer` arrives twice."""
    return [0.0 for _ in completion]
