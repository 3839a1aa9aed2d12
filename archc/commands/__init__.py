"""CLI subcommands, one module each. A module exposes ``NAME``, ``HELP``, ``add_arguments(parser)``
and ``run(args) -> int``; ``archc.cli`` lists them in ``COMMANDS``."""
