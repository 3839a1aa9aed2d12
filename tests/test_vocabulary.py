"""One flag vocabulary: every flag that more than one command takes is declared once and added
through one helper, means and checks the same everywhere, and is the table the README shows.
Every bad value is refused — one line, status 2 — before a model is read; an old or misspelt
flag gets a suggestion."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from archc.cli import RENAMED, build_parser, main
from archc.commands.vocabulary import FLAGS, markdown, subcommands

README = Path(__file__).resolve().parent.parent / "README.md"
PARSER = build_parser()
COMMANDS = subcommands(PARSER)


def test_the_readme_shows_the_vocabulary_as_the_code_declares_it() -> None:
    """Regenerate with: python -c "from archc.cli import build_parser; from
    archc.commands.vocabulary import markdown; print(markdown(build_parser()))"."""
    text = README.read_text(encoding="utf-8")
    found = re.search(r"<!-- flags:[^\n]*-->\n\n(.*?)<!-- /flags -->", text, re.S)
    assert found, "README lost its flag table"
    assert found.group(1) == markdown(PARSER)


def test_a_flag_taken_by_two_commands_comes_from_the_vocabulary() -> None:
    seen: dict[str, list[str]] = {}
    for command, sub in COMMANDS.items():
        for action in sub._actions:
            for option in action.option_strings:
                if option in ("-h", "--help"):
                    continue
                seen.setdefault(option, []).append(command)
                shared = next((name for name, f in FLAGS.items() if option in f.names), None)
                assert shared is None or getattr(action, "vocabulary", None) == shared, \
                    f"archc {command} adds {option} without the vocabulary helper"
    for option, commands in seen.items():
        if len(commands) > 1:
            assert any(option in f.names for f in FLAGS.values()), \
                f"{option} is taken by {', '.join(commands)} but is not in the vocabulary"


def test_a_shared_flag_is_read_the_same_way_everywhere() -> None:
    reading: dict[str, set[tuple[object, ...]]] = {}
    for sub in COMMANDS.values():
        for action in sub._actions:
            name = getattr(action, "vocabulary", None)
            if name is not None:
                # (whether it may be left out is the command's: `archc passes --list`)
                key = (action.type, tuple(action.choices or ()), type(action).__name__)
                reading.setdefault(name, set()).add(key)
    for name, ways in reading.items():
        assert len(ways) == 1, f"{name} is read in {len(ways)} ways: {ways}"


def test_every_model_command_takes_a_source() -> None:
    takers = {c for c, sub in COMMANDS.items() for a in sub._actions
              if getattr(a, "vocabulary", None) == "source"}
    assert takers == set(COMMANDS) - {"specs", "cache"}


@pytest.mark.parametrize("argv,message", [
    ("run tiny-llama3 --temperature -1", "--temperature: -1 must be ≥ 0"),
    ("run tiny-llama3 --prompt hi --top-p 2", "--top-p: 2 must be in (0, 1]"),
    ("run tiny-llama3 --new-tokens -3", "--new-tokens: -3 must be ≥ 0"),
    ("run tiny-llama3 --prompt-len 0", "--prompt-len: 0 must be ≥ 1"),
    ("run tiny-llama3 --batch two", "--batch: 'two' is not a whole number"),
    ("run tiny-llama3 --device tpu", "--device: 'tpu' is not cpu, cuda"),
    ("run tiny-llama3 --dtype f64", "--dtype: invalid choice: 'f64'"),
    ("run tiny-llama3 --backend fast", "--backend: invalid choice: 'fast'"),
    ("run tiny-llama3 --seed -1", "--seed: -1 must be ≥ 0"),
    ("run tiny-llama3 --system hi", "--system goes with --chat"),
    ("run tiny-llama3 --temperature 0.5", "--temperature applies to text generation"),
    ("run tiny-llama3 --prompt hi --prompt-len 4", "--prompt-len sizes the random prompt"),
    ("run tiny-llama3 --prompt hi --chat hi", "not allowed with argument --prompt"),
    ("chat tiny-llama3 --top-k 0", "--top-k: 0 must be ≥ 1"),
    ("roofline tiny-llama3 --gpu v100", "unknown GPU 'v100'"),
    ("ir tiny-llama3 -o /no/such/dir/ir.txt", "directory /no/such/dir does not exist"),
    ("ir tiny-llama3 --after nope", "--after: unknown pass 'nope'"),
    ("validate tiny-llama3 --prompt-len x", "'x' is not a whole number"),
    ("bench tiny-llama3 --dry-run --compile-modes fast", "unknown torch.compile mode"),
    ("cache --max-size lots", "'lots' is not a size"),
    ("roofline tiny-llama3 --prompt 20", "unknown option --prompt"),
    ("run tiny-llama3 --max-new-tokens 5", "it is --new-tokens now"),
    ("passes tiny-llama3 --tokens 4", "it is --prompt-len (a prompt's length)"),
    ("roofline tiny-llama3 --unfused", "it is --passes none now"),
    ("ir tiny-llama3 --dtyp f16", "did you mean --dtype?"),
])
def test_bad_arguments_are_refused_before_anything_loads(
        argv: str, message: str, nothing_loads: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("archc ")


def test_every_renamed_flag_is_no_flag_of_today() -> None:
    today = {o for sub in COMMANDS.values() for a in sub._actions for o in a.option_strings}
    assert not set(RENAMED) & today


def test_help_explains_each_command(capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: archc {command}")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "eager" in out and "triton" in out and "--device" in out   # backends are listed


def test_values_reach_the_command_parsed() -> None:
    args = PARSER.parse_args(["roofline", "tiny-llama3", "--prompt-len", "16",
                              "--new-tokens", "4", "--batch", "2"])
    assert (args.prompt_len, args.new_tokens, args.batch) == (16, 4, 2)
