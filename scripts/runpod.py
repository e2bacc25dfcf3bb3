#!/usr/bin/env python3
"""Deploy infemeral-server on RunPod: pack the server bundle, make credentials, print the settings.

Typical use, on your laptop, after `infemeral-client prepare ... --output ~/bundles/qwen7b`:

  python scripts/runpod.py pack --bundle-dir ~/bundles/qwen7b/server \\
      --image ghcr.io/YOU/infemeral-server:0.1.0 --out ~/infemeral-runpod

writes into --out

  infemeral-runpod.tar          what to unpack into the pod's /workspace volume: the server
                                bundle, an empty session store, the TLS certificate and key,
                                and the API key file, owned by the image's user (uid 10001)
  infemeral-runpod.tar.sha256   its checksum, for `sha256sum -c` on the pod
  credentials/                  the self-signed certificate (server.crt, to pin on the
                                client), its key, the API key, and client.env

and prints every step: building the image, uploading and unpacking, the RunPod template
(image, environment, volume at /workspace, TCP port 50051) and the client's command line.
The client bundle (your secret basis) is never packed: this script refuses it.

Other commands:
  credentials   only the certificate, key, API key and client.env (e.g. for docker/compose.yaml)
  template      only the RunPod template settings (--json for machine-readable output)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import secrets
import shlex
import sys
import tarfile
from pathlib import Path

from infemeral.cloak.bundle import CLIENT_FORMAT, SERVER_FORMAT, sha256_file
from infemeral.files import write_private
from infemeral.server.certs import self_signed_certificate

DEFAULT_UID = 10001          # the image's user (docker/Dockerfile ARG UID/GID)
DEFAULT_GID = 10001
SERVER_NAME = "infemeral-server"  # the name in the certificate; clients check it via INFEMERAL_TLS_SERVER_NAME
GRPC_PORT = 50051
METRICS_PORT = 9400
VOLUME = "/workspace"        # where RunPod mounts the pod's (network) volume
ROOT = "infemeral"           # top folder of the tarball: /workspace/infemeral/...
TARBALL = "infemeral-runpod.tar"
PLACEHOLDER_IMAGE = "YOUR-REGISTRY/infemeral-server:0.1.0"
VOLUME_HEADROOM_GB = 10      # beyond the bundle's two copies: FlashInfer's compiled kernels and the session store


class PackError(Exception):
    """Something the user has to fix; printed without a traceback."""


# --- the server bundle ------------------------------------------------------------------------

def read_server_manifest(bundle_dir: Path, verify: bool = True) -> dict:
    """The manifest of a server bundle, after checking it is one (and, with verify, its file hashes)."""
    manifest_path = bundle_dir / "manifest.json"
    if not bundle_dir.is_dir():
        raise PackError(f"{bundle_dir} is not a directory; pass the server/ directory that "
                        "`infemeral-client prepare` wrote")
    if (bundle_dir / "basis.safetensors").exists():
        raise PackError(f"{bundle_dir} is a CLIENT bundle (it holds your secret basis): never upload it. "
                        "Pass the server/ directory next to it")
    if not manifest_path.exists():
        hint = (f"; did you mean {bundle_dir / 'server'}?" if (bundle_dir / "server" / "manifest.json").exists()
                else "; pass the server/ directory that `infemeral-client prepare` wrote")
        raise PackError(f"{bundle_dir} has no manifest.json{hint}")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") == CLIENT_FORMAT:
        raise PackError(f"{bundle_dir} is a CLIENT bundle (it holds your secret basis): never upload it")
    if manifest.get("format") != SERVER_FORMAT:
        raise PackError(f"{bundle_dir} holds a {manifest.get('format')!r}, not an {SERVER_FORMAT!r}")
    for name, digest in manifest.get("files", {}).items():
        path = bundle_dir / name
        if not path.is_file():
            raise PackError(f"{path} is listed in the manifest but missing; prepare the bundle again")
        if verify and sha256_file(path) != digest:
            raise PackError(f"{path} does not match its manifest; prepare the bundle again")
    return manifest


def bundle_bytes(bundle_dir: Path) -> int:
    return sum(p.stat().st_size for p in bundle_dir.rglob("*") if p.is_file())


# --- credentials ------------------------------------------------------------------------------

def make_certificate(server_name: str = SERVER_NAME, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
                     days: int = 825) -> tuple[bytes, bytes]:
    """A self-signed certificate and its key (PEM) for the server, valid for `server_name`,
    localhost, 127.0.0.1 and the extra names and addresses. Clients pin the certificate itself."""
    return self_signed_certificate(server_name, (*dns, *ips), days)


def make_credentials(out: Path, server_name: str = SERVER_NAME, dns: tuple[str, ...] = (),
                     ips: tuple[str, ...] = (), days: int = 825, client_bundle: Path | None = None,
                     renew: bool = False) -> dict[str, Path]:
    """server.crt, server.key, api-keys (one key; the server's INFEMERAL_API_KEYS_FILE) and client.env
    in `out`. Existing ones are kept (so a new bundle keeps the certificate clients pinned) unless renew."""
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    paths = {"cert": out / "server.crt", "key": out / "server.key", "api_keys": out / "api-keys",
             "client_env": out / "client.env"}
    if renew or not (paths["cert"].exists() and paths["key"].exists()):
        cert, key = make_certificate(server_name, dns, ips, days)
        write_private(paths["key"], key)
        paths["cert"].write_bytes(cert)
        os.chmod(paths["cert"], 0o644)
    if renew or not paths["api_keys"].exists():
        write_private(paths["api_keys"], (secrets.token_urlsafe(32) + "\n").encode())
    api_key = paths["api_keys"].read_text().split()[0]
    lines = [
        "# infemeral client settings for your server (keep private: it holds the API key).",
        "# Load with:  set -a; . " + shlex.quote(str(paths["client_env"].resolve())) + "; set +a",
        "# then set INFEMERAL_SERVER=HOST:PORT (on RunPod: the pod's public IP and the external",
        f"# port that Connect -> TCP port mappings shows for {GRPC_PORT}).",
        f"INFEMERAL_TLS_CA={shlex.quote(str(paths['cert'].resolve()))}",
        f"INFEMERAL_TLS_SERVER_NAME={server_name}",
        f"INFEMERAL_API_KEY={api_key}",
    ]
    if client_bundle is not None and (client_bundle / "manifest.json").exists():
        lines.append(f"INFEMERAL_CLIENT_BUNDLE={shlex.quote(str(client_bundle.resolve()))}")
    write_private(paths["client_env"], ("\n".join(lines) + "\n").encode())
    return paths


# --- the tarball ------------------------------------------------------------------------------

class HashingWriter:
    """A write-only file that hashes what goes through it."""

    def __init__(self, f):
        self.f = f
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_tarball(bundle_dir: Path, credentials: dict[str, Path], tar_path: Path,
                  uid: int = DEFAULT_UID, gid: int = DEFAULT_GID) -> str:
    """Write the tarball for /workspace and return its SHA-256.

    Layout (under infemeral/): server/ (the bundle), store/ (empty), tls/server.crt,
    tls/server.key, api-keys. Every entry belongs to uid:gid, so that `tar -xf` as root on the
    pod gives the files to the image's unprivileged user; modes are kept (keys stay 0600)."""

    def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid, info.gid, info.uname, info.gname = uid, gid, "", ""
        return info

    def folder(name: str, mode: int) -> tarfile.TarInfo:
        info = owned(tarfile.TarInfo(name))
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, int(datetime.datetime.now().timestamp())
        return info

    tmp = tar_path.with_name(tar_path.name + ".partial")
    # owner-only: it holds the server's TLS key and the API keys
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as raw:
        out = HashingWriter(raw)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(folder(ROOT, 0o755))
            tar.add(bundle_dir, arcname=f"{ROOT}/server", filter=owned)
            tar.addfile(folder(f"{ROOT}/store", 0o700))
            tar.addfile(folder(f"{ROOT}/tls", 0o700))
            tar.add(credentials["cert"], arcname=f"{ROOT}/tls/server.crt", filter=owned)
            tar.add(credentials["key"], arcname=f"{ROOT}/tls/server.key", filter=owned)
            tar.add(credentials["api_keys"], arcname=f"{ROOT}/api-keys", filter=owned)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, tar_path)
    digest = out.sha256.hexdigest()
    tar_path.with_name(tar_path.name + ".sha256").write_text(f"{digest}  {tar_path.name}\n")
    return digest


