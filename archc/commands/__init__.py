"""CLI subcommands, one module each, listed in ``archc.cli.COMMAND_MODULES``: ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Shared flags come from ``vocabulary``; the
reading, checking, loading and writing commands share, from ``common``; generation, from
``textgen``."""
