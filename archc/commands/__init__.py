"""CLI subcommands, one module each. A module exposes ``NAME``, ``HELP``, ``add_arguments(parser)``
and ``run(args) -> int``; ``archc.cli`` lists them in ``COMMAND_MODULES``. Flags that more than one
command takes are added with ``vocabulary.add``; ``common`` reads sources and checks a run before
anything loads; ``textgen`` streams generated text."""
