"""A server that is not there, or that went away, in words a person can act on.

gRPC reports both as UNAVAILABLE with its own details ("failed to connect to all
addresses; last error: UNKNOWN: ipv4:…", "Cancelling all calls", "Socket closed"),
which name neither the server nor what to do. The command line says instead which
address it tried and the command that starts a server there.
"""

from __future__ import annotations

from infemeral.errors import InfemeralError, Unavailable

# gRPC's details when no connection could be made at all (refused, unresolvable, unroutable)
NEVER_CONNECTED = ("failed to connect", "errors resolving", "dns resolution failed", "connection refused",
                   "no route to host")
START_ONE = ("start one with `infemeral-server` (add --bundle DIR for a server bundle outside the default place), "
             "or point --server (INFEMERAL_SERVER) at a running one")


def is_unreachable(error: BaseException) -> bool:
    """Whether `error` says the server could not be reached (or was lost), rather than that it refused."""
    return isinstance(error, Unavailable)


def never_connected(error: BaseException) -> bool:
    text = str(error).lower()
    return is_unreachable(error) and any(s in text for s in NEVER_CONNECTED)


def describe(error: InfemeralError, server: str) -> str:
    """One line for `error`: for a server that cannot be reached, which address and how to start one there;
    anything else as it is."""
    if never_connected(error):
        return f"no infemeral-server at {server}: {START_ONE}"
    if is_unreachable(error):
        return f"lost the connection to the infemeral-server at {server} (it stopped or the network failed)"
    return str(error)
