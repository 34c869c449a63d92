"""FLOPs and compute time.

Model FLOPs per token follow the trainer's MFU convention (PaLM, appendix B): 6N + 12·L·h·S,
N every parameter a token is multiplied with (the input embedding is a lookup and does not
count; MoE layers count their top_k experts), S the sequence length. Forward is a third of it,
backward two thirds (half for input gradients, half for weight gradients). Hardware FLOPs add
what recompute repeats: the attention sub-block's forward (loom's selective), the attention core's
(Megatron's selective), every other matrix product and every memory-bound pass (torchtitan's per-op selective) or
every block's (full), in every N-th block only with compute.recompute_every.

Compute time is the sum of the rank's kernels (trainer.plan.kernel_time), one microbatch at a time:
every linear layer's three products from its local shapes (forward, input gradient, weight gradient;
Megatron fuses q/k/v and the MLP's gate and up projections into one product each, loom's trainer runs
them apart), flash attention on its causal FLOPs, and the memory-bound passes around them (norms,
residual additions, rotary embeddings, the MLP's activation, the loss's logits; fused or op by op as the runtime
runs them, trainer.plan.passes), which sequence parallelism splits over the tp ranks and which otherwise every tp
rank repeats. fp32 runs its products
without tensor cores (PyTorch leaves TF32 off; measured on an H200: a 350M model's fp32 step took 2.4
times its bf16 step at a quarter of the tokens); fp8 runs the blocks' linear layers at the fp8 rate, plus
their casts, and everything else as bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainer.config import ModelConfig
from trainer.plan.hardware import ClusterSpec
from trainer.plan.kernel_time import attention_seconds, gemm_seconds, memory_seconds
from trainer.plan.layout import Layout
from trainer.plan.parameters import (
    BlockKind,
    ParameterTensor,
    block_tensors,
    held_block_kinds,
    held_layers,
    held_tensors,
    last_stage_tensors,
)
from trainer.plan.passes import block_pass_bytes

# The final norm reads and writes the hidden state (a block's passes: trainer.plan.passes); backward moves about
# twice what forward does.
NORM_ELEMENTS = 2
BACKWARD_MEMORY_FACTOR = 2
# The loss reads and writes fp32 logits about three times over forward and backward (one forward).
LOSS_LOGIT_PASSES, LOSS_FORWARD_PASSES = 3, 1
# Megatron-LM's fused products: the listed tensors share their input and run as one matrix.
MEGATRON_FUSED = (("wq", "wk", "wv"), ("w1", "w3"))


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
class KernelTime:
    """Seconds of kernels by kind."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    memory_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s

    def __add__(self, other: KernelTime) -> KernelTime:
        return KernelTime(
            self.gemm_s + other.gemm_s, self.attention_s + other.attention_s, self.memory_s + other.memory_s
        )

    def __mul__(self, factor: float) -> KernelTime:
        return KernelTime(self.gemm_s * factor, self.attention_s * factor, self.memory_s * factor)


@dataclass(frozen=True)
class RankCompute:
    """One pipeline rank's work for one microbatch through all its stages, in FLOPs and seconds."""

    forward_flops: float
    backward_flops: float
    recompute_flops: float
    model_flops: float
    forward: KernelTime
    input_gradients: KernelTime
    """Backward less the weight gradients: input-gradient products, attention's backward, memory-bound passes."""
    weight_gradients: KernelTime
    recompute: KernelTime

    @property
    def forward_s(self) -> float:
        return self.forward.total_s

    @property
    def weight_gradient_s(self) -> float:
        return self.weight_gradients.total_s

    @property
    def backward_s(self) -> float:
        """Input and weight gradients plus the recomputed forward."""
        return self.input_gradients.total_s + self.weight_gradient_s + self.recompute.total_s

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def kernels(self) -> KernelTime:
        return self.forward + self.input_gradients + self.weight_gradients + self.recompute


@dataclass(frozen=True)
class Product:
    """One linear layer's weight as a product sees it on one rank: [tokens, fan_in] × [fan_in, fan_out]."""

    name: str
    fan_in: float
    fan_out: float
    tokens: float
    count: int = 1
    """Identical products (local experts)."""