# --- what to tell RunPod ----------------------------------------------------------------------

def pod_env(server_name: str = SERVER_NAME) -> dict[str, str]:
    base = f"{VOLUME}/{ROOT}"
    return {
        "INFEMERAL_BUNDLE": f"{base}/server",
        "INFEMERAL_STORE": f"{base}/store",
        "INFEMERAL_LISTEN": f"0.0.0.0:{GRPC_PORT}",
        "INFEMERAL_TLS_CERT": f"{base}/tls/server.crt",
        "INFEMERAL_TLS_KEY": f"{base}/tls/server.key",
        "INFEMERAL_TLS_SERVER_NAME": server_name,
        "INFEMERAL_API_KEYS_FILE": f"{base}/api-keys",
        "INFEMERAL_DEVICE": "cuda",
        "INFEMERAL_LOG_FORMAT": "json",
        "INFEMERAL_METRICS_PORT": str(METRICS_PORT),
        # FlashInfer's compiled kernels on the volume: compiled on the first start, reused after.
        "FLASHINFER_WORKSPACE_BASE": base,
    }


def template(image: str, server_name: str = SERVER_NAME, volume_gb: int = 50, disk_gb: int = 30) -> dict:
    """The RunPod pod template (keys as in RunPod's template settings)."""
    return {
        "name": "infemeral-server",
        "imageName": image,
        "containerDiskInGb": disk_gb,
        "volumeInGb": volume_gb,
        "volumeMountPath": VOLUME,
        "ports": f"{GRPC_PORT}/tcp",
        "env": [{"key": k, "value": v} for k, v in pod_env(server_name).items()],
        "dockerArgs": "",
    }


