"""pdserve's compiled CPU kernels (``csrc/``), built on first use and loaded as torch ops.

``paged_decode_attention``: decode attention reading the paged KV pool in place (see
csrc/paged_attention.cpp). The "paged" attention backend uses it for decode tokens; context
chunks keep gather + SDPA.

``rms_norm`` / ``add_rms_norm`` (csrc/norms.cpp): RMSNorm as one op, and the residual add
fused in front of it; ``layers.RMSNorm`` uses them on CPU rows whenever they are built (a
decode step of the small benchmark model 3.5-7.6 % faster than torch's rms_norm, which runs as
five or six ops).

``silu_mul`` / ``rope_store`` (csrc/activations.cpp): the gated MLP's SiLU x up as one op
into contiguous rows, and RoPE on q and k fused with the K/V write into the pool; used by
``layers.GatedMLP`` and ``attention.Attention.project`` on CPU rows.

``shm_group_open`` / ``shm_all_reduce`` / ``shm_all_gather`` (csrc/shm_collectives.cpp): a CPU
worker group's collectives through a shared-memory segment instead of gloo's TCP loopback;
``shm_group.ShmCollectives`` sets them up for ``TensorParallel``.

Built with ``torch.utils.cpp_extension.load`` (g++ and ninja; the ``ninja`` wheel is a
dependency, its binary put on PATH when none is there) for this machine's CPU
(``-march=native``), into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
~/.cache/torch_extensions): about 15 s the first time on a 2-core machine, then a load from the
cache; concurrent processes wait on torch's build lock. When the build fails (no compiler) or
``PDSERVE_CPU_KERNELS=0``, ``available()`` is False and the engine uses gather + SDPA.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_DISABLE = "PDSERVE_CPU_KERNELS"
STALE_LOCK_S = 300.0
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "norms.cpp", "activations.cpp",
                                              "shm_collectives.cpp")]
HEADERS = [CSRC / "vec_math.h"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def supports_head_dim(head_dim: int) -> bool:
    """The kernel's head sizes: a multiple of 16 lanes, at most 256."""
    return head_dim % 16 == 0 and 0 < head_dim <= 256


def available() -> bool:
    """Whether the kernels are loaded (building them on the first call)."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return bool(_state["ok"])


def _load() -> bool:
    if os.environ.get(ENV_DISABLE, "").strip() in ("0", "false", "no", "off"):
        log.info("%s=0: compiled CPU kernels off", ENV_DISABLE)
        return False
    if hasattr(torch.ops, "pdserve_cpu") and hasattr(torch.ops.pdserve_cpu, "shm_all_gather"):
        return True
    try:
        if shutil.which("ninja") is None:
            import ninja  # the PyPI wheel: its binary, for torch's builder

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        from torch.utils import cpp_extension

        name = extension_name()
        try:  # torch's build directory (a private helper: a change there only skips the check)
            _clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock")
        except Exception as e:  # noqa: BLE001
            log.debug("no stale-lock check: %s", e)
        cpp_extension.load(
            name=name, sources=[str(p) for p in SOURCES],
            # -fopenmp-simd: the simd pragmas only. Full -fopenmp would link a second OpenMP
            # runtime beside torch's, whose threads ignore torch.set_num_threads and spin
            # against the worker's own (measured slower than gather + SDPA that way).
            # The headers' digest as a define: torch's builder hashes the sources and the
            # flags to decide whether to rebuild, not the headers they include.
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd", f"-DPDSERVE_HEADERS={headers_digest()}"],
            is_python_module=False, verbose=False,
        )
        torch.ops.pdserve_cpu.paged_decode_attention  # noqa: B018 - raises if not registered
        torch.ops.pdserve_cpu.add_rms_norm  # noqa: B018
        torch.ops.pdserve_cpu.rope_store  # noqa: B018
        torch.ops.pdserve_cpu.shm_all_reduce  # noqa: B018
        torch.ops.pdserve_cpu.shm_all_gather  # noqa: B018
        return True
    except Exception as e:  # noqa: BLE001 - any build or load failure: fall back
        log.warning("pdserve's CPU kernels could not be built (%s: %s); decode attention uses "
                    "gather + SDPA", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False


def extension_name() -> str:
    """The build's name, with a digest of this CPU's feature flags and of where the sources
    are: it is built with -march=native, so a cache shared between machines (a network home)
    must not hand one CPU's build to another; and torch's build directory keeps the sources'
    paths in its ninja file, so two checkouts sharing one name rebuilt it in turn on every
    first load, each under torch's lock (seen: a worker restarted while another checkout's
    build held the lock waited minutes for it)."""
    flags = platform.machine() + str(CSRC)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line.split(":", 1)[1]
                break
    except OSError:
        pass
    return "pdserve_cpu_kernels_" + hashlib.sha1(flags.encode()).hexdigest()[:10]


def headers_digest() -> str:
    """A digest of the headers the kernels include (see the build flags in _load)."""
    h = hashlib.sha1()
    for path in HEADERS:
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _clear_stale_lock(lock: Path, stale_s: float = STALE_LOCK_S, poll_s: float = 0.5) -> None:
    """torch's builder waits without a deadline while its lock file exists, and a process killed
    mid-build leaves one behind. A build takes seconds, so a lock is waited on only until it is
    stale_s old (from its last change); then it is removed and this process builds. Seen: a CI
    run killed mid-build left a fresh lock, and the next run's build waited 534 s for it."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return  # no build under way, or it finished
        if age > stale_s:
            log.warning("removing a stale build lock %s (%.0f s old)", lock, age)
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
            return
        time.sleep(min(poll_s, stale_s - age + 0.01))


def paged_decode_attention(q: torch.Tensor, layer_kv: torch.Tensor, token_index: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None,
                           out: torch.Tensor) -> None:
    """out[token_index[i]] = attention of q[token_index[i]] ([T, h, d] rows) over keys
    max(0, lens[i] - window) .. lens[i] - 1 of sequence i, read from ``layer_kv``
    [2, num_blocks, B, kv_heads, d] through ``tables[i]`` (int64 block ids)."""
    if not available():
        raise RuntimeError("pdserve's CPU kernels are not built (see the log); use the sdpa backend")
    torch.ops.pdserve_cpu.paged_decode_attention(q, layer_kv, token_index, tables, lens, float(scale),
                                                 -1 if window is None else int(window), out)


def main() -> int:
    """Build (or load) the kernels now and say so; the Makefile's install step runs it, so that
    tests and workers only load the cached build. Exit status 0 either way: without a compiler
    pdserve runs with gather + SDPA."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    ok = available()
    print(f"pdserve CPU kernels: {'ready' if ok else 'not built (decode attention will use gather + SDPA)'} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
