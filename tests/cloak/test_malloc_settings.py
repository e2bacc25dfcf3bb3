"""glibc heap settings (cloak/heap.py): the server caps its arenas as it starts, the setting reaches glibc,
and off glibc nothing is called. Cheap: fakes in-process, one small child process without torch."""

from __future__ import annotations

import platform
import subprocess
import sys

from infemeral.cloak import heap


class Recorder:
    """Stands in for glibc's `mallopt`: records (parameter, value) and accepts every call."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return 1


def test_the_server_caps_glibc_arenas_before_it_serves(monkeypatch, tmp_path):
    import infemeral.server.app as app
    from infemeral.server.main import main as server_main

    mallopt = Recorder()
    monkeypatch.setattr(heap, "_glibc_mallopt", lambda: mallopt)
    seen_when_serving = []
    monkeypatch.setattr(app, "serve_forever", lambda settings: seen_when_serving.extend(mallopt.calls) or 0)
    assert server_main(["--bundle", str(tmp_path), "--store", str(tmp_path / "store"), "--listen", "127.0.0.1:0",
                        "--metrics-port", "0"]) == 0
    assert seen_when_serving == [(heap.M_ARENA_MAX, heap.SERVER_ARENAS)] == [(-8, 2)]  # glibc's M_ARENA_MAX


def test_off_glibc_nothing_is_called(monkeypatch):
    mallopt = Recorder()

    class OtherLibc:  # musl or macOS: a mallopt may be there, glibc's version query is not
        def __init__(self, name):
            self.mallopt = mallopt

    monkeypatch.setattr(heap.ctypes, "CDLL", OtherLibc)
    assert heap.cap_arenas() is False and heap.map_large_allocations() is False
    assert mallopt.calls == []


def arenas_in_a_child(cap: bool) -> int:
    """glibc's arena count in a fresh process whose 6 threads each hold an allocation at the same time."""
    code = f"""
import ctypes, threading
from infemeral.cloak.heap import cap_arenas
assert cap_arenas() if {cap} else True
together, held = threading.Barrier(6), []
def hold():
    together.wait()
    held.append(bytearray(50_000))  # below the mmap threshold: from this thread's arena
    together.wait()
threads = [threading.Thread(target=hold) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()  # one 'Arena N:' block per arena, on stderr
"""
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    return sum(line.startswith("Arena ") for line in err.splitlines())


def test_the_cap_reaches_glibc():
    if platform.libc_ver()[0] != "glibc":
        import pytest

        pytest.skip("arenas are a glibc matter")
    assert arenas_in_a_child(cap=False) > heap.SERVER_ARENAS  # the threads did make arenas of their own
    assert arenas_in_a_child(cap=True) == heap.SERVER_ARENAS
