"""What the collective recorder costs: the 2-rank DDP demo run (layers 4, dim 128, seq_len 128, micro_batch 8)
launched with telemetry.comm on and off, alternately, under torchrun on CPU. Prints each launch's median step time
and the on/off ratio of the medians over all launches (below 1.05: within the 5 % budget).

    .venv/bin/python benchmarks/comm_overhead.py                    # 3 launches each way, 40 steps each
    .venv/bin/python benchmarks/comm_overhead.py --launches 5 --steps 60

The first WARMUP_STEPS steps of each launch (allocator warm-up, DDP's bucket rebuild) are left out. Other work on the
machine slows whichever launch it overlaps, so the script also prints the load average around the measurement and
the ratio of the 10th percentiles: the recorder's cost is paid on every step, fast ones included, while other load
mostly adds slow ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from two_rank_run import rank0_metrics  # noqa: E402

WARMUP_STEPS = 5


def demo_run(steps: int, comm: bool) -> dict:
    return {
        "steps": steps,
        "model": {"layers": 4, "dim": 128, "seq_len": 128},
        "parallel": {"dp_replicate": 2},
        "compute": {"precision": "fp32"},
        "data": {"micro_batch": 8, "corpus_bytes": 300_000},
        "telemetry": {"comm": comm, "comm_window_steps": 10},
    }


def step_times(document: dict) -> list[float]:
    """Each step's time on rank 0, from its metric events."""
    return [payload["step_time_s"] for payload in rank0_metrics(document)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3, help="launches with the recorder on, and as many off")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    measured: dict[bool, list[float]] = {True: [], False: []}
    load_before = os.getloadavg()[0]
    for launch in range(args.launches):
        for comm in (False, True):
            times = step_times(demo_run(args.steps, comm))[WARMUP_STEPS:]
            measured[comm] += times
            state = "on " if comm else "off"
            print(f"launch {launch + 1} comm {state}: median step {statistics.median(times) * 1e3:.1f} ms")
    on, off = statistics.median(measured[True]), statistics.median(measured[False])
    print(f"median step: comm on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, on/off {on / off:.3f}")
    on, off = tenth_percentile(measured[True]), tenth_percentile(measured[False])
    print(f"10th percentile step: comm on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, on/off {on / off:.3f}")
    print(f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")


def tenth_percentile(times: list[float]) -> float:
    return statistics.quantiles(times, n=10)[0]


if __name__ == "__main__":
    main()
