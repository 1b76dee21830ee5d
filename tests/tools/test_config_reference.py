"""docs/config.md is what tools/config_reference.py writes from the config knobs now (so a knob added, removed
or re-documented without regenerating it fails here), and it lists every key --help lists."""

from remax_megatron.config import all_keys
from tools.config_reference import COMMAND, DOC, render


def test_docs_config_md_is_generated_from_the_current_knobs():
    with open(DOC) as f:
        written = f.read()
    assert written == render(), (
        f"docs/config.md is out of date with remax_megatron/config.py: run `{COMMAND}` and commit docs/config.md"
    )


def test_every_key_of_help_has_a_row():
    text = render()
    missing = [k for k in all_keys() if f"| `{k}` |" not in text]
    assert not missing, missing
