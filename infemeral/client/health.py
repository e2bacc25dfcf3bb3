"""Wait for a server to report SERVING through the standard gRPC health service."""

from __future__ import annotations

import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_until_serving(address: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Return once `address` is healthy; fail early if the server process `proc` exits."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up with code {proc.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"server at {address} did not become healthy within {timeout:.0f} s")
