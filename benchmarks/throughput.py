"""Training throughput of loom's model and step against Hugging Face transformers' LlamaForCausalLM: the same
architecture, starting weights, token batches and optimizer, in one process, their timed steps alternating. Prints
tokens/s, median step time, MFU and (on a GPU) peak memory for each, then the loom/HF throughput ratio (above 1:
loom is faster).

    .venv/bin/python benchmarks/throughput.py                      # --config 1b on a GPU, tiny elsewhere
    .venv/bin/python benchmarks/throughput.py --config tiny --steps 50 --batch 4

Needs `transformers`. Both models are built from config objects with random weights; nothing is downloaded.

A step is zero_grad, forward with the loss, backward, AdamW step; no gradient clipping and no torch.compile on
either side. Both models read the same [batch, seq_len] tokens and predict the same batch·(seq_len − 1) of them:
HF shifts `labels` left inside the model and ignores the last position, so loom gets those shifted targets with
the last position ignored too. tokens/s counts the tokens read, batch·seq_len per step, as the trainer does.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.config import ModelConfig, OptimizerConfig
from trainer.kernels import kernels_for
from trainer.kernels.reference import IGNORE_INDEX
from trainer.metrics import mfu, model_flops_per_token, peak_flops
from trainer.model import NORM_EPS, ROPE_BASE, Transformer
from trainer.train import build_optimizer

SEED = 0
GIB = 2**30


@dataclass(frozen=True)
class BenchConfig:
    model: ModelConfig
    batch: int
    warmup_steps: int
    """Untimed steps first: Triton compilation and autotuning, allocator growth, lazy optimizer state."""
    steps: int


CONFIGS = {
    # About 1.1B parameters. Both models' weights, gradients and AdamW state (18 GB each) stay on the device while
    # their steps alternate; batch 4 adds about 30 GB of one step's activations (HF's include the fp32 logits of
    # the whole batch), which leaves headroom on an 80 GB H100.
    "1b": BenchConfig(
        ModelConfig(layers=16, dim=2048, heads=16, kv_heads=8, ffn=8192, vocab=32000, seq_len=2048),
        batch=4,
        warmup_steps=3,
        steps=20,
    ),
    # Small enough that the whole run takes seconds on two idle CPU cores.
    "tiny": BenchConfig(
        ModelConfig(layers=2, dim=128, heads=4, kv_heads=2, ffn=344, vocab=256, seq_len=128),
        batch=8,
        warmup_steps=3,
        steps=20,
    ),
}

# loom's parameter names to LlamaForCausalLM's. Both apply RoPE in the rotate-half layout, so the query and key
# projections carry over unchanged (the permutation in HF's conversion script is for Meta's interleaved layout).
TOP_LEVEL_NAMES = {
    "embedding.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}


def llama_config(model: ModelConfig) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=model.dim,
        intermediate_size=model.ffn,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        vocab_size=model.vocab,
        max_position_embeddings=model.seq_len,
        rms_norm_eps=NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE},
        tie_word_embeddings=False,
        # A training step has no use for a key/value cache; filling one would only add work to HF's side.
        use_cache=False,
        attn_implementation="sdpa",
    )


def hf_state_dict(loom: Transformer) -> dict[str, torch.Tensor]:
    """loom's parameters under LlamaForCausalLM's names."""
    renamed = {}
    for name, tensor in loom.state_dict().items():
        if name in TOP_LEVEL_NAMES:
            renamed[TOP_LEVEL_NAMES[name]] = tensor
            continue
        _, layer, suffix = name.split(".", 2)
        renamed[f"model.layers.{layer}.{BLOCK_NAMES[suffix]}"] = tensor
    return renamed


def token_batches(bench: BenchConfig, device: torch.device) -> list[torch.Tensor]:
    """One [batch, seq_len] batch of random tokens per step, warm-up included, already on the device."""
    generator = torch.Generator().manual_seed(SEED)
    shape = (bench.warmup_steps + bench.steps, bench.batch, bench.model.seq_len)
    return list(torch.randint(0, bench.model.vocab, shape, generator=generator).to(device))


def next_token_targets(tokens: torch.Tensor) -> torch.Tensor:
    """What HF's loss does with labels=tokens: each position predicts the next token, the last predicts nothing."""
    return F.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)


