"""A server that is not there, or that went away, in words a person can act on.

gRPC reports both as UNAVAILABLE with its own details ("failed to connect to all
addresses; last error: UNKNOWN: ipv4:…", "Cancelling all calls", "Socket closed"),
which name neither the server nor what to do. The command line says instead which
address it tried and the command that starts a server there; a client and a
server that disagree about TLS are told which flag to change.
"""

from __future__ import annotations

from infemeral.errors import InfemeralError, Unavailable
from infemeral.transport import host_of

# gRPC's details when no connection could be made at all (refused, unresolvable, unroutable)
NEVER_CONNECTED = ("failed to connect", "errors resolving", "dns resolution failed", "connection refused",
                   "no route to host")
# gRPC's details when the TLS handshake (or its absence) failed the connection, by cause
PLAINTEXT_TO_TLS = "socket closed"  # a plaintext client's first bytes reached a TLS port: the server hung up
CA_DOES_NOT_SIGN = ("certificate_verify_failed",  # the server's certificate chain ends at no certificate we trust
                    "certificate signature failure")  # ...at one of the same name that did not sign it
NOT_TLS = "wrong_version_number"  # a TLS client's hello reached a plaintext port
NAME_NOT_IN_CERTIFICATE = "hostname verification"
TLS_CA = "--tls-ca FILE (INFEMERAL_TLS_CA)"
START_ONE = ("start one with `infemeral-server` (add --bundle DIR for a server bundle outside the default place), "
             "or point --server (INFEMERAL_SERVER) at a running one")


def is_unreachable(error: BaseException) -> bool:
    """Whether `error` says the server could not be reached (or was lost), rather than that it refused."""
    return isinstance(error, Unavailable)


def never_connected(error: BaseException) -> bool:
    text = str(error).lower()
    return is_unreachable(error) and any(s in text for s in NEVER_CONNECTED)


def tls_mismatch(error: BaseException, server: str) -> str | None:
    """What to change when client and server disagree about TLS (or about whom to trust), or None."""
    if not never_connected(error):
        return None
    text = str(error).lower()
    if NOT_TLS in text:
        return (f"the server at {server} does not speak TLS: drop --tls-ca (INFEMERAL_TLS_CA), or start the server "
                "with --tls-cert and --tls-key")
    if any(s in text for s in CA_DOES_NOT_SIGN):
        return (f"the TLS certificate of the server at {server} is not signed by the CA in --tls-ca: pass the CA that "
                f"signed it (`infemeral-server certs` writes it as ca.crt), or the server's own certificate, with "
                f"{TLS_CA}")
    if NAME_NOT_IN_CERTIFICATE in text:
        host = host_of(server)
        return (f"the TLS certificate of the server at {server} is not made out to {host}: pass a name it carries "
                f"with --tls-server-name NAME (INFEMERAL_TLS_SERVER_NAME), or make it one for {host} "
                f"(`infemeral-server certs {host}`)")
    if PLAINTEXT_TO_TLS in text:
        return (f"the server at {server} closed the connection as it opened, as a server that speaks TLS does to a "
                f"client without it: pass the CA that signed its certificate with {TLS_CA}")
    return None


def describe(error: InfemeralError, server: str) -> str:
    """One line for `error`: for a server that cannot be reached, which address and how to start one there, or
    what to change about TLS; anything else as it is."""
    mismatch = tls_mismatch(error, server)
    if mismatch is not None:
        return mismatch
    if never_connected(error):
        return f"no infemeral-server at {server}: {START_ONE}"
    if is_unreachable(error):
        return f"lost the connection to the infemeral-server at {server} (it stopped or the network failed)"
    return str(error)
