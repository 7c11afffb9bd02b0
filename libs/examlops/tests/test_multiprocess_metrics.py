"""svc.multiprocess_metrics: a fresh directory per start, and the ones a killed start left removed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from examlops.svc import metrics_dir, multiprocess_metrics

SERVICE = "mpm-test"


def test_a_directory_left_under_this_process_id_is_removed_at_start() -> None:
    # a parent killed in a container restarts with the same pid in a fresh pid namespace, and /tmp kept
    left = Path(tempfile.mkdtemp(prefix=f"examlops-{SERVICE}-metrics-{os.getpid()}-"))
    (left / "counter_123.db").write_bytes(b"\0" * 16)
    with multiprocess_metrics(SERVICE, 2) as path:
        assert path is not None and path.is_dir()
        assert metrics_dir(SERVICE, os.getpid()) == [path]
    assert not left.exists() and not path.exists()
