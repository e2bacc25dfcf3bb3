"""The interactive chat of `infemeral-client chat`, as people know it from ollama or llama.cpp.

Line editing and history (readline, kept in an owner-only file), multi-line
messages, slash commands, and Ctrl-C that stops the answer being written
rather than the program: the turn is dropped before its commit, so both caches
stay where they were and the conversation goes on as if the message had not
been sent. Piped input (not a terminal) is read line by line with the same
rules, without prompts.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from infemeral.cli import server_errors
from infemeral.errors import InfemeralError

HELP = """\
Type a message and press Enter.
  /help        this help
  /reset       start a new conversation (the old one is deleted on the server)
  /exit        quit (also /quit or Ctrl-D); a chat without --session NAME is
               then deleted on the server, one with it is kept to resume
Multi-line messages: end a line with \\ to go on in the next one, or start the
message with \"\"\" and end it with \"\"\" (on the same or a later line).
Ctrl-C while an answer is written stops it: that exchange is dropped and the
conversation stays as it was. Ctrl-C at the prompt clears the line; twice
during an answer quits. Up/Down recall earlier messages{history}."""

BLOCK = '"""'


def say_loading(client_bundle) -> None:
    """Tell a person at the terminal at once that the chat has started. Before its first prompt it imports
    torch and transformers and loads the local half of the model: 5 s on an idle 2-core machine, 30 s on one at
    load 5, with nothing else on the screen meanwhile."""
    if sys.stdin.isatty():
        print(f"loading the model ({client_bundle})...", file=sys.stderr, flush=True)


class StopOnInterrupt:
    """While an answer streams, Ctrl-C sets `is_set` instead of raising, so the turn ends at a clean point
    (between tokens) and rolls back; a second Ctrl-C raises KeyboardInterrupt to quit. Signal handlers can
    only be set in the main thread: elsewhere this does nothing."""

    def __init__(self):
        self.is_set = False
        self._previous = None

    def __enter__(self) -> "StopOnInterrupt":
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        if self.is_set:
            raise KeyboardInterrupt
        self.is_set = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class LineReader:
    """Lines from the terminal (readline editing and history) or from a pipe; None at the end."""

    def __init__(self, stream=None, history_file: str = ""):
        self.stream = stream or sys.stdin
        self.is_interactive = self.stream.isatty()
        self.history_file = Path(history_file).expanduser() if history_file and self.is_interactive else None
        if self.is_interactive:
            import readline  # noqa: F401  (input() edits lines once it is loaded)

            if self.history_file is not None:
                self._load_history()

    def read(self, prompt: str) -> str | None:
        if not self.is_interactive:
            line = self.stream.readline()
            return line.rstrip("\r\n") if line else None
        try:
            return input(prompt)
        except EOFError:
            print(file=sys.stdout)
            return None

    def read_message(self) -> str | None:
        """One message: a line, lines joined by a trailing backslash, or a \"\"\" block."""
        first = self.read("you> ")
        if first is None:
            return None
        if first.lstrip().startswith(BLOCK):
            rest, lines = first.lstrip()[len(BLOCK):], []
            while not rest.rstrip().endswith(BLOCK):
                lines.append(rest)
                rest = self.read("... ")
                if rest is None:
                    return None
            lines.append(rest.rstrip()[:-len(BLOCK)])
            return "\n".join(lines)
        lines, line = [], first
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = self.read("... ")
            if line is None:
                return None
        lines.append(line)
        return "\n".join(lines)

    def _load_history(self) -> None:
        import readline

        readline.set_history_length(1000)
        try:
            readline.read_history_file(self.history_file)
        except OSError:
            pass

    def save_history(self) -> None:
        """Write the history owner-only: it holds what you typed."""
        if self.history_file is None:
            return
        import readline

        try:
            self.history_file.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(self.history_file, os.O_WRONLY | os.O_CREAT, 0o600))
            os.chmod(self.history_file, 0o600)
            readline.write_history_file(self.history_file)
        except OSError as e:
            print(f"infemeral-client: could not save the chat history: {e}", file=sys.stderr)


