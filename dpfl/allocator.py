"""Large blocks of memory kept for reuse from one round to the next (glibc's malloc).

A round of many clients allocates a few ``[block, d]`` tensors (the clipped sums, the noise,
the noised uploads: 208 MB each for 256 clients of the MNIST MLP, d = 203,530) and frees them
before the next round asks for the same sizes. glibc's malloc serves every request above its
largest mmap threshold (32 MiB on 64-bit systems) with a fresh ``mmap`` and gives it back on
``free``, so the kernel faults those pages in and zeroes them again every round: on a
1,000-client DPSGD-GC round of the MNIST MLP that was about a third of the round
(docs/performance.md, "Scale"). :func:`keep_freed_memory` turns that off for this process,
``mallopt(M_MMAP_MAX, 0)`` (large blocks come from the heap) and a trim threshold of 2 GiB
(freed blocks stay for the next request), the effect PyTorch's CPU performance guide
gets from preloading jemalloc or tcmalloc, with the C library already loaded.

The price is that memory a process has freed is not given back to the system before it exits:
its resident size stays at its peak. The engine and a Flower node's client runtime ask for it
(:class:`~dpfl.engine.runner.EngineTransport`, :class:`~dpfl.client.numpy_client.AlgorithmClient`);
``DPFL_MALLOC=system`` in the environment keeps glibc's defaults (a process that embeds dpfl
beside other work). Elsewhere than glibc (macOS, musl) it does nothing. No number a run
computes depends on it: where a block sits changes nothing but its address (every tensor stays
64-byte aligned).
"""

from __future__ import annotations

import ctypes
import os
import platform

#: ``mallopt`` parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
#: the trim threshold: the largest a C int holds (2 GiB); only a free top of the heap above it
#: goes back to the system
NEVER = 2**31 - 1
#: the environment variable that keeps the C library's defaults when set to "system"
ENVIRONMENT = "DPFL_MALLOC"

_done = False


def keep_freed_memory() -> bool:
    """Make this process's glibc malloc keep large freed blocks for reuse (module docstring);
    True if it now does (once per process: later calls answer as the first)."""
    global _done
    if _done:
        return _done
    if os.environ.get(ENVIRONMENT, "").strip().lower() == "system":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    _done = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER))
    return _done
