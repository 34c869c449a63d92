"""The memory-bound passes of one transformer block: the bytes its norms, rotary embeddings, MLP activation and
residual additions move through HBM, forward, for the tokens one rank holds.

Fused (loom's Triton kernels, Transformer Engine, or what torch.compile generates) each is one pass: a norm reads
and writes the hidden state, rotary reads and writes q and k, SwiGLU reads gate and up and writes their product, a
residual addition reads two and writes one. Op by op in eager PyTorch every op reads its inputs and writes its
output, upcasts included; the counts below follow the code, e bytes per activation element:

- loom's torch ops (trainer/kernels/reference.py, where the Triton kernels do not run): RMSNorm x.float(),
  pow, mean, the multiply by rsqrt, by the fp32 weight, back to e: 32 + 2e bytes per element; rotary x.float(),
  ·cos, the negated half, cat, ·sin, the sum, back: 48 + 2e per q or k element; SwiGLU gate.float(), silu,
  up.float(), the product, back: 32 + 3e per ffn element.
- torchtitan (torchtitan/models at 9dec370): RMSNorm x.float(), pow, mean, ·rsqrt, back to e, ·weight: 28 + 4e;
  rotary through complex numbers, x.float(), the complex product, back: 16 + 2e; SwiGLU silu(w1 x) · w3 x in e:
  5e; and two copies loom does not make: grouped-query keys and values expanded to every head (repeat_kv) and the
  attention output made contiguous.

Backward moves about twice what forward does (compute.BACKWARD_MEMORY_FACTOR).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.plan.layout import Layout

# x + attention, then + the MLP: two additions in a parallel block (model.parallel_blocks) too.
RESIDUALS_PER_BLOCK = 2


@dataclass(frozen=True)
class PassBytes:
    """Bytes one block's memory-bound passes move per token, forward, on one rank."""

    attention: float
    """The attention sub-block's: its norm, rotary, and the copies around attention."""
    attention_norm: float
    """Of which its norm's."""
    mlp: float
    """The MLP sub-block's: its norm (none in a parallel block, whose MLP reads the attention's) and activation."""
    residual: float

    @property
    def block(self) -> float:
        return self.attention + self.mlp + self.residual


def per_element(layout: Layout) -> tuple[float, float, float]:
    """(norm, rotary, SwiGLU) bytes per element."""
    e = layout.activation_bytes
    if layout.fused_passes:
        return 2 * e, 2 * e, 3 * e
    if layout.runtime == "torchtitan":
        return 28 + 4 * e, 16 + 2 * e, 5 * e
    return 32 + 2 * e, 48 + 2 * e, 32 + 3 * e


def block_pass_bytes(layout: Layout) -> PassBytes:
    """Per token of the rank's sequence; the hidden-state passes split over tp ranks under sequence parallel, the
    head- and ffn-wide ones always. A parallel block runs one norm, the attention's."""
    model, tp = layout.model, layout.parallel.tp
    e = layout.activation_bytes
    spread = tp if layout.sequence_parallel else 1
    head_dim = model.dim // model.heads
    norm, rotary, swiglu = per_element(layout)
    query_key = (model.heads + model.kv_heads) * head_dim / tp
    attention_norm = model.dim / spread * norm
    attention = attention_norm + query_key * rotary
    if layout.runtime == "torchtitan" and not layout.fused_passes:
        if model.kv_heads < model.heads:
            # Keys and values read at kv width and written at every head's.
            attention += 2 * (model.kv_heads * head_dim + model.dim) / tp * e
        attention += 2 * model.dim / tp * e
    activation = swiglu if model.mlp == "swiglu" else 2 * e
    mlp_norm = 0 if model.parallel_blocks else attention_norm
    mlp = mlp_norm + model.ffn * model.feed_forward_paths / tp * activation
    return PassBytes(attention, attention_norm, mlp, RESIDUALS_PER_BLOCK * 3 * e * model.dim / spread)
