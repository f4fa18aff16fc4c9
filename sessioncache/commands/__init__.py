"""One module per ``sessioncache`` subcommand, each exposing ``register(subparsers)``.

``register`` adds the subcommand's parser and sets ``func`` to a callable taking the parsed
arguments and returning the exit code. Import heavy dependencies inside ``func``, not at module
level, so that ``sessioncache --help`` stays fast.
"""
