"""FLOPs and compute time.

Model FLOPs per token follow the trainer's MFU convention (PaLM, appendix B): 6N + 12·L·h·S,
N every parameter a token is multiplied with (the input embedding is a lookup and does not
count; MoE layers count their top_k experts), S the sequence length. Forward is a third of it,
backward two thirds (half for input gradients, half for weight gradients). Hardware FLOPs add
what recompute repeats: the attention sub-block's forward (selective) or every block's (full).

Compute time is hardware FLOPs over peak × the GPU's achievable efficiency; fp32 runs at the
TF32 rate (half the bf16 peak), fp8 runs its matmuls at the fp8 rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ModelConfig
from trainer.plan.hardware import ClusterSpec
from trainer.plan.layout import Layout
from trainer.plan.parameters import ParameterTensor, held_layers, held_tensors


def _matmul_elements(tensors: list[ParameterTensor], model: ModelConfig) -> float:
    """Parameters of these tensors a token multiplies with: not the embedding lookup, not norms,
    top_k of the experts; a tied output counts its (shared) embedding matrix."""
    elements = 0.0
    for tensor in tensors:
        if tensor.name == "embedding.weight" or len(tensor.shape) == 1:
            continue
        share = model.top_k / model.experts if tensor.expert else 1
        elements += tensor.copies * tensor.elements * share
    return elements


def model_flops_per_token(model: ModelConfig) -> float:
    matmul = _matmul_elements(held_tensors(model, 1, [0]), model)
    if model.tie_embeddings:
        matmul += model.vocab * model.dim
    return 6 * matmul + 12 * model.layers * model.dim * model.seq_len


@dataclass(frozen=True)
class RankCompute:
    """One pipeline rank's work for one microbatch through all its stages, in FLOPs and seconds."""

    forward_flops: float
    backward_flops: float
    recompute_flops: float
    model_flops: float
    seconds_per_flop: float

    @property
    def forward_s(self) -> float:
        return self.forward_flops * self.seconds_per_flop

    @property
    def backward_s(self) -> float:
        """Input and weight gradients plus the recomputed forward."""
        return (self.backward_flops + self.recompute_flops) * self.seconds_per_flop

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def seconds_per_flop(layout: Layout, cluster: ClusterSpec) -> float:
    gpu = cluster.gpu_type
    peak = gpu.peak_bf16_flops
    if layout.precision == "fp32":
        peak /= 2
    elif layout.precision == "fp8" and gpu.peak_fp8_flops:
        peak = gpu.peak_fp8_flops
    return 1 / (peak * cluster.efficiency)


def stages_compute(layout: Layout, cluster: ClusterSpec, stages: list[int]) -> RankCompute:
    """One microbatch through these global stages (a pipeline rank's, or a single one)."""
    model, parallel = layout.model, layout.parallel
    tokens = layout.micro_seqs * layout.local_seq
    layers = held_layers(model, layout.total_stages, stages)
    matmul = _matmul_elements(held_tensors(model, layout.total_stages, stages), model) / parallel.tp
    if model.tie_embeddings and layout.total_stages == 1:
        matmul += model.vocab * model.dim / parallel.tp
    attention = layers * model.dim * model.seq_len / parallel.tp
    forward = tokens * (2 * matmul + 4 * attention)
    recompute = layout.config.compute.recompute
    if recompute == "full":
        repeated = forward
    elif recompute == "selective":
        head_dim = model.dim // model.heads
        attention_matmul = layers * (2 * model.dim * model.dim + 2 * model.dim * model.kv_heads * head_dim)
        repeated = tokens * (2 * attention_matmul / parallel.tp + 4 * attention)
    else:
        repeated = 0.0
    return RankCompute(forward, 2 * forward, repeated, 3 * forward, seconds_per_flop(layout, cluster))
