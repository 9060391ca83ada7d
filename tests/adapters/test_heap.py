"""Large frees go back to the system (adapters read and dropped by the thousand kept gigabytes of heap)."""

import subprocess
import sys

SCRIPT = """
import sys
from loraplex.adapters.heap import return_large_frees

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

if sys.argv[1] == "fixed":
    assert return_large_frees()
block = b"x" * (8 << 20)  # glibc maps it; freeing it raises the threshold to its size (unless fixed)
del block
before = anon_kib()
block = b"y" * (8 << 20)  # unfixed: from the heap, and kept by the process once freed
del block
print(anon_kib() - before)
"""


def grown_kib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_a_freed_large_block_leaves_resident_memory():
    if not sys.platform.startswith("linux"):
        return
    assert grown_kib("fixed") < 2 << 10
    assert grown_kib("unfixed") >= 6 << 10  # what the fix is for: glibc's default keeps it
