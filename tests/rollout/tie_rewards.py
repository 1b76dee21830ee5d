"""A reward for the dynamic-sampling tests: every response of a prompt whose answer is odd scores 0 (its
samples all tie its greedy response: no signal); other responses score their length in characters."""


def ties_on_odd_answers(prompts, responses, answer, **_):
    return [0.0 if int(a) % 2 else float(len(r)) for r, a in zip(responses, answer)]
