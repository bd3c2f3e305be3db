"""How a test's spawned ranks meet (a rendezvous port) and how each ends once its results are on disk.

After FSDP2 or DeepSpeed on gloo, torch keeps the group's worker threads running past
``destroy_process_group`` (gdb shows them; a plain all-reduce leaves none). In a few loaded 2-core runs a rank
then died of SIGABRT while its interpreter shut down ("terminate called without an active exception"), after
every result was written, and ``mp.start_processes`` failed the fixture. A rank that has written its results
has nothing left to do: it leaves without the interpreter's teardown. Tests only.
"""

from __future__ import annotations

import os
import random
import socket
import sys

# Below Linux's ephemeral range (32768-60999): a port the kernel hands out for bind(0) or an outgoing connection is
# never one of these, so between finding one free and the rank binding it only an explicit bind can take it.
RENDEZVOUS_PORTS = range(20000, 32000)


def leave_rank() -> None:
    """Exit this spawned rank with status 0 now, stdio flushed, skipping the interpreter's teardown. Call it
    only after the results are written and the process group is destroyed; an error before it still fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for ``MASTER_PORT`` (as torchrun sets it), drawn outside the
    ephemeral range so that no other process's automatic port can land on it before the ranks bind it."""
    for port in random.Random(os.getpid()).sample(RENDEZVOUS_PORTS, 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {RENDEZVOUS_PORTS} after 200 tries")