class Contender:
    """One model, its loss and its AdamW, stepped on the device; collects what the report prints."""

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        loss_of: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
    ):
        self.name = name
        self.model = model
        self.loss_of = loss_of
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.precision = torch.autocast("cuda", dtype=torch.bfloat16) if self.on_cuda else contextlib.nullcontext()
        self.optimizer: torch.optim.AdamW | None = None
        self.first_loss: float | None = None
        """Loss of the first warm-up step, before any update: equal weights and batch give equal losses."""
        self.peak_memory_bytes: int | None = None
        """CUDA allocator peak during warm-up (weights, gradients, optimizer state, activations) above what was
        allocated before the model came to the device; None on CPU. Later steps repeat the same allocations."""
        self.step_times_s: list[float] = []

    def start(self, warmup_batches: list[torch.Tensor]) -> None:
        """Move the model to the device, build its optimizer there (fused AdamW needs the parameters on the GPU)
        and run the untimed steps."""
        if self.on_cuda:
            allocated_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model.to(self.device)
        self.optimizer = build_optimizer(list(self.model.parameters()), OptimizerConfig())
        self.first_loss = self.step(warmup_batches[0]).item()
        for tokens in warmup_batches[1:]:
            self.step(tokens)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            self.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device) - allocated_before

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision:
            loss = self.loss_of(tokens)
        loss.backward()
        self.optimizer.step()
        return loss

    def timed_step(self, tokens: torch.Tensor) -> None:
        self.synchronize()
        started = time.perf_counter()
        self.step(tokens)
        self.synchronize()
        self.step_times_s.append(time.perf_counter() - started)

    def synchronize(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    @property
    def step_time_s(self) -> float:
        """Median over the timed steps: a step slowed by another process on the machine does not move it."""
        return statistics.median(self.step_times_s)


def report_line(contender: Contender, tokens_per_step: int, flops_per_token: float, peak: float | None) -> str:
    step_time_s = contender.step_time_s
    utilisation = mfu(flops_per_token, tokens_per_step, step_time_s, 1, peak)
    memory = "n/a" if contender.peak_memory_bytes is None else f"{contender.peak_memory_bytes / GIB:.1f} GiB"
    return (
        f"{contender.name:<22} {tokens_per_step / step_time_s:>12,.0f} tokens/s {step_time_s * 1000:>9.1f} ms/step"
        f"   MFU {'n/a' if utilisation is None else f'{utilisation:.1%}'}   peak memory {memory}"
    )


def parse_args() -> tuple[str, BenchConfig]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), help="model and batch; default: 1b on a GPU, else tiny")
    parser.add_argument("--batch", type=int, help="sequences per step (overrides the config's)")
    parser.add_argument("--steps", type=int, help="timed steps (overrides the config's)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps before them, at least 1")
    args = parser.parse_args()
    name = args.config or ("1b" if torch.cuda.is_available() else "tiny")
    overrides = {"batch": args.batch, "steps": args.steps, "warmup_steps": args.warmup_steps}
    bench = replace(CONFIGS[name], **{field: value for field, value in overrides.items() if value is not None})
    if bench.batch < 1 or bench.steps < 1 or bench.warmup_steps < 1:
        parser.error("--batch, --steps and --warmup-steps must be at least 1 (the first warm-up step checks the loss)")
    return name, bench


def main() -> None:
    name, bench = parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    cfg = bench.model
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    torch.manual_seed(SEED)
    loom = Transformer(cfg)
    kernels = kernels_for("auto", device)
    loom.use_kernels(kernels)
    hf = LlamaForCausalLM(llama_config(cfg))
    hf.load_state_dict(hf_state_dict(loom))
    hf.train()

    params = loom.num_params()
    flops_per_token = model_flops_per_token(cfg, params - loom.embedding.weight.numel())
    peak = peak_flops(device)
    tokens_per_step = bench.batch * cfg.seq_len
    batches = token_batches(bench, device)

    print(
        f"{device_name}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}\n"
        f"config {name}: {cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads ({cfg.kv_heads} kv), ffn {cfg.ffn}, "
        f"vocab {cfg.vocab}, seq_len {cfg.seq_len}, batch {bench.batch}; {params / 1e6:,.1f}M parameters; "
        f"{bench.warmup_steps} warm-up + {bench.steps} timed steps",
        flush=True,
    )
    loom_side = Contender(
        f"loom ({kernels.backend} kernels)", loom, lambda tokens: loom(tokens, next_token_targets(tokens)), device
    )
    hf_side = Contender("HF LlamaForCausalLM", hf, lambda tokens: hf(input_ids=tokens, labels=tokens).loss, device)
    contenders = (loom_side, hf_side)
    for contender in contenders:
        contender.start(batches[: bench.warmup_steps])
    # Alternating step by step, both sides see the same load from anything else on the machine.
    for tokens in batches[bench.warmup_steps :]:
        for contender in contenders:
            contender.timed_step(tokens)

    print(f"first-step loss, same weights and batch: loom {loom_side.first_loss:.4f}, HF {hf_side.first_loss:.4f}")
    for contender in contenders:
        print(report_line(contender, tokens_per_step, flops_per_token, peak))
    print(f"ratio loom/HF tokens/s: {hf_side.step_time_s / loom_side.step_time_s:.2f}x")


if __name__ == "__main__":
    main()
