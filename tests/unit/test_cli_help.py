"""Every option a command's help points the reader to exists on that command (a help text naming an
option nobody added, like fleet-sim's old "see --list", sends users nowhere)."""

from __future__ import annotations

import argparse
import re

from extproc.cli import build_parser

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"`extproc ([a-z-]+)([^`]*)`")  # another command's options, quoted as a command line


def _commands(parser: argparse.ArgumentParser, name: str = "extproc"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_options_named_in_help_texts_exist():
    commands = dict(_commands(build_parser()))
    dangling = []
    for name, parser in commands.items():
        for action in parser._actions:
            where = f"{name} {'/'.join(action.option_strings) or action.dest}"
            text = action.help or ""
            for command, args in COMMAND.findall(text):
                other = commands.get(f"extproc {command}")
                if other is None:
                    dangling.append(f"{where}: no command {command}")
                    continue
                dangling += [f"{where}: {command} {o}" for o in OPTION.findall(args)
                             if o not in _options(other)]
            dangling += [f"{where}: {o}" for o in OPTION.findall(COMMAND.sub("", text))
                         if o not in _options(parser)]
    assert not dangling, dangling


def _unhandled(parser: argparse.ArgumentParser, name: str, handler: object = None):
    handler = parser.get_default("func") or handler  # a subcommand may run through its parent's handler
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not callable(handler) and not any(a.required for a in subs):
        yield name
    for action in subs:
        for sub_name, sub in action.choices.items():
            yield from _unhandled(sub, f"{name} {sub_name}", handler)


def test_every_command_has_a_handler():
    """Each subcommand module registers through `add_commands` and sets what runs it: a command the
    parser offers but nothing handles would fail only when a user types it."""
    top = build_parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == [
        "serve", "check-config", "envoy-config", "engine-sim", "benchmark", "gen-profile", "fleet-sim",
        "bench", "score", "demo", "optimize", "optimizer"]
    unhandled = list(_unhandled(top, "extproc"))
    assert not unhandled, unhandled


def test_the_bench_module_run_alone_names_itself_as_the_cli_does(capsys):
    """`python -m extproc.perf.cli` (how a checkout without the wheel runs it) prints the same usage
    line as `extproc bench` (it printed "extproc bench bench")."""
    import pytest

    from extproc.perf.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith("usage: extproc bench [-h]")
