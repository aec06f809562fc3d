"""Exit codes of every ``kvservice`` command (the CLI and each subcommand share them)."""

EXIT_OK = 0
EXIT_FAILED = 1  # the command ran and an expectation failed
EXIT_USAGE = 2  # bad arguments or configuration
EXIT_INTERRUPTED = 130  # stopped by SIGINT (Ctrl-C), or SIGTERM where a command treats it so: 128 + SIGINT
