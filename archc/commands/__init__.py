"""CLI subcommands, one module each, listed in ``archc.cli.COMMAND_MODULES``: its docstring is
its help, and it has ``add_arguments(parser)`` and ``run(args) -> int``. Shared flags come from
``vocabulary``; what commands share besides, from ``common``."""
