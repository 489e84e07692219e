"""Sub-commands of the shardc CLI: each module has HELP, add_arguments(parser), run(args)."""