def local_products(tensors: list[ParameterTensor], layout: Layout, tokens: float) -> list[Product]:
    """The block's linear layers on one tp/ep rank, fused as the runtime fuses them."""
    model, parallel = layout.model, layout.parallel
    products = []
    for tensor in tensors:
        if len(tensor.shape) == 1:
            continue
        shape = list(tensor.shape)
        if tensor.tp_dim is not None:
            shape[tensor.tp_dim] /= parallel.tp
        leaf = tensor.name.split(".")[-2] if tensor.name.endswith(".weight") else tensor.name.split(".")[-1]
        if tensor.expert:
            local_experts = shape[0] / parallel.ep
            routed = tokens * model.top_k * parallel.ep / model.experts
            products.append(Product(leaf, shape[2], shape[1], routed, round(local_experts)))
        else:
            products.append(Product(leaf, shape[1], shape[0], tokens))
    if layout.runtime != "megatron":
        return products
    fused = []
    for group in MEGATRON_FUSED:
        members = [product for product in products if product.name in group]
        if len(members) > 1:
            first = members[0]
            fused.append(
                Product("+".join(group), first.fan_in, sum(p.fan_out for p in members), first.tokens, first.count)
            )
    return [product for product in products if not any(product.name in group for group in MEGATRON_FUSED)] + fused


class KernelPricer:
    """Seconds of one rank's kernels for one microbatch, in the layout's precision on the cluster's GPU."""

    def __init__(self, layout: Layout, cluster: ClusterSpec):
        self.layout, self.gpu = layout, cluster.gpu_type
        self.ceiling = cluster.efficiency
        self.activation_bytes = layout.activation_bytes
        bf16 = self.gpu.peak_bf16_flops
        fp32 = layout.precision == "fp32"
        self.peak, self.element_bytes = (self.gpu.peak_fp32_flops, 4) if fp32 else (bf16, 2)
        self.fp8 = layout.precision == "fp8" and self.gpu.peak_fp8_flops is not None
        # A ceiling the cluster overrides moves the fp8 products' ceiling in proportion.
        self.fp8_ceiling = (self.gpu.fp8_efficiency or 0.0) * self.ceiling / self.gpu.compute_efficiency

    def product(self, m: float, k: float, n: float, in_fp8: bool) -> float:
        if in_fp8:
            # The inputs are cast to fp8 first: each read in bf16 and written in one byte.
            casts = memory_seconds(3 * (m * k + k * n), self.gpu)
            return gemm_seconds(m, k, n, self.gpu, self.gpu.peak_fp8_flops, self.fp8_ceiling, 1) + casts
        return gemm_seconds(m, k, n, self.gpu, self.peak, self.ceiling, self.element_bytes)

    def linear(self, products: list[Product], in_fp8: bool = False) -> tuple[KernelTime, KernelTime, KernelTime]:
        """(forward, input gradients, weight gradients) of these products."""
        forward = input_grad = weight_grad = 0.0
        fp8 = in_fp8 and self.fp8
        for p in products:
            forward += p.count * self.product(p.tokens, p.fan_in, p.fan_out, fp8)
            input_grad += p.count * self.product(p.tokens, p.fan_out, p.fan_in, fp8)
            weight_grad += p.count * self.product(p.fan_out, p.tokens, p.fan_in, fp8)
        return KernelTime(gemm_s=forward), KernelTime(gemm_s=input_grad), KernelTime(gemm_s=weight_grad)

    def memory(self, elements: float) -> KernelTime:
        return self.memory_bytes(elements * self.activation_bytes)

    def memory_bytes(self, bytes_moved: float) -> KernelTime:
        return KernelTime(memory_s=memory_seconds(bytes_moved, self.gpu))

    def attention(self, causal_flops: float) -> KernelTime:
        """Flash attention runs in bf16; in fp32 SDPA falls back to kernels without tensor cores."""
        seconds = attention_seconds(causal_flops, self.gpu, flash2=self.layout.attention == "flash2")
        if self.layout.precision == "fp32":
            seconds *= self.gpu.peak_bf16_flops / self.gpu.peak_fp32_flops
        return KernelTime(attention_s=seconds)


# Bytes per score the unfused softmax and dropout move, in 2-byte activations: forward, the softmax reads and
# writes the scores and dropout reads them and writes them and its 1-byte mask; backward, dropout reads the
# gradient and the mask and writes, the softmax reads its output and the gradient and writes.
UNFUSED_SCORE_BYTES_FORWARD, UNFUSED_SCORE_BYTES_BACKWARD = 9, 11


def per_op_recomputed(products: list[Product]) -> list[Product]:
    """The products torchtitan's per-op selective checkpointing re-runs: the second, fourth, … of a block's,
    in forward order (its policy counts matrix products and saves the odd ones)."""
    return products[1::2]


