"""Mixture-of-experts throughput with expert parallelism against the same model without it, on CPU ranks: a 2-rank
trainer run of an 8-expert top-2 model on dp_shard 2, once with ep 2 (each rank holds 4 experts, tokens travel over
all-to-alls) and once with ep 1 (FSDP shards all 8 experts, each rank runs its own tokens through them), launches
alternating. Prints each launch's median tokens/s, the ep-2/ep-1 ratio of the medians, and the dispatch's share of
an MoE block's forward and backward under ep 2 (the all-to-alls and their waits, from torch.profiler on 2 gloo
ranks).

    .venv/bin/python benchmarks/moe.py                     # 3 launches each way, 30 steps each
    .venv/bin/python benchmarks/moe.py --launches 1 --steps 10

On a GPU the same comparison belongs to the GPU script; CPU ranks have no fast links, so the ratio here says what
splitting the experts saves in expert compute against what the all-to-alls cost on gloo.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from trainer.config import ModelConfig, ParallelConfig
from trainer.model import Transformer
from trainer.parallel.expert import apply_expert_parallel
from trainer.parallel.mesh import ParallelMesh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from two_rank_run import rank0_metrics  # noqa: E402

WARMUP_STEPS = 3
MODEL = {"layers": 4, "dim": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "seq_len": 128, "experts": 8, "top_k": 2}
DISPATCH_OPS = ("alltoall", "all_to_all", "wait_tensor")


def moe_run(steps: int, ep: int) -> dict:
    return {
        "steps": steps,
        "model": MODEL,
        "parallel": {"dp_shard": 2, "ep": ep},
        "compute": {"precision": "fp32"},
        "data": {"micro_batch": 8, "corpus_bytes": 300_000},
        "telemetry": {"comm": False},
    }


def tokens_per_s(document: dict) -> list[float]:
    """Each step's tokens/s of the whole run (rank 0's share times the two data-parallel ranks)."""
    return [2 * payload["tokens_per_s"] for payload in rank0_metrics(document)]


def dispatch_share(rank: int, store_path: str, results: dict) -> None:
    """One rank's share of an MoE block's forward and backward spent in the dispatch's collectives."""
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = ParallelMesh(ParallelConfig(dp_shard=2, ep=2), 2, "cpu")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**MODEL, "layers": 1}))
    apply_expert_parallel(model, mesh.experts)
    block = model.blocks["0"].mlp
    x = torch.randn(8, MODEL["seq_len"], MODEL["dim"], requires_grad=True)
    for _ in range(WARMUP_STEPS):
        block(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(10):
            block(x).sum().backward()
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    dispatch = sum(event.self_cpu_time_total for event in events if any(op in event.key for op in DISPATCH_OPS))
    results[rank] = dispatch / total
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3, help="launches with ep 2, and as many with ep 1")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    measured: dict[int, list[float]] = {1: [], 2: []}
    for launch in range(args.launches):
        for ep in (1, 2):
            rates = tokens_per_s(moe_run(args.steps, ep))[WARMUP_STEPS:]
            measured[ep] += rates
            print(f"launch {launch + 1} ep {ep}: median {statistics.median(rates):,.0f} tokens/s")
    with_ep, without = statistics.median(measured[2]), statistics.median(measured[1])
    print(f"median tokens/s: ep 2 {with_ep:,.0f}, ep 1 {without:,.0f}, ep2/ep1 {with_ep / without:.3f}")
    with tempfile.TemporaryDirectory() as workdir, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(dispatch_share, args=(str(Path(workdir) / "store"), results), nprocs=2)
        shares = [results[rank] for rank in range(2)]
    print(
        f"dispatch share of an MoE block's forward and backward (ep 2): {statistics.mean(shares):.1%} (per rank: "
        + ", ".join(f"{share:.1%}" for share in shares)
        + ")"
    )


if __name__ == "__main__":
    main()
