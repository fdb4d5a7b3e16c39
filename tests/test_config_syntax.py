"""The run-config syntax: what ``format_overrides`` writes ``flwr run`` reads back, option
strings nest without escapes, and every ``dpfl run`` line a report prints parses to its run."""

from __future__ import annotations

import shlex

import pytest

from dpfl.config import format_options, format_overrides, parse_options, parse_overrides
from dpfl_reproductions import adaptive, pcdp, prisma
from dpfl_reproductions.selection import command


@pytest.mark.parametrize("text, expected", [
    ('num_train=500 scaling="unit"', {"num_train": 500, "scaling": "unit"}),
    ("scaling='unit' duplicate=3", {"scaling": "unit", "duplicate": 3}),
    ("scaling=unit bias=false hidden=512 lr=0.5",
     {"scaling": "unit", "bias": False, "hidden": 512, "lr": 0.5}),
    ('name="two words"', {"name": "two words"}),
])
def test_option_strings_take_bare_or_quoted_words_and_read_back(text, expected):
    assert parse_options(text) == expected
    assert parse_options(format_options(expected)) == expected


@pytest.mark.parametrize("text", ["num_public", "=3", 'scaling="unit'])
def test_an_option_string_that_is_not_key_value_pairs_is_refused(text):
    with pytest.raises(ValueError):
        parse_options(text)


def test_a_string_holding_double_quotes_reaches_flower_as_a_literal_string():
    values = {"dataset-options": 'num_train=5 scaling="unit"', "clip": 0.5, "seed": 3,
              "secure-noise": False, "algorithm": "dpsgd-gc"}
    assert parse_overrides(format_overrides(values)) == values
    with pytest.raises(ValueError, match="one kind of quote"):
        format_overrides({"run-name": "it's \"x\""})


def test_every_printed_run_line_parses_to_the_run_it_names():
    """The lines reports print for runs whose option strings hold quoted words."""
    configs = [pcdp.config_of(pcdp.SETTINGS[name], "pcdp-sgd" if name.startswith("c")
                              else "fedpcdp", 6.0, 0, "code") for name in pcdp.SETTINGS
               if name != "noniid"]
    configs.append({**prisma.CIFAR_BASE, "seed": 0})
    configs.append({**{k: v.replace("{n}", "3000") for k, v in adaptive.TASKS["t3"].data.items()},
                    "seed": 0})
    for values in configs:
        words = shlex.split(command(values))
        assert words[:3] == ["dpfl", "run", "--run-config"] and len(words) == 4
        parsed = parse_overrides(words[3])
        for key, value in values.items():
            if key.endswith("-options"):
                assert parse_options(parsed[key]) == parse_options(value)
            else:
                assert parsed[key] == value