def unfused_attention(pricer: KernelPricer, layout: Layout, tokens: float) -> tuple[KernelTime, KernelTime]:
    """(forward, backward) of attention as batched products over the whole (uncausal) score matrix of each of
    the rank's heads, plus the memory-bound passes over it."""
    model, tp = layout.model, layout.parallel.tp
    head_dim = model.dim // model.heads
    heads = layout.micro_seqs * model.heads / tp
    seq = model.seq_len
    # Batched products: the heads stack along m, so their tiles fill the waves together.
    scores = pricer.product(heads * layout.local_seq, head_dim, seq, in_fp8=False)
    values = pricer.product(heads * layout.local_seq, seq, head_dim, in_fp8=False)
    elements = heads * layout.local_seq * seq
    forward = KernelTime(gemm_s=scores + values) + pricer.memory(elements * UNFUSED_SCORE_BYTES_FORWARD / 2)
    backward = KernelTime(gemm_s=2 * (scores + values)) + pricer.memory(elements * UNFUSED_SCORE_BYTES_BACKWARD / 2)
    return forward, backward


@dataclass(frozen=True)
class BlockCompute:
    """One transformer block's kernels for one microbatch on one rank: what every block a rank holds repeats."""

    attention_products: list[Product]
    mlp_products: list[Product]
    attention_linear: tuple[KernelTime, KernelTime, KernelTime]
    mlp_linear: tuple[KernelTime, KernelTime, KernelTime]
    core: KernelTime
    core_backward: KernelTime
    memory: KernelTime
    """The memory-bound passes' forward."""
    attention_memory: KernelTime
    """The attention module's share of `memory`, its norm's left out: what loom's selective recompute re-runs (the
    norm runs outside the checkpoint, trainer/parallel/recompute.py)."""
    matmul_elements: float
    """Parameters a token multiplies with in one block (`_matmul_elements`)."""


def block_compute(layout: Layout, cluster: ClusterSpec) -> BlockCompute:
    """A block's kernels: it reads of the layout the tokens a rank takes in a microbatch (micro_seqs and cp), tp,
    ep, precision, runtime and attention kernel."""
    model = layout.model
    tp = layout.parallel.tp
    tokens = layout.micro_seqs * layout.local_seq
    pricer = KernelPricer(layout, cluster)
    block = block_tensors(model, "*")
    attention_products = local_products([t for t in block if ".attention." in t.name], layout, tokens)
    mlp_tensors = [t for t in block if ".mlp." in t.name]
    # loom's and torchtitan's fp8 converts linear layers, a dense block's and a shared expert's, not the router or
    # the experts' grouped GEMMs; Megatron-LM's Transformer Engine runs those in fp8 too.
    linear_layers = [t for t in mlp_tensors if not t.expert and ".router." not in t.name]
    routed = [t for t in mlp_tensors if t not in linear_layers]
    mlp_products = local_products(mlp_tensors, layout, tokens)
    mlp_linear = pricer.linear(local_products(linear_layers, layout, tokens), in_fp8=True)
    if routed:
        routing = pricer.linear(local_products(routed, layout, tokens), in_fp8=layout.runtime == "megatron")
        mlp_linear = tuple(a + b for a, b in zip(mlp_linear, routing, strict=True))
    if layout.attention == "unfused":
        core, core_backward = unfused_attention(pricer, layout, tokens)
    else:
        core = pricer.attention(2 * tokens * model.seq_len * model.dim / tp)
        # Flash attention's backward recomputes the scores and runs 2.5 times the forward's products.
        core_backward = core * 2.5
    passes = block_pass_bytes(layout)
    return BlockCompute(
        attention_products,
        mlp_products,
        pricer.linear(attention_products, in_fp8=True),
        mlp_linear,
        core,
        core_backward,
        pricer.memory_bytes(tokens * passes.block),
        pricer.memory_bytes(tokens * (passes.attention - passes.attention_norm)),
        _matmul_elements(block, model),
    )


@dataclass(frozen=True)
class BlocksWork:
    """What a rank's blocks of one kind compute for one microbatch."""

    matmul_elements: float
    forward: KernelTime
    input_gradients: KernelTime
    weight_gradients: KernelTime
    repeated_flops: float
    recomputed: KernelTime


