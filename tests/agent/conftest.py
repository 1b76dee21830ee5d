"""The rollout tests' tiny models (tests/rollout/conftest.py) for the agent tests too."""

from tests.rollout.conftest import tiny_llama  # noqa: F401  (fixture)
