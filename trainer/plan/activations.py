"""Activation memory: the tensors autograd keeps from forward to backward, per layer and microbatch.

The terms follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), tensor by tensor, for two runtimes:

- "megatron": their GPT layer (LayerNorm, GELU MLP of 4h, dropout, attention that materialises the
  softmax), sequence parallel re-gathering the inputs of column-parallel layers in backward, and
  selective recompute of the core attention. It reproduces their closed forms: 34sbh + 5as²b per
  layer without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallel, sbh/t·(34 + 5as/h)
  with sequence parallel, 34sbh/t with selective recompute, 2sbh/t with full recompute. The export
  to Megatron-LM prices it, carried over to grouped-query attention, SwiGLU, flash attention and
  no dropout where its recipe has them.
- "loom": what trainer/ runs: RMSNorm, SwiGLU, grouped-query flash attention through
  scaled_dot_product_attention (keeps q, k, v, its output and an fp32 logsumexp per row and head,
  never the s² scores; the output projection reads that output's own storage), no dropout; DTensor's
  sequence parallel keeps the all-gathered input of the column-parallel projections; "selective"
  recomputes the attention sub-block (keeping its input), "full" whole blocks (keeping each block's
  input); a parallel block (model.parallel_blocks) keeps one norm's tensors, and that norm's output once where
  attention and the MLP both keep it uncast. The fused kernels keep a norm's input and statistics and SwiGLU's gate
  and up; where the trainer runs torch's ops instead (tensor or context parallel, or compute.kernels torch) autograd
  keeps their fp32 intermediates: a norm's fp32 input and normalised output, SwiGLU's fp32 gate, up
  and silu(gate). tests/trainer/test_activation_memory.py measures these against the trainer's own
  saved tensors, layer by layer.
- "torchtitan": as loom's, except that its "selective" is per-op selective checkpointing
  (torchtitan_per_op_layer).

Neither Megatron-LM's GPT nor torchtitan's llama3 has parallel blocks: the planner refuses to price them there
(trainer.plan.estimate.runtime_errors), as the exports refuse them.

s is the sequence a rank holds (seq_len / cp), b the microbatch in sequences, h the hidden size,
a heads, f the feed-forward size, t the tensor-parallel degree.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ModelConfig

RECOMPUTE_MODES = ("none", "selective", "full")
ALWAYS = frozenset(RECOMPUTE_MODES)
UNLESS_RECOMPUTED = frozenset({"none"})
UNLESS_FULL = frozenset({"none", "selective"})
ONLY_SELECTIVE = frozenset({"selective"})
ONLY_FULL = frozenset({"full"})


@dataclass(frozen=True)
class SavedTensor:
    name: str
    symbol: str
    """Its size in the paper's symbols, per layer and microbatch, before parallel splits."""
    elements: float
    bytes_per_element: float
    tp_split: bool
    """Split over tensor-parallel ranks (heads or ffn columns)."""
    sp_split: bool
    """Split over tensor-parallel ranks along the sequence when sequence parallel is on."""
    kept_under: frozenset[str]

    def bytes(self, tp: int, sequence_parallel: bool) -> float:
        split = tp if self.tp_split or (sequence_parallel and self.sp_split) else 1
        return self.elements * self.bytes_per_element / split


@dataclass(frozen=True)
class Shape:
    s: int
    b: int
    h: int
    a: int
    kv: int
    """Key/value width: kv_heads × head_dim."""
    f: int
    top_k: int = 1
    """Feed-forward experts each token goes through (ModelConfig.feed_forward_paths; 1 in a dense block)."""

    @classmethod
    def of(cls, model: ModelConfig, local_seq: int, micro_seqs: int) -> Shape:
        head_dim = model.dim // model.heads
        top_k = model.feed_forward_paths
        return cls(local_seq, micro_seqs, model.dim, model.heads, model.kv_heads * head_dim, model.ffn, top_k)