def template_text(t: dict) -> str:
    env = "\n".join(f"      {e['key']}={e['value']}" for e in t["env"])
    return f"""\
RunPod template (Templates -> New Template, type Pod):
  Container Image          {t['imageName']}
  Container Start Command  (empty: the image's entrypoint starts the server)
  Container Disk           {t['containerDiskInGb']} GB (the CUDA PyTorch image is large)
  Volume Mount Path        {t['volumeMountPath']}   (a network volume of at least {t['volumeInGb']} GB)
  Expose HTTP Ports        (none: RunPod's HTTP proxy would end TLS outside the pod; use TCP)
  Expose TCP Ports         {GRPC_PORT}   (gRPC, TLS end to end; metrics on {METRICS_PORT} stay inside)
  Environment Variables
{env}
"""


def volume_gb(bundle_size: int) -> int:
    """The network volume to ask for, in whole GB: the tarball and the bundle it unpacks to lie side by side until
    the tarball is deleted (twice the bundle), and the server adds its compiled kernels and the encrypted store."""
    return math.ceil(2 * bundle_size / 1e9) + VOLUME_HEADROOM_GB


def guide(manifest: dict, bundle_dir: Path, out: Path, tar_path: Path, digest: str, creds: dict[str, Path],
          image: str, server_name: str, size: int) -> str:
    q = shlex.quote
    steps = [f"""\
infemeral on RunPod
===================
server bundle  {bundle_dir}  ({size / 1e9:.2f} GB, {manifest.get('model_type')}, {manifest.get('dtype')},
               fingerprint {manifest.get('fingerprint')})
tarball        {tar_path}
sha256         {digest}
credentials    {creds['cert'].parent}  (server.crt is what clients pin; keep server.key and api-keys private)
"""]
    if manifest.get("dtype") == "float32":
        steps.append("""\
note: this bundle is float32. On a GPU, bfloat16 halves the upload and the GPU memory:
  infemeral-client prepare MODEL --output ~/bundles/NAME --dtype bfloat16
""")
    steps.append(f"""\
1. Build and push the image (from the repository root; any registry RunPod can pull from):
     docker build -f docker/Dockerfile -t {image} .
     docker push {image}
""")
    steps.append(f"""\
2. Put the tarball on a RunPod network volume (Storage -> New Network Volume, >= {volume_gb(size)} GB: twice
   the bundle, for the tarball and what it unpacks to, plus {VOLUME_HEADROOM_GB} GB for compiled kernels and the store).
   Start a temporary pod with any RunPod PyTorch template and the volume at {VOLUME}, then copy
   the tarball there over an encrypted channel, e.g. with runpodctl (end-to-end encrypted):
     laptop:  runpodctl send {q(str(tar_path))}
     pod:     cd {VOLUME} && runpodctl receive CODE
   (or scp to the pod's SSH port). Then, in the pod's terminal, as root:
     cd {VOLUME}
     echo '{digest}  {tar_path.name}' | sha256sum -c -
     rm -rf {ROOT}/server
     tar --same-owner -xf {tar_path.name} && rm {tar_path.name}
   This gives {VOLUME}/{ROOT}/ to uid {DEFAULT_UID} (the image's user); sessions already in
   {ROOT}/store are kept. Terminate the temporary pod; the network volume stays.
""")
    steps.append("3. " + template_text(template(image, server_name, volume_gb(size))).replace("\n", "\n   ").rstrip()
                 + "\n")
    steps.append(f"""\
4. Deploy a GPU pod from that template with the network volume attached (pick a data centre
   where the volume lives and a pod type with a public IP, which TCP ports need). When it runs,
   Connect -> "TCP port mappings" shows something like  203.0.113.7:41234 -> {GRPC_PORT}.
   The pod's logs say "listening on 0.0.0.0:{GRPC_PORT}" once the model is loaded.
""")
    bundle_line = ("" if (bundle_dir.parent / "client" / "manifest.json").exists() else
                   "     export INFEMERAL_CLIENT_BUNDLE=~/bundles/NAME/client   # the matching client bundle\n")
    steps.append(f"""\
5. Connect from the laptop, with TLS pinned to the pod's certificate and the API key:
     set -a; . {q(str(creds['client_env'].resolve()))}; set +a
     export INFEMERAL_SERVER=203.0.113.7:41234     # the pod's public IP and external port
{bundle_line}     infemeral-client info                          # fingerprint must be {manifest.get('fingerprint')}
     infemeral-client chat --session work
""")
    return "\n".join(steps)


