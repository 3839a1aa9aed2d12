"""Defaults fitted to the model a command runs on. A command's defaults are sized for a real
model (a prompt of 512 tokens, 128 new ones); a model whose context (max_seq_len) is shorter
gets them fitted to it, and a note on standard error says what was used. A value the user gave
that does not fit is refused, naming the flag: only defaults are fitted."""

from __future__ import annotations

from archc.errors import ArchcError
from archc.spec.schema import Spec
from archc.ui import err_console


def note(text: str, quiet: bool = False) -> None:
    """`note: text` on standard error (dim), unless `quiet`."""
    if not quiet:
        err_console.print(f"[dim]note: {text}[/]", soft_wrap=True, highlight=False)


def fitted(flag: str, given: int | None, default: int, most: int, limit: str, *,
           quiet: bool = False) -> int:
    """A flag's value: as `given`, refused past `most`; else `default`, fitted down to `most`
    (and said so). `limit` says what `most` is: "tiny-llama3's max_seq_len = 64"."""
    if given is not None:
        if given > most:
            raise ArchcError(f"{flag} {given} exceeds {limit}")
        return given
    if default > most:
        note(f"{flag} {most}: the default {default} exceeds {limit}", quiet)
        return most
    return default


def fitted_all(flag: str, given: list[int] | None, defaults: tuple[int, ...], most: int,
               limit: str, *, quiet: bool = False) -> list[int]:
    """A flag of several values: as `given`, each refused past `most`; else the `defaults`
    within `most`, or `most` alone where none is (and said so)."""
    if given:
        return [fitted(flag, value, value, most, limit) for value in given]
    within = [d for d in defaults if d <= most] or [most]
    if within != list(defaults):
        dropped = [d for d in defaults if d > most]
        note(f"{flag} {' '.join(map(str, within))}: the default{'s' if len(dropped) > 1 else ''}"
             f" {' '.join(map(str, dropped))} exceed{'' if len(dropped) > 1 else 's'} {limit}",
             quiet)
    return within


def fit_lengths(spec: Spec, prompt: int | None, new: int | None, defaults: tuple[int, int], *,
                reserve: int = 1, quiet: bool = False) -> tuple[int, int]:
    """--prompt-len and --new-tokens within max_seq_len: as given, else the `defaults` (prompt,
    new), fitted where they do not fit: the new tokens at most a quarter of the context, the
    prompt the rest (and said so). Decoding holds max(new, `reserve`) positions after the prompt
    (`archc bench` warms up first); an encoder does not decode (new tokens 0). What is
    given must fit: a prompt and, for a decoder, room after it."""
    most, name = spec.max_seq_len, spec.name
    if spec.family == "encoder":
        if new:
            raise ArchcError(f"{name} is an encoder: it does not decode (leave out "
                             "--new-tokens, or give 0)")
        return fitted("--prompt-len", prompt, defaults[0], most, f"max_seq_len = {most}",
                      quiet=quiet), 0
    def held(n: int) -> int:    # positions n new tokens take after the prompt
        return max(n, reserve) if n else 0

    if prompt is not None and new is not None and prompt + held(new) > most:
        raise ArchcError(f"--prompt-len {prompt} + --new-tokens {held(new)} exceed "
                         f"max_seq_len = {most}")
    if prompt is not None and new is None and prompt + reserve > most:
        steps = "a decode step" if reserve == 1 else f"{reserve} decode steps"
        raise ArchcError(f"--prompt-len {prompt} leaves no room for {steps} within "
                         f"max_seq_len = {most}")
    if new is not None and held(new) >= most:
        raise ArchcError(f"--new-tokens {new} leaves no room for a prompt within "
                         f"max_seq_len = {most}")
    if most <= reserve:
        raise ArchcError(f"{name}'s max_seq_len = {most} leaves no room for a prompt and "
                         f"{reserve} decode step{'s' if reserve > 1 else ''}")
    fit_new = new
    if new is None:     # a quarter of the context where the default does not fit
        room = most - (prompt if prompt is not None else min(defaults[0], most - reserve))
        fit_new = defaults[1] if max(defaults[1], reserve) <= room else \
            min(defaults[1], room if prompt is not None else max(1, most // 4))
    fit_prompt = prompt if prompt is not None else min(defaults[0], most - held(fit_new))
    fits = [(flag, value, default) for flag, value, default, given in (
        ("--prompt-len", fit_prompt, defaults[0], prompt),
        ("--new-tokens", fit_new, defaults[1], new)) if given is None and value != default]
    if fits:
        one = len(fits) == 1
        note(" ".join(f"{flag} {value}" for flag, value, _ in fits) +
             f": the default{'' if one else 's'} {' + '.join(str(d) for *_, d in fits)} "
             f"do{'es' if one else ''} not fit {name}'s max_seq_len = {most}", quiet)
    return fit_prompt, fit_new
