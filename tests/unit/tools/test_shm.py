"""Which /dev/shm entries a managed server may remove when it stops: only those its own processes
were seen holding, and never one that a process still running holds, by a mapping, an open
descriptor, or (a loky semaphore on its way to a child, held by none for a moment) by being its
creator."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_piep.tools.server import held_shm, shm_entries

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm here")


@pytest.fixture
def entries() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)


def _entry(made: list[Path], name: str) -> str:
    path = SHM / name
    path.write_bytes(b"\0" * 32)
    made.append(path)
    return name


def test_a_loky_semaphore_is_held_while_its_creator_runs_and_not_after(
        entries: list[Path]) -> None:
    tag = uuid.uuid4().hex[:8]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    live = _entry(entries, f"sem.loky-{os.getpid()}-{tag}")
    dead = _entry(entries, f"sem.loky-{dead_pid}-{tag}")
    plain = _entry(entries, f"piep-test-{tag}")  # nobody maps or opens it
    assert {live, dead, plain} <= shm_entries()
    held = held_shm()
    assert live in held
    assert dead not in held and plain not in held


def test_an_entry_a_process_keeps_open_is_held(entries: list[Path]) -> None:
    name = _entry(entries, f"piep-test-{uuid.uuid4().hex[:8]}")
    with open(SHM / name, "rb"):
        assert name in held_shm()
    assert name not in held_shm()


def test_the_entries_of_given_processes_are_theirs_alone(entries: list[Path]) -> None:
    """What a server takes for its own is what its processes hold: an entry another process
    holds (a server starting beside it) is not."""
    mine = _entry(entries, f"piep-test-{uuid.uuid4().hex[:8]}")
    theirs = _entry(entries, f"piep-test-{uuid.uuid4().hex[:8]}")
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              f"f = open('/dev/shm/{theirs}', 'rb')\n"
                              "print('open', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        with open(SHM / mine, "rb"):
            assert held_shm({os.getpid()}) >= {mine}
            assert theirs not in held_shm({os.getpid()})
            assert theirs in held_shm({child.pid}) and mine not in held_shm({child.pid})
    finally:
        child.communicate("")
