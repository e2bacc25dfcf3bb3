"""The command lines: `infemeral-client` (`main.py`, `commands.py`, the chat REPL) and the flags both
`infemeral-client` and `infemeral-server` derive from their settings (`flags.py`)."""
