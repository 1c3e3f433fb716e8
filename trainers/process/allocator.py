"""The C allocator of a CPU trainer: large freed blocks kept for the next step instead of unmapped.

A training step on the CPU allocates and frees the same large tensors every step (activations,
their gradients, a chunk of logits: megabytes each). glibc's ``malloc`` serves a block above its
mmap threshold with a fresh mapping and unmaps it on ``free``, so every step faults the same pages
in again, each one zeroed by the kernel: system time the step spends on nothing. With the
threshold at glibc's largest (32 MiB) and the heap's free top kept, those blocks come back from the
heap. Measured on ``benchmarks/side_by_side.py``'s workload (one thread, 12 steps): page faults
of the whole run from 0.79 to 0.46 million, system time 1.8 to 1.4 s, steady steps about 3%
faster, peak RSS under 1% higher.

Only glibc has ``mallopt``; elsewhere (musl) nothing changes.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): a larger value is refused.
MMAP_THRESHOLD = 32 * 1024 * 1024
# Free memory at the heap's top kept up to this much, rather than given back after each step.
TRIM_THRESHOLD = 1024 * 1024 * 1024


def keep_large_blocks() -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to 1 GiB of its free top. True when
    glibc took both settings."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