class ChatRepl:
    """One chat session at the terminal. `report(result, verbose)` prints a turn's figures.

    A named session (`session_path`) is saved after every turn and kept on the server when the chat ends; an
    unnamed one is deleted there when the chat ends, as `generate` deletes its own."""

    def __init__(self, client, settings, *, session_name: str | None = None, session_path: Path | None = None,
                 system: str | None = None, verbose: bool = False,
                 report: Callable[[object, bool], None] = lambda result, verbose: None, stream=None,
                 params=None, fork_of: Path | None = None):
        from infemeral.client.sampling import generation_defaults

        self.client, self.settings = client, settings
        self.session_name, self.path, self.system = session_name, session_path, system
        self.fork_of = fork_of  # a saved session this chat continues a copy of (`chat --from`)
        self.verbose, self.report = verbose, report
        self.params = params or settings.sampling(generation_defaults(client.bundle.generation_config()))
        self.reader = LineReader(stream, settings.chat_history)
        self.session = self._open_session()

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> int:
        if self.reader.is_interactive:
            self._say("Chat with the model; /help for help, Ctrl-D to quit.")
        try:
            while True:
                try:
                    message = self.reader.read_message()
                except KeyboardInterrupt:  # at the prompt: drop what was typed
                    print(file=sys.stdout)
                    continue
                if message is None:
                    return 0
                if not message.strip():
                    continue
                if message.startswith("/") and "\n" not in message:
                    if not self.command(message.strip()):
                        return 0
                    continue
                self.answer(message.strip())
        finally:
            self.reader.save_history()
            self.leave()

    def leave(self) -> None:
        """Say what becomes of the conversation as the chat ends: a named one is kept (how to resume or delete
        it), an unnamed one is deleted on the server."""
        name = self.session_name
        if self.path is not None:
            if self.session.version:
                self._say(f"session {name!r} kept: resume it with `infemeral-client chat --session {name}`, "
                          f"delete it with `infemeral-client delete --session {name}`")
            return
        if not self.session.version:
            return
        try:
            self.session.delete()
        except InfemeralError as e:
            why = (f"the server at {self.client.address} cannot be reached" if server_errors.is_unreachable(e)
                   else str(e))
            self._say(f"could not delete this conversation on the server ({why}); the server deletes it by itself "
                      "once it has been idle for its session TTL (7 days by default)")
            return
        if self.reader.is_interactive:
            self._say("conversation deleted on the server (start with --session NAME to keep one)")

    def command(self, line: str) -> bool:
        """Run a slash command; False means quit."""
        name = line.split()[0].lower()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            history = f" (kept in {self.reader.history_file})" if self.reader.history_file else ""
            print(HELP.format(history=history), file=sys.stdout, flush=True)
        elif name == "/reset":
            if self.session.version:
                self.session.delete()
            self.session = self.client.new_session(system_prompt=self.system)
            self._save()
            self._say("(new conversation)")
        else:
            self._say(f"unknown command {name}; /help lists the commands")
        return True

    def answer(self, message: str) -> bool:
        """Stream one answer. Ctrl-C stops it (while the prompt goes up, too) and a failure is reported; either
        way the conversation stays as it was. True if the turn committed."""
        from infemeral.cli.upload_line import UploadLine, UploadStopped

        line = UploadLine()
        deltas = self.session.stream(message, self.params, on_progress=line)
        is_complete = False
        # the answer's prefix goes out with its first text, after the upload's line is cleared
        prefix = "assistant> " if self.reader.is_interactive else ""
        try:
            with StopOnInterrupt() as stop:
                line.should_stop = lambda: stop.is_set
                try:
                    for delta in deltas:
                        if stop.is_set:  # a ^C while this token was computed: it is not shown
                            break
                        sys.stdout.write(prefix + delta)
                        prefix = ""
                        sys.stdout.flush()
                        if stop.is_set:  # or while it was written: no next token is computed
                            break
                    else:
                        is_complete = True  # the generator ran to its end: the turn committed
                except UploadStopped:
                    pass
                finally:
                    line.close()
                    deltas.close()  # a turn stopped before its commit rolls back
        except InfemeralError as e:
            print(file=sys.stdout, flush=True)
            unsure = (" (its commit is unconfirmed; the next turn asks the server)" if self.session.pending_commit
                      else "")
            if server_errors.is_unreachable(e):
                later = (f", or /exit and resume later with `infemeral-client chat --session {self.session_name}`"
                         if self.path is not None else "")
                self._say(f"infemeral-client: this turn failed: {server_errors.describe(e, self.client.address)}.\n"
                          f"The conversation is intact{unsure}: send your message again once the server is "
                          f"back{later}.")
            else:
                self._say(f"infemeral-client: this turn failed: {e}\nThe conversation is unchanged{unsure}; send "
                          "your message again or another one.")
            self._save()  # it may have left a commit to settle
            return False
        print(prefix, file=sys.stdout, flush=True)  # an answer with no text still has its prefix
        if not is_complete:
            self._say("(stopped: that exchange was dropped; the conversation is as it was before it)")
            return False
        self.report(self.session.last_result, self.verbose)
        self._save()
        return True

    # -- helpers --------------------------------------------------------------------------------------
    def _open_session(self):
        from infemeral.client.session import Session

        if self.fork_of is not None:
            session = Session.load(self.client, self.fork_of).fork()
            self._say(f"continuing a copy of session {self.fork_of.stem!r} ({len(session.messages)} messages), made "
                      "on the server; that session stays as it was")
            if self.path is not None:
                session.save(self.path)  # the copy's key is in this process only until it is saved
            return session
        if self.path is not None and self.path.exists():
            session = Session.load(self.client, self.path)
            self._say(f"resumed session {self.session_name!r} ({len(session.messages)} messages)")
            if session.pending_commit:
                self._say("(the last turn's commit was never confirmed; the next turn asks the server whether it "
                          "landed)")
            return session
        return self.client.new_session(system_prompt=self.system)

    def _save(self) -> None:
        if self.path is not None:
            self.session.save(self.path)

    @staticmethod
    def _say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