def loom_layer(
    shape: Shape,
    model: ModelConfig,
    activation_bytes: float,
    matmul_input_bytes: float,
    gathered_seq: int,
    fused_kernels: bool = True,
    residual_bytes: float | None = None,
    autocast: bool = False,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> list[SavedTensor]:
    """One block of trainer/model.py. Keys and values are gathered over the whole sequence under
    context parallelism (gathered_seq = seq_len), so those two terms do not shrink with cp.
    residual_bytes: the residual stream's element size, where it differs from the activations' (under
    autocast the embedding's output, and so the stream the blocks add to, stays fp32). Under autocast
    each linear layer casts its input itself, so q, k and v keep three bf16 copies of theirs and the
    MLP's gate and up two.

    A parallel block (model.parallel_blocks) has one norm, whose output attention and the MLP both read: where
    the MLP keeps that output itself (`mlp_keeps_norm_output`) it is one tensor, kept unless the block is
    recomputed whole, for attention's projections (or the checkpoint around a selectively recomputed attention)
    and the MLP alike."""
    s, b, h, a, kv, f, k = shape.s, shape.b, shape.h, shape.a, shape.kv, shape.f, shape.top_k
    sbh, e, m = s * b * h, activation_bytes, matmul_input_bytes
    r = residual_bytes or e
    qkv_copies = 3 if autocast else 1
    mlp_copies = (2 if model.mlp == "swiglu" else 1) if autocast else 1
    norms, norm_count_symbol = (1, "sb") if model.parallel_blocks else (2, "2sb")
    shared_input = mlp_keeps_norm_output(model, autocast or m != e, tp, sequence_parallel)
    qkv_input = SavedTensor(
        "q/k/v projection input" + (" (a cast each)" if autocast else ""),
        f"{qkv_copies}·sbh" if autocast else "sbh",
        qkv_copies * sbh,
        m,
        False,
        False,
        UNLESS_RECOMPUTED,
    )
    tensors = [
        *norm_tensors("attention", sbh, r, fused_kernels),
        SavedTensor("norm statistics (fp32)", norm_count_symbol, norms * s * b, 4, False, True, UNLESS_FULL),
    ]
    if shared_input:
        tensors.append(
            SavedTensor("norm output, attention's and the MLP's input", "sbh", sbh, m, False, True, UNLESS_FULL)
        )
        if sequence_parallel:
            # Attention's projections keep the sequence gathered, a copy of their own.
            tensors.append(qkv_input)
    else:
        tensors += [
            SavedTensor("attention input, kept for recompute", "sbh", sbh, r, False, True, ONLY_SELECTIVE),
            qkv_input,
        ]
    tensors += [
        SavedTensor("queries after RoPE", "sbh", sbh, e, True, False, UNLESS_RECOMPUTED),
        SavedTensor(
            "keys and values after RoPE", "2·S·b·kv", 2 * gathered_seq * b * kv, e, True, False, UNLESS_RECOMPUTED
        ),
        SavedTensor("attention output", "sbh", sbh, e, True, False, UNLESS_RECOMPUTED),
        SavedTensor("softmax logsumexp (fp32)", "sba", s * b * a, 4, True, False, UNLESS_RECOMPUTED),
    ]
    if m != e:
        tensors.append(SavedTensor("output-projection input (cast)", "sbh", sbh, m, True, False, UNLESS_RECOMPUTED))
    if not model.parallel_blocks:
        tensors += norm_tensors("MLP", sbh, r, fused_kernels)
    if model.experts > 1:
        tensors += routing_tensors(model, s, b, m, autocast, tp, input_counted=shared_input)
    elif not shared_input:
        tensors.append(
            SavedTensor(
                "MLP input" + (" (a cast each)" if autocast else ""),
                f"{mlp_copies}·sbh" if autocast else "sbh",
                mlp_copies * sbh,
                m,
                False,
                False,
                UNLESS_FULL,
            )
        )
    if model.mlp == "swiglu" and fused_kernels:
        tensors.append(
            SavedTensor("gate and up projections", "2·k·sbf", 2 * k * s * b * f, e, True, False, UNLESS_FULL)
        )
    elif model.mlp == "swiglu":
        tensors.append(
            SavedTensor("gate, up and silu(gate) (fp32)", "3·k·sbf", 3 * k * s * b * f, 4, True, False, UNLESS_FULL)
        )
    else:
        tensors.append(SavedTensor("GELU input", "k·sbf", k * s * b * f, e, True, False, UNLESS_FULL))
    tensors.append(SavedTensor("down-projection input", "k·sbf", k * s * b * f, m, True, False, UNLESS_FULL))
    tensors.append(SavedTensor("block input, kept for recompute", "sbh", sbh, r, False, True, ONLY_FULL))
    return tensors


def mlp_keeps_norm_output(model: ModelConfig, casts: bool, tp: int, sequence_parallel: bool) -> bool:
    """Whether a parallel block's MLP keeps its norm's output itself, not a copy: no cast comes between (`casts`:
    autocast casts it for each linear layer, fp8 for its matmuls), and a dense MLP takes it whole (sequence
    parallelism gathers it first, a copy) where a mixture's router takes it on the rank's own tokens (whole on one
    rank; without sequence parallelism tensor parallelism splits a copy off for it)."""
    if not model.parallel_blocks or casts:
        return False
    if model.experts > 1:
        return tp == 1 or sequence_parallel
    return not sequence_parallel


def routing_tensors(
    model: ModelConfig, s: int, b: int, matmul_input_bytes: float, autocast: bool, tp: int, input_counted: bool = False
) -> list[SavedTensor]:
    """What trainer/moe.py keeps of routing s·b tokens to top_k of E experts (dropless; a capacity drops some and
    keeps its own counts): the router's input, probabilities, choices and renormalised gates, the tokens dispatched
    to the experts and what comes back, which the gates weight in one batched product, the indices that sort the
    copies by expert and back, the grouped products' offsets, and the balance loss's per-sequence totals.

    Under tensor parallelism the router takes the rank's part of the sequence (what it keeps is split over tp),
    the experts every token; a shared expert takes the gathered sequence as a dense block does. Without it the
    router and a shared expert read one input, which autocast casts once for each linear layer. input_counted: that
    input (the router's, under tensor parallelism) is a parallel block's norm output, counted with the block's."""
    k, experts, sb, m = model.top_k, model.experts, s * b, matmul_input_bytes
    copies = k * sb
    products = 3 if model.mlp == "swiglu" else 2
    shared_reads = (products - 1 if autocast else 1) if model.moe.shared_expert else 0

    def kept(name: str, symbol: str, elements: float, nbytes: float, router_side: bool = False) -> SavedTensor:
        return SavedTensor(name, symbol, elements, nbytes, router_side, False, UNLESS_FULL)

    tensors = []
    if tp > 1:
        if not input_counted:
            tensors.append(kept("router input", "sbh", sb * model.dim, m, router_side=True))
        if shared_reads:
            tensors.append(
                kept("shared expert input, gathered", f"{shared_reads}·sbh", shared_reads * sb * model.dim, m)
            )
    elif not input_counted:
        reads = 1 + shared_reads if autocast else 1
        tensors.append(
            kept("MoE input" + (" (a cast each)" if autocast else ""), f"{reads}·sbh", reads * sb * model.dim, m)
        )
    tensors += [
        kept("router probabilities (fp32)", "sbE", sb * experts, 4, router_side=True),
        kept("router's ranking of the experts (int64; the choices its first k)", "sbE", sb * experts, 8, True),
        kept("tokens dispatched to experts", "k·sbh", copies * model.dim, m),
        kept("expert outputs, for the gates' gradient", "k·sbh", copies * model.dim, m),
        kept("gates of the batched combine", "k·sb", copies, m),
        kept("dispatch and combine indices (int64)", "2·k·sb", 2 * copies, 8),
    ]
    # torch._grouped_mm takes rows and weights 16-byte aligned; the trainer loops over the experts otherwise.
    if (model.dim * m) % 16 == 0 and (model.ffn // tp * m) % 16 == 0:
        tensors.append(kept("grouped products' offsets (int32)", f"{products}E", products * experts, 4))
    if model.moe.renormalize:
        tensors.append(kept("gates and their sums, for renormalising (fp32)", "k·sb + sb", copies + sb, 4, True))
    if model.moe.balance_loss > 0:
        tensors.append(kept("balance loss: affinity sums (fp32)", "sb", sb, 4, router_side=True))
        tensors.append(kept("balance loss: sequence totals (fp32)", "2b + 5bE", 2 * b + 5 * b * experts, 4))
    return tensors


def norm_tensors(which: str, sbh: float, activation_bytes: float, fused_kernels: bool) -> list[SavedTensor]:
    """What an RMSNorm keeps besides its statistics: the fused kernel its input; torch's ops the input in
    fp32 and the normalised output before the weight."""
    if fused_kernels:
        return [SavedTensor(f"{which} norm input", "sbh", sbh, activation_bytes, False, True, UNLESS_FULL)]
    return [
        SavedTensor(f"{which} norm input (fp32)", "sbh", sbh, 4, False, True, UNLESS_FULL),
        SavedTensor(f"{which} norm normalised (fp32)", "sbh", sbh, 4, False, True, UNLESS_FULL),
    ]


def torchtitan_per_op_layer(shape: Shape, model: ModelConfig, activation_bytes: float, reduce_scatters: bool):
    """What torchtitan's per-op selective checkpointing (selective_ac_option "op") keeps of one block: its input,
    attention's output and logsumexp, and the output of every other matrix product in forward order (q, v, the
    MLP's first, with SwiGLU its down projection too; k, the output projection and the rest are recomputed), with
    sequence parallel the reduce-scatters' outputs as well. Recompute "selective" under the torchtitan runtime."""
    s, b, h, a, kv, f, k = shape.s, shape.b, shape.h, shape.a, shape.kv, shape.f, shape.top_k
    sbh, e = s * b * h, activation_bytes
    tensors = [
        SavedTensor("block input, kept for recompute", "sbh", sbh, e, False, True, ONLY_SELECTIVE),
        SavedTensor("q projection output", "sbh", sbh, e, True, False, ONLY_SELECTIVE),
        SavedTensor("v projection output", "sb·kv", s * b * kv, e, True, False, ONLY_SELECTIVE),
        SavedTensor("attention output", "sbh", sbh, e, True, False, ONLY_SELECTIVE),
        SavedTensor("softmax logsumexp (fp32)", "sba", s * b * a, 4, True, False, ONLY_SELECTIVE),
        SavedTensor("MLP's first projection output", "k·sbf", k * s * b * f, e, True, False, ONLY_SELECTIVE),
    ]
    if model.mlp == "swiglu":
        # The down projection's output before the tensor-parallel reduction: whole on every tp rank.
        tensors.append(SavedTensor("down projection output", "sbh", sbh, e, False, False, ONLY_SELECTIVE))
    if reduce_scatters:
        tensors.append(SavedTensor("reduce-scatter outputs", "2sbh", 2 * sbh, e, False, True, ONLY_SELECTIVE))
    return tensors


def megatron_layer(shape: Shape, swiglu: bool = False, flash: bool = False, dropout: bool = True) -> list[SavedTensor]:
    """Korthikanti et al.'s GPT layer, 2-byte activations and 1-byte dropout masks (section 4.1), as Megatron-LM
    keeps it; for the models it trains today with grouped-query keys and values (kv wide), SwiGLU (gate and up
    kept, then their product: 3sbf where GELU keeps 2 × 4sbh), flash attention (its output, already counted as the
    projection's input, and an fp32 logsumexp per row and head instead of the three s² score tensors), and no
    dropout where the recipe sets it to zero."""
    s, b, h, a, kv, f = shape.s, shape.b, shape.h, shape.a, shape.kv, shape.f
    sbh, sbkv, as2b = s * b * h, s * b * kv, a * s * s * b
    core_attention = frozenset({"none"})
    tensors = [
        SavedTensor("attention LayerNorm input", "sbh", sbh, 2, False, True, UNLESS_FULL),
        SavedTensor("QKV input", "sbh", sbh, 2, False, True, UNLESS_FULL),
        SavedTensor("Q and K", "2sbh" if kv == h else "sbh + sb·kv", sbh + sbkv, 2, True, False, UNLESS_FULL),
    ]
    if flash:
        tensors.append(SavedTensor("softmax logsumexp (fp32)", "sba", s * b * a, 4, True, False, core_attention))
    else:
        tensors += [
            SavedTensor("softmax output", "as²b", as2b, 2, True, False, core_attention),
            SavedTensor("softmax dropout mask", "as²b", as2b, 1, True, False, core_attention),
            SavedTensor("softmax dropout output", "as²b", as2b, 2, True, False, core_attention),
        ]
    tensors += [
        SavedTensor("V", "sbh" if kv == h else "sb·kv", sbkv, 2, True, False, UNLESS_FULL),
        SavedTensor("projection input", "sbh", sbh, 2, True, False, UNLESS_FULL),
    ]
    if dropout:
        tensors.append(SavedTensor("attention dropout mask", "sbh", sbh, 1, False, True, UNLESS_FULL))
    tensors += [
        SavedTensor("MLP LayerNorm input", "sbh", sbh, 2, False, True, UNLESS_FULL),
        SavedTensor("MLP input", "sbh", sbh, 2, False, True, UNLESS_FULL),
    ]
    if swiglu:
        tensors += [
            SavedTensor("gate and up", "2sbf", 2 * s * b * f, 2, True, False, UNLESS_FULL),
            SavedTensor("second linear input", "sbf", s * b * f, 2, True, False, UNLESS_FULL),
        ]
    else:
        tensors += [
            SavedTensor("GeLU input", "sbf", s * b * f, 2, True, False, UNLESS_FULL),
            SavedTensor("second linear input", "sbf", s * b * f, 2, True, False, UNLESS_FULL),
        ]
    if dropout:
        tensors.append(SavedTensor("MLP dropout mask", "sbh", sbh, 1, False, True, UNLESS_FULL))
    tensors.append(SavedTensor("layer input, kept for recompute", "sbh", sbh, 2, False, True, ONLY_FULL))
    return tensors


def layer_bytes(tensors: list[SavedTensor], recompute: str, tp: int, sequence_parallel: bool) -> float:
    """Bytes one layer keeps for one microbatch."""
    return sum(t.bytes(tp, sequence_parallel) for t in tensors if recompute in t.kept_under)


def kept(tensors: list[SavedTensor], recompute: str) -> list[SavedTensor]:
    return [t for t in tensors if recompute in t.kept_under]
