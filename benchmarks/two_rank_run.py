"""A training run on two local ranks, as the benchmarks launch one: torchrun on this machine, telemetry spooled to a
temporary directory, and rank 0's metric payloads handed back in step order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.telemetry import read_spool

ROOT = Path(__file__).resolve().parents[1]


def rank0_metrics(document: dict) -> list[dict]:
    """Run `document` (a run config) on two ranks; rank 0's metric payloads, one per step."""
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "run.json"
        config.write_text(json.dumps(document))
        environ = {key: value for key, value in os.environ.items() if not key.startswith("LOOM_")}
        environ.update(LOOM_SPOOL_DIR=str(Path(workdir) / "spool"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        command += ["-m", "trainer.train", "--config", str(config)]
        subprocess.run(command, cwd=ROOT, env=environ, check=True, capture_output=True)
        metrics = [
            event
            for batch in read_spool(Path(workdir) / "spool")
            if batch["rank"] == 0
            for event in batch["events"]
            if event["kind"] == "metric"
        ]
    return [event["payload"] for event in sorted(metrics, key=lambda event: event["step"])]