# --- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runpod.py", description=__doc__.split("\n\n", 1)[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def name_options(p):
        p.add_argument("--server-name", default=SERVER_NAME,
                       help=f"name in the certificate, which clients check (default: {SERVER_NAME})")

    def cert_options(p):
        p.add_argument("--dns", action="append", default=[], metavar="NAME",
                       help="another DNS name for the certificate (repeatable)")
        p.add_argument("--ip", action="append", default=[], metavar="ADDRESS",
                       help="an IP address for the certificate (repeatable); not needed with the server name")
        p.add_argument("--days", type=int, default=825, help="certificate lifetime in days (default: 825)")
        p.add_argument("--renew", action="store_true",
                       help="make a new certificate, key and API key even if --out has them (clients must "
                            "then pin the new certificate)")

    p = sub.add_parser("pack", help="tarball of the server bundle + credentials, and the whole guide",
                       description="Pack the server bundle with a TLS certificate, key, API key and an empty "
                                   "store into one tarball for the pod's /workspace volume, write its SHA-256, "
                                   "and print every step of the deployment.")
    p.add_argument("--bundle-dir", type=Path, required=True,
                   help="the server/ directory written by `infemeral-client prepare`")
    p.add_argument("--out", type=Path, default=Path("infemeral-runpod"),
                   help="folder for the tarball, its checksum and the credentials (default: ./infemeral-runpod)")
    p.add_argument("--image", default=PLACEHOLDER_IMAGE, help="the image RunPod pulls, built from docker/Dockerfile (default: a placeholder)")
    p.add_argument("--uid", type=int, default=DEFAULT_UID, help=f"owner of the files on the pod: the image's user (default: {DEFAULT_UID})")
    p.add_argument("--gid", type=int, default=DEFAULT_GID, help=f"group of the files on the pod (default: {DEFAULT_GID})")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking the bundle's file hashes against its manifest")
    name_options(p)
    cert_options(p)

    c = sub.add_parser("credentials", help="self-signed TLS certificate, key, API key and client.env",
                       description="Write server.crt, server.key, api-keys and client.env into --out (for "
                                   "docker/compose.yaml: --out docker/tls). Existing files are kept.")
    c.add_argument("--out", type=Path, required=True, help="folder to write them to")
    c.add_argument("--client-bundle", type=Path, help="client bundle, recorded in client.env")
    name_options(c)
    cert_options(c)

    t = sub.add_parser("template", help="print the RunPod template settings")
    t.add_argument("--image", default=PLACEHOLDER_IMAGE, help="the image RunPod pulls (default: a placeholder)")
    t.add_argument("--volume-gb", type=int, default=50, help="network volume size to suggest (default: 50)")
    t.add_argument("--json", action="store_true", help="print JSON instead of text")
    name_options(t)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "template":
            t = template(args.image, args.server_name, args.volume_gb)
            print(json.dumps(t, indent=2) if args.json else template_text(t), end="\n" if args.json else "")
        elif args.command == "credentials":
            creds = make_credentials(args.out, args.server_name, tuple(args.dns), tuple(args.ip), args.days,
                                     args.client_bundle, args.renew)
            for path in creds.values():
                print(path)
        else:
            bundle_dir = args.bundle_dir.expanduser()
            manifest = read_server_manifest(bundle_dir, verify=args.verify)
            args.out.mkdir(parents=True, exist_ok=True)
            creds = make_credentials(args.out / "credentials", args.server_name, tuple(args.dns), tuple(args.ip),
                                     args.days, bundle_dir.parent / "client", args.renew)
            tar_path = args.out / TARBALL
            digest = write_tarball(bundle_dir, creds, tar_path, args.uid, args.gid)
            print(guide(manifest, bundle_dir, args.out, tar_path, digest, creds, args.image, args.server_name,
                        bundle_bytes(bundle_dir)))
            if args.image == PLACEHOLDER_IMAGE:
                print(f"(pass --image to fill in your own image name instead of {PLACEHOLDER_IMAGE})")
    except (PackError, OSError, ValueError) as e:
        print(f"runpod.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
