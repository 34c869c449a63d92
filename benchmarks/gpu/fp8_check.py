"""fp8 training on this GPU: loom's model trained for a few steps in bf16 and with fp8 matmuls (torchao's float8,
tensorwise and rowwise scaling) from the same weights on the same batches, one process, eager. Prints each
precision's median step time, tokens/s and its ratio to bf16, and the last step's loss beside bf16's (also as
JSON with --json).

    python benchmarks/gpu/fp8_check.py             # on a GPU of compute capability 8.9 or later
    python benchmarks/gpu/fp8_check.py --dry-run   # a tiny model on CPU: the script's wiring

On an older GPU it says that the trainer refuses fp8 there (as a run would) and writes that instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trainer.config import ModelConfig, OptimizerConfig
from trainer.model import Transformer
from trainer.parallel.float8 import apply_float8, fp8_refusal
from trainer.train import build_optimizer

# Wide matrices, where fp8's rate shows: four Llama-3-8B-wide blocks.
GPU_MODEL = ModelConfig(layers=4, dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq_len=2048)
CPU_MODEL = ModelConfig(layers=2, dim=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=32)
PRECISIONS = ("bf16", "tensorwise", "rowwise")


def train(model_config: ModelConfig, scaling: str | None, batches: list[torch.Tensor], device: torch.device):
    """(step times, last loss) of training from seed 0 on the batches, with fp8 matmuls under `scaling`."""
    torch.manual_seed(0)
    model = Transformer(model_config).to(device)
    if scaling is not None:
        apply_float8(model, scaling)
    optimizer = build_optimizer(list(model.parameters()), OptimizerConfig(lr=1e-4, warmup_steps=0))
    times, loss = [], None
    for tokens in batches:
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times, float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on CPU, 3 steps")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    model_config, steps, batch = (CPU_MODEL, 3, 2) if args.dry_run else (GPU_MODEL, args.steps, 2)
    refusal = fp8_refusal(device)
    if refusal is not None:
        print(refusal)
        return
    generator = torch.Generator().manual_seed(1)
    shape = (batch, model_config.seq_len)
    batches = [torch.randint(0, model_config.vocab, shape, generator=generator).to(device) for _ in range(steps)]
    # The first steps allocate, and fp8 computes its first scales: timed from the third on.
    results = {}
    for precision in PRECISIONS:
        times, loss = train(model_config, None if precision == "bf16" else precision, batches, device)
        step_s = statistics.median(times[2:] or times)
        results[precision] = {"step_s": step_s, "tokens_per_s": batch * model_config.seq_len / step_s, "loss": loss}
    for precision, result in results.items():
        ratio = result["tokens_per_s"] / results["bf16"]["tokens_per_s"]
        print(
            f"{precision:>10}: {result['step_s'] * 1e3:8.1f} ms/step {result['tokens_per_s']:12,.0f} tokens/s "
            f"({ratio:.2f}× bf16), last loss {result['loss']:.4f} (bf16 {results['bf16']['loss']:.4f})"
        )
    if args.json is not None:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        document = {"device": device_name, "model": model_config.model_dump(), **results}
        args.json.write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
