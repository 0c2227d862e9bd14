"""A CPU run keeps freed host memory for reuse (``moetrain.runtime_base.host_memory``)."""

import platform
import subprocess
import sys

import pytest

from moetrain.runtime_base.host_memory import keep_freed_host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A step's activations in small: 136 MiB of buffers of 1 to 30 MiB, written, then all freed. Printed: the
# process's resident MiB at the peak and after the free.
STEP = """
import sys, torch
from moetrain.runtime_base.host_memory import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
buffers = [torch.empty(mib * 2**18).fill_(1.0) for mib in (1, 3, 8, 2, 12, 5, 30, 7) * 2]
peak = resident_mib()
del buffers
print(peak, resident_mib())
"""


def _resident_mib(mode: str) -> tuple[float, float]:
    done = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True)
    peak, after = done.stdout.split()[-2:]
    return float(peak), float(after)


@pytest.mark.skipif(not GLIBC, reason="the switches are glibc's")
def test_freed_memory_stays_in_the_process():
    # glibc's own thresholds hand the freed buffers back to the kernel: the next step faults every page of
    # them in again (and the kernel zeroes it)
    peak, after = _resident_mib("system")
    assert peak - after > 100
    # kept: the memory stays mapped for the next step's buffers
    peak, after = _resident_mib("keep")
    assert peak - after < 8


def test_switches_are_set_once_and_say_whether_they_took():
    assert keep_freed_host_memory() is GLIBC
    assert keep_freed_host_memory() is GLIBC  # cached: the second call changes nothing


# The same step on a rank that ``spawn`` starts from a process that never set the switches: ranks join
# through ``init_world`` (spawn, torchrun, Ray actors), which sets them for a CPU rank.
RANK = """
import torch
from moetrain.distributed.world import spawn
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def step(rank, world_size):
    buffers = [torch.empty(mib * 2**18).fill_(1.0) for mib in (1, 3, 8, 2, 12, 5, 30, 7) * 2]
    peak = resident_mib()
    del buffers
    return peak, resident_mib()
if __name__ == "__main__":
    ((peak, after),) = spawn(step, 1)
    print(peak, after)
"""


@pytest.mark.skipif(not GLIBC, reason="the switches are glibc's")
def test_a_cpu_rank_keeps_its_freed_memory(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
    peak, after = map(float, done.stdout.split()[-2:])
    assert peak - after < 8
