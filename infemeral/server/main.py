"""`infemeral-server`: serve a server bundle over gRPC."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from infemeral.settings_flags import add_settings_flags, settings_from_args
from infemeral.cloak.heap import cap_arenas
from infemeral.errors import InfemeralError
from infemeral.logs import configure as configure_logging
from infemeral.server.settings import ServerSettings

EPILOG = """\
examples:
  infemeral-server --bundle bundles/server
  INFEMERAL_BUNDLE=/workspace/server INFEMERAL_LISTEN=0.0.0.0:50051 infemeral-server
  infemeral-server --bundle bundles/server --tensor-parallel 4    # the layers split over 4 GPUs
  torchrun --nproc-per-node 4 $(which infemeral-server) --bundle bundles/server   # the same, started by torchrun
  infemeral-server certs gpu.example.org   # a CA and a certificate for --tls-cert/--tls-key (certs --help)

The server only ever sees hidden states in the client's secret basis; it keeps
each session's KV cache encrypted under the client's key in --store between turns.
Stop it with SIGTERM (or Ctrl-C): open turns get --grace-seconds to finish.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infemeral-server", description="Serve the rotated layers of a model to infemeral clients.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings_flags(parser, ServerSettings)
    return parser


def check_before_loading(settings: ServerSettings) -> None:
    """Refuse, one line each, a listen or metrics address that is taken and a tensor-parallel rank count that the
    model's heads or this machine's GPUs do not allow: from the settings, the bundle's config.json and the GPU
    count, before the model's code is imported (seconds on a pod), let alone its weights."""
    from infemeral.cloak.bundle import stored_config
    from infemeral.server.listen import ListenAddress, check_free
    from infemeral.server.parallel.ranks import check, rank_count

    check_free(ListenAddress.parse(settings.listen))
    if settings.metrics_port:
        check_free(ListenAddress(settings.metrics_host.strip("[]"), settings.metrics_port), "the metrics port ")
    world = rank_count(settings.tensor_parallel)
    bundle = settings.bundle.expanduser()
    if world > 1 and (bundle / "config.json").is_file():  # no bundle there: opening it says so, in full
        check(stored_config(bundle), settings.device, world)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:  # the one subcommand: TLS certificates to serve with
        from infemeral.server.certs import main as certs_main

        return certs_main(argv[1:])
    cap_arenas()  # before any turn thread allocates: glibc would otherwise keep freed memory per thread
    args = build_parser().parse_args(argv)
    from infemeral.server.parallel.group import torchrun_rank

    try:
        settings = settings_from_args(ServerSettings, args)
        configure_logging(settings.log_level, settings.log_format)
        launch = torchrun_rank()
        if launch is not None and launch.rank > 0:  # torchrun started every rank: this one works for rank 0
            from infemeral.devices import resolve_device
            from infemeral.server.parallel.worker import serve

            return serve(launch, resolve_device(settings.device).type, settings.tensor_parallel_timeout)
        check_before_loading(settings)
        from infemeral.server.app import serve_forever

        return serve_forever(settings)
    except (InfemeralError, OSError, ValueError, ValidationError) as e:
        print(f"infemeral-server: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
