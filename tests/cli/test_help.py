"""`tandem COMMAND --help` explains itself: every subcommand has a description, every flag has help, and a flag
with a default says what it is."""

import argparse

import pytest

from tandem.cli import build_parser

FLAGS_WITHOUT_A_VALUE = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)


def _subcommands():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices.items())


def _flags(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            yield action


@pytest.mark.parametrize(("name", "parser"), _subcommands(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_flag_has_help_and_states_its_default(name, parser):
    assert parser.description, f"tandem {name} --help has no description"
    formatter = parser._get_formatter()
    problems = []
    for action in _flags(parser):
        flag = "/".join(action.option_strings) or action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            problems.append(f"{flag}: no help")
            continue
        text = formatter._expand_help(action)  # %(default)s filled in, as --help prints it
        has_value = not isinstance(action, FLAGS_WITHOUT_A_VALUE)
        if has_value and action.default is not None and "default" not in text.lower():
            problems.append(f"{flag}: default {action.default!r} not stated in {text!r}")
    assert not problems, f"tandem {name}: " + "; ".join(problems)


def test_the_default_model_has_one_name():
    """generate, serve, eval and calibrate load the same default model and call it the same."""
    helps = {}
    for name, parser in _subcommands():
        for action in _flags(parser):
            if "--model" in action.option_strings and "SmolLM2" in (action.help or ""):
                helps[name] = action.help
    assert set(helps) >= {"generate", "serve", "eval", "calibrate"}
    assert all("SmolLM2-135M-Instruct" in text for text in helps.values()), helps
