"""reward/overlong.py: DAPO's soft overlong penalty against hand-computed values (fp64), the same for the
greedy response as for the samples."""

import pytest

from remax_megatron.reward.overlong import overlong_shaping, shape_rewards


@pytest.mark.parametrize(
    "length,want",
    [
        (1, 0.0),
        (12, 0.0),  # up to max_new_tokens - buffer = 12: no penalty
        (13, -0.5 * 1 / 4),
        (14, -0.5 * 2 / 4),
        (15, -0.5 * 3 / 4),
        (16, -0.5),  # at the limit: the whole penalty
    ],
)
def test_overlong_shaping_is_linear_over_the_buffer(length, want):
    assert overlong_shaping(length, max_new_tokens=16, buffer=4, penalty=0.5) == pytest.approx(want, abs=1e-15)


def test_no_buffer_no_shaping():
    assert overlong_shaping(64, max_new_tokens=64, buffer=0, penalty=1.0) == 0.0


def test_samples_and_greedy_are_shaped_alike():
    # one prompt: two samples and the greedy response (last), two of them in the buffer
    scores = [[1.0, 0.0, 1.0]]
    lengths = [[16, 10, 14]]
    shaped, penalties = shape_rewards(scores, lengths, max_new_tokens=16, buffer=4, penalty=1.0)
    assert shaped == [[0.0, 0.0, 0.5]] and penalties == [-1.0, 0.0, -0.5]
    # a sample and the greedy response of equal length and reward still tie after shaping (advantage 0)
    shaped, _ = shape_rewards([[1.0, 1.0]], [[15, 15]], max_new_tokens=16, buffer=4, penalty=1.0)
    assert shaped[0][0] == shaped[0][1]


def test_a_buffer_longer_than_the_limit_is_refused_in_one_line():
    from remax_megatron.config import load_config

    with pytest.raises(ValueError, match=r"reward.overlong_buffer=80 is longer than rollout.max_new_tokens=64") as e:
        load_config(None, ["reward.functions=[exact_match]", "reward.overlong_buffer=80"])
    assert "\n" not in str(e.value)
