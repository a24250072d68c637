"""The exit codes of ``run.py`` and its subcommands."""

EXIT_OK = 0
EXIT_USER_ERROR = 2  # a UserError: its one-sentence message is printed, no traceback
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_TERMINATED = 143  # SIGTERM (128 + SIGTERM)