def blocks_work(layout: Layout, pricer: KernelPricer, kind: BlockKind, block: BlockCompute, tokens: int) -> BlocksWork:
    """`kind`'s blocks in `layout` (the layout of their own model): every block's kernels, and what recompute
    repeats (with compute.recompute_every N > 1 in every N-th block only)."""
    model, tp = layout.model, layout.parallel.tp
    layers = kind.layers
    head_dim = model.dim // model.heads
    recompute = layout.config.compute.recompute
    attention_linear, mlp_linear, core = block.attention_linear, block.mlp_linear, block.core
    attention = layers * model.dim * model.seq_len / tp
    forward = (attention_linear[0] + mlp_linear[0] + core + block.memory) * layers
    input_gradients = (
        attention_linear[1] + mlp_linear[1] + block.core_backward + block.memory * BACKWARD_MEMORY_FACTOR
    ) * layers
    weight_gradients = (attention_linear[2] + mlp_linear[2]) * layers
    share = kind.recomputed(layout.config.compute) / layers if layers else 0.0
    if recompute == "full":
        repeated, recomputed = tokens * (2 * block.matmul_elements * layers / tp + 4 * attention), forward
    elif recompute == "selective" and layout.runtime == "megatron":
        repeated, recomputed = tokens * 4 * attention, core * layers
    elif recompute == "selective" and layout.runtime == "torchtitan":
        # Per-op selective checkpointing keeps attention's output and every other matrix product's in forward
        # order, and re-runs the rest: the other products and every memory-bound pass.
        every_other = per_op_recomputed(block.attention_products + block.mlp_products)
        repeated = layers * sum(2 * p.tokens * p.fan_in * p.fan_out * p.count for p in every_other)
        recomputed = (pricer.linear(every_other, in_fp8=True)[0] + block.memory) * layers
    elif recompute == "selective":
        attention_matmul = layers * (2 * model.dim * model.dim + 2 * model.dim * model.kv_heads * head_dim)
        repeated = tokens * (2 * attention_matmul / tp + 4 * attention)
        recomputed = (attention_linear[0] + core + block.attention_memory) * layers
    else:
        repeated, recomputed = 0.0, KernelTime()
    return BlocksWork(
        block.matmul_elements * layers,
        forward,
        input_gradients,
        weight_gradients,
        repeated * share,
        recomputed * share,
    )


def stages_compute(
    layout: Layout,
    cluster: ClusterSpec,
    stages: list[int],
    block_of: Callable[[Layout], BlockCompute] | None = None,
) -> RankCompute:
    """One microbatch through these global stages (a pipeline rank's, or a single one); `block_of` gives
    `block_compute` of a layout (of the layout's blocks of one kind), computed here unless given."""
    model, parallel = layout.model, layout.parallel
    tp = parallel.tp
    tokens = layout.micro_seqs * layout.local_seq
    holds_output = layout.total_stages - 1 in stages
    pricer = KernelPricer(layout, cluster)
    block_of = block_of or (lambda kind_layout: block_compute(kind_layout, cluster))
    work = [
        blocks_work(kind_layout, pricer, kind, block_of(kind_layout), tokens)
        for kind in held_block_kinds(model, layout.total_stages, stages)
        for kind_layout in [layout.with_blocks(kind.model)]
    ]
    matmul = sum(part.matmul_elements for part in work)
    if holds_output:
        matmul += _matmul_elements(last_stage_tensors(model, layout.total_stages), model)
    matmul /= tp
    if model.tie_embeddings and layout.total_stages == 1:
        matmul += model.vocab * model.dim / tp
    attention = held_layers(model, layout.total_stages, stages) * model.dim * model.seq_len / tp
    forward_flops = tokens * (2 * matmul + 4 * attention)
    forward = sum((part.forward for part in work), KernelTime())
    input_gradients = sum((part.input_gradients for part in work), KernelTime())
    weight_gradients = sum((part.weight_gradients for part in work), KernelTime())
    repeated = sum(part.repeated_flops for part in work)
    recomputed = sum((part.recomputed for part in work), KernelTime())
    if holds_output:
        output = pricer.linear([Product("output", model.dim, model.vocab / tp, tokens)])
        logits = tokens * model.vocab / tp * 4 / pricer.activation_bytes
        spread = tp if layout.sequence_parallel else 1
        final_norm = tokens / spread * model.dim * NORM_ELEMENTS
        forward += output[0] + pricer.memory(final_norm + logits * LOSS_FORWARD_PASSES)
        input_gradients += output[1] + pricer.memory(
            final_norm * BACKWARD_MEMORY_FACTOR + logits * (LOSS_LOGIT_PASSES - LOSS_FORWARD_PASSES)
        )
        weight_gradients += output[2]
    if 0 in stages:
        forward += pricer.memory(tokens * model.dim)
        input_gradients += pricer.memory(2 * tokens * model.dim)
    return RankCompute(
        forward_flops,
        2 * forward_flops,
        repeated,
        3 * forward_flops,
        forward,
        input_gradients,
        weight_gradients,
        recomputed,
    )
