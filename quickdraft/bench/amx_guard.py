"""Keeping llama.cpp off Intel AMX, whose kernels crash on this project's models: a seccomp filter
that makes the process's request for the AMX tile state fail, so that ggml finds AMX "not ready"
and multiplies with its other CPU kernels (AVX512/VNNI).

Standard library only, and importing nothing of quickdraft: llamacpp_worker.py imports it as a
sibling (both run by path), and as a script (`python amx_guard.py PROGRAM ARGS...`) it installs the
filter and then becomes PROGRAM (llama-server), which keeps the filter across exec.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys
from pathlib import Path

AMX_REFUSED = ("AMX refused: llama.cpp's AMX kernels crash on their first matmul here "
               "(ggml_backend_amx_mul_mat, llama.cpp issue #20824); its AVX512/VNNI kernels run")
_amx_filter: list[ctypes.Array] = []  # the installed seccomp program: it must outlive the process's threads


def has_amx() -> bool:
    """Linux on x86-64 with AMX-INT8 (what ggml's AMX kernels need)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def amx_refused() -> bool:
    """Whether this process installed the filter."""
    return bool(_amx_filter)


def refuse_amx_tile_state() -> str:
    """On a CPU with AMX-INT8, make this process's requests for the AMX tile state fail
    (arch_prctl(ARCH_REQ_XCOMP_PERM) returns EPERM, through a seccomp filter that exec keeps),
    before llama.cpp loads a model. Returns AMX_REFUSED when it did so, "" where AMX is absent."""
    if _amx_filter:
        return AMX_REFUSED
    if not has_amx():
        return ""
    # classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}: (code, jt, jf, k)
    program = [(0x20, 0, 0, 4), (0x15, 0, 5, 0xC000003E),    # arch == x86-64, else allow
               (0x20, 0, 0, 0), (0x15, 0, 3, 158),            # nr == arch_prctl, else allow
               (0x20, 0, 0, 16), (0x15, 0, 1, 0x1023),        # args[0] == ARCH_REQ_XCOMP_PERM, else allow
               (0x06, 0, 0, 0x00050000 | errno.EPERM),        # SECCOMP_RET_ERRNO | EPERM
               (0x06, 0, 0, 0x7FFF0000)]                      # SECCOMP_RET_ALLOW
    filters = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in program))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(program), ctypes.addressof(filters)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, None, 0, 0) != 0 or libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "could not keep llama.cpp off AMX (its AMX kernels crash on this CPU)")
    _amx_filter.extend((filters, fprog))
    return AMX_REFUSED


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python amx_guard.py PROGRAM [ARGS...]")
    refuse_amx_tile_state()
    os.execv(sys.argv[1], sys.argv[1:])
