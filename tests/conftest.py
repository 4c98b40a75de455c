"""Suite-wide settings."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# The experiment scripts in benchmarks/ are not part of the package (the wheel does not ship
# them): `python benchmarks/NAME.py` puts that folder first on sys.path and they import each other
# by bare name (`from engine import workload`). Tests import them the same way (`import
# gpu_check`). Appended, not prepended, so no script name can hide an installed module; that no
# package module imports them is tests/unit/test_benchmarks_folder.py's job.
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))

# A Ray head waits 30 s for its GCS to bind a port; on a loaded 2-core CI machine a GCS started
# right after the previous module's cluster went down once took longer (test_multinode's
# 3-node cluster: "Timed out waiting for file .../gcs_server_port_..."). Still a deadline.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests assert behaviour, never time: no per-example deadline, and no health check that
# fails a test because a loaded CI machine generated its examples slowly.
settings.register_profile("pdserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pdserve")

_exit_status = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config):
    # Runs after the summary is printed. Daemon threads that Ray, gRPC and torch.distributed
    # leave behind can crash CPython's finalization (seen as a segfault after a green run);
    # nothing is left to clean up here, so leave with the session's own status.
    if _exit_status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)
