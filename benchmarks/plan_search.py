"""How long the layout search takes: Llama-3 405B on 16,384 H100s (2,048 nodes × 8) at 2,048 sequences of 8,192
tokens a step, against a budget of 1 s, and Llama-3 70B on 64 H100s (8 nodes) at 512 sequences.

    .venv/bin/python benchmarks/plan_search.py              # 5 runs of each search
    .venv/bin/python benchmarks/plan_search.py --runs 9

Prints per search the layouts evaluated (checked against the run-config rules), valid, fitting and timed exactly,
the median wall-clock seconds of the runs (time.perf_counter) and CPU seconds (time.process_time, which other load on
the machine moves less), layouts evaluated and valid layouts per second, and the fastest layout; then the ratio of the
405B median to the budget (below 1: within it).
Each run is a fresh search: nothing is cached between runs but Python's own imports.
"""

from __future__ import annotations

import argparse
import statistics
import time

from trainer.plan.search import SearchResult, search

BUDGET_S = 1.0
SEARCHES = {
    "llama3-405b on 16,384 H100 (2,048 nodes × 8), 2,048 × 8,192 tokens": (
        {"preset": "llama3-405b"},
        {"gpu": "H100-SXM", "nodes": 2048, "gpus_per_node": 8},
        2048,
    ),
    "llama3-70b on 64 H100 (8 nodes × 8), 512 × 8,192 tokens": (
        {"preset": "llama3-70b"},
        {"gpu": "H100-SXM", "nodes": 8, "gpus_per_node": 8},
        512,
    ),
}


def timed_runs(model: dict, cluster: dict, global_batch: int, runs: int) -> tuple[SearchResult, list, list]:
    """The last run's result, and every run's wall-clock and CPU seconds."""
    wall, cpu = [], []
    for _ in range(runs):
        started, started_cpu = time.perf_counter(), time.process_time()
        result = search(model, cluster, global_batch)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return result, wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="searches per case; the median is reported")
    args = parser.parse_args()
    medians = {}
    for name, (model, cluster, global_batch) in SEARCHES.items():
        result, wall, cpu = timed_runs(model, cluster, global_batch, args.runs)
        medians[name] = median = statistics.median(wall)
        fastest = result.results[0] if result.results else None
        print(name)
        print(
            f"  {result.evaluated:,} layouts evaluated, {result.valid:,} valid, {result.fitting:,} fit, "
            f"{result.timed:,} timed exactly; {len(result.pareto)} on the Pareto frontier"
        )
        print(
            f"  median {median:.3f} s wall ({', '.join(f'{s:.3f}' for s in wall)}), "
            f"{statistics.median(cpu):.3f} s CPU; per second: {result.evaluated / median:,.0f} layouts evaluated, "
            f"{result.valid / median:,.0f} valid"
        )
        if fastest:
            print(
                f"  fastest: {fastest.summary}: {fastest.tokens_per_s:,.0f} tokens/s, MFU {fastest.mfu:.1%}, "
                f"{fastest.peak_bytes / 2**30:.1f} GiB"
            )
        else:
            print(f"  {result.message}")
    first = next(iter(SEARCHES))
    print(f"405B search / {BUDGET_S:g} s budget: {medians[first] / BUDGET_S:.2f}")


if __name__ == "__main__":
    main()
