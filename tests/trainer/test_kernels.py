"""Every fused op against its definition in trainer.kernels.reference, forward and backward.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; with one they are compiled and
run on it, and the torch backend is checked on both devices.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer.kernels import TORCH_KERNELS, kernels_for, reference
from trainer.model import rotary_tables

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if HAS_CUDA else [])
TRITON_DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
EPS = 1e-5
FP32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def triton_kernels():
    # Without a GPU, tests/conftest.py has set TRITON_INTERPRET=1 before anything imported triton.
    return kernels_for("triton", TRITON_DEVICE)


@pytest.fixture(
    params=[pytest.param(("torch", device), id=f"torch-{device.type}") for device in DEVICES]
    + [pytest.param(("triton", TRITON_DEVICE), id=f"triton-{TRITON_DEVICE.type}")]
)
def chunked(request, triton_kernels):
    """A chunked cross-entropy implementation and the device to run it on."""
    backend, device = request.param
    return (triton_kernels if backend == "triton" else TORCH_KERNELS), device


def randn(*shape, device=TRITON_DEVICE, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def run_with_upstream_gradient(fn, inputs, seed=1):
    """fn(*copies of inputs) and the gradients of the copies for a random upstream gradient of fn's output."""
    leaves = [tensor.detach().clone().requires_grad_() for tensor in inputs]
    out = fn(*leaves)
    upstream = randn(*out.shape, device=out.device, dtype=out.dtype, seed=seed)
    out.backward(upstream)
    return out, [leaf.grad for leaf in leaves]


def assert_close(actual, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, **FP32)
    else:
        # bf16 keeps 8 bits of mantissa; Triton's interpreter also truncates where the GPU rounds.
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale)


def assert_matches_reference(fn, reference_fn, inputs, dtype=torch.float32):
    out, grads = run_with_upstream_gradient(fn, inputs)
    expected_out, expected_grads = run_with_upstream_gradient(reference_fn, inputs)
    assert out.dtype == expected_out.dtype and out.shape == expected_out.shape
    assert_close(out, expected_out, dtype)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected_grad.dtype
        assert_close(grad, expected_grad, dtype)


# The references are what the model computes today.


def test_reference_rms_norm_is_torchs():
    x, weight = randn(6, 40, device="cpu"), randn(40, device="cpu", seed=1)
    torch.testing.assert_close(reference.rms_norm(x, weight, EPS), F.rms_norm(x, (40,), weight, EPS))


def test_reference_swiglu_is_silu_gate_times_up():
    gate, up = randn(6, 40, device="cpu"), randn(6, 40, device="cpu", seed=1)
    torch.testing.assert_close(reference.swiglu(gate, up), F.silu(gate) * up)


def test_reference_rotary_rotates_each_pair_by_its_position():
    cos, sin = rotary_tables(seq_len=12, head_dim=16)
    x = randn(2, 3, 12, 16, device="cpu")
    rotated = reference.rotary(x, cos, sin)
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0])  # position 0: angle 0
    pair_norms = lambda t: (t[..., :8] ** 2 + t[..., 8:] ** 2).sqrt()  # noqa: E731
    torch.testing.assert_close(pair_norms(rotated), pair_norms(x))
    assert not torch.allclose(rotated[:, :, 5], x[:, :, 5])


def test_reference_cross_entropy_is_torchs_on_full_logits():
    hidden, weight = randn(10, 8, device="cpu"), randn(30, 8, device="cpu", seed=1)
    targets = torch.arange(10) * 3
    torch.testing.assert_close(
        reference.cross_entropy(hidden, weight, targets), F.cross_entropy(hidden @ weight.T, targets)
    )


# Triton kernels.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(37, 100), (3, 5, 48), (2, 64)], ids=str)
def test_triton_rms_norm(triton_kernels, shape, dtype):
    x, weight = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype, seed=2)
    assert_matches_reference(
        lambda x, weight: triton_kernels.rms_norm(x, weight, EPS),
        lambda x, weight: reference.rms_norm(x, weight, EPS),
        [x, weight],
        dtype,
    )


def test_triton_rms_norm_reads_rows_of_a_wider_tensor_through_their_stride(triton_kernels):
    wide, weight = randn(13, 40), randn(36, seed=2)
    assert_matches_reference(
        lambda wide, weight: triton_kernels.rms_norm(wide[:, :36], weight, EPS),
        lambda wide, weight: reference.rms_norm(wide[:, :36], weight, EPS),
        [wide, weight],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 7, 43), (2, 1500)], ids=str)
def test_triton_swiglu(triton_kernels, shape, dtype):
    gate, up = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype, seed=2)
    assert_matches_reference(triton_kernels.swiglu, reference.swiglu, [gate, up], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 3, 19, 24), (1, 2, 8, 64)], ids=str)
def test_triton_rotary(triton_kernels, shape, dtype):
    cos, sin = (table.to(TRITON_DEVICE) for table in rotary_tables(seq_len=shape[2], head_dim=shape[3]))
    assert_matches_reference(
        lambda x: triton_kernels.rotary(x, cos, sin),
        lambda x: reference.rotary(x, cos, sin),
        [randn(*shape, dtype=dtype)],
        dtype,
    )


def test_triton_rotary_of_the_attentions_transposed_view(triton_kernels):
    """q and k reach the kernel as [B, T, H, D] projections viewed as [B, H, T, D]; tables of any values."""
    cos, sin = randn(11, 20, seed=3), randn(11, 20, seed=4)
    assert_matches_reference(
        lambda x: triton_kernels.rotary(x.transpose(1, 2), cos, sin),
        lambda x: reference.rotary(x.transpose(1, 2), cos, sin),
        [randn(2, 11, 3, 20)],
    )


def compile_every_triton_kernel_for_sm90():
    """The interpreter runs code the compiler would reject; CI without a GPU still compiles every kernel."""
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainer.kernels import cross_entropy, rmsnorm, rope, swiglu

    data, fp32, i32 = "*bf16", "*fp32", "i32"
    kernels = [
        (rmsnorm._rms_norm_forward, [data, i32, data, data, fp32, i32, "fp32"], {"BLOCK": 4096}),
        (rmsnorm._rms_norm_backward, [data, i32, data, i32, data, fp32, data, fp32, i32, i32, i32], {"BLOCK": 4096}),
        (swiglu._swiglu_forward, [data, data, data, i32], {"BLOCK": swiglu.BLOCK}),
        (swiglu._swiglu_backward, [data, data, data, data, data, i32], {"BLOCK": swiglu.BLOCK}),
        *(
            (
                rope._rotate,
                [data, i32, i32, i32, data, i32, i32, i32, fp32, fp32, i32, i32, i32],
                {"TRANSPOSE": transpose, "BLOCK_POSITIONS": rope.BLOCK_POSITIONS, "BLOCK_HALF": 64},
            )
            for transpose in (False, True)
        ),
        (cross_entropy._losses_and_logsumexp, [data, i32, "*i64", fp32, fp32, i32, i32], {"BLOCK": 8192}),
        (cross_entropy._logits_gradient_in_place, [data, i32, "*i64", fp32, fp32, i32, i32], {"BLOCK": 8192}),
    ]
    for kernel, argument_types, constexprs in kernels:
        runtime_arguments = [name for name in kernel.arg_names if name not in constexprs]
        signature = dict(zip(runtime_arguments, argument_types, strict=True)) | dict.fromkeys(constexprs, "constexpr")
        compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))


def python_without_interpreter(code: str, timeout_s: float) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter where Triton is not in interpreter mode."""
    environ = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout_s
    )


def test_triton_kernels_compile_for_a_gpu():
    result = python_without_interpreter(
        "from tests.trainer.test_kernels import compile_every_triton_kernel_for_sm90 as c; c()", timeout_s=300
    )
    assert result.returncode == 0, result.stderr


# Chunked cross-entropy, Triton and torch.


def lm_head_inputs(rows, dim, vocab, device, dtype=torch.float32, ignore_index=reference.IGNORE_INDEX):
    hidden = randn(rows, dim, device=device, dtype=dtype)
    weight = randn(vocab, dim, device=device, dtype=dtype, seed=2)
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(3))
    targets[::3] = ignore_index
    return hidden, weight, targets.to(device)


@pytest.mark.parametrize(
    "rows, dim, vocab, chunk_size",
    [(37, 24, 100, 8), (64, 16, 257, 64), (5, 8, 50, 16), (6, 8, 9000, 4)],
    ids=["ragged-last-chunk", "one-chunk", "chunk-larger-than-rows", "vocab-over-several-blocks"],
)
def test_chunked_cross_entropy(chunked, rows, dim, vocab, chunk_size):
    kernels, device = chunked
    hidden, weight, targets = lm_head_inputs(rows, dim, vocab, device)
    assert_matches_reference(
        lambda hidden, weight: kernels.cross_entropy(hidden, weight, targets, chunk_size=chunk_size),
        lambda hidden, weight: reference.cross_entropy(hidden, weight, targets),
        [hidden, weight],
    )


def test_chunked_cross_entropy_in_bf16_gives_an_fp32_loss(chunked):
    kernels, device = chunked
    hidden, weight, targets = lm_head_inputs(37, 24, 100, device, dtype=torch.bfloat16)
    assert_matches_reference(
        lambda hidden, weight: kernels.cross_entropy(hidden, weight, targets, chunk_size=8),
        lambda hidden, weight: reference.cross_entropy(hidden, weight, targets),
        [hidden, weight],
        torch.bfloat16,
    )
    assert kernels.cross_entropy(hidden, weight, targets).dtype == torch.float32


def test_chunked_cross_entropy_with_another_ignore_index_and_batch_shaped_inputs(chunked):
    kernels, device = chunked
    hidden, weight, targets = lm_head_inputs(24, 16, 40, device, ignore_index=7)
    assert_matches_reference(
        lambda hidden, weight: kernels.cross_entropy(
            hidden.view(4, 6, 16), weight, targets.view(4, 6), ignore_index=7, chunk_size=5
        ),
        lambda hidden, weight: reference.cross_entropy(hidden, weight, targets, ignore_index=7),
        [hidden, weight],
    )


def test_chunked_cross_entropy_under_autocast_computes_the_logits_in_the_autocast_dtype(chunked):
    kernels, device = chunked
    hidden, weight, targets = lm_head_inputs(37, 24, 100, device)

    def autocast(cross_entropy):
        def run(hidden, weight):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return cross_entropy(hidden, weight, targets)

        return run

    assert_matches_reference(
        autocast(kernels.cross_entropy), autocast(reference.cross_entropy), [hidden, weight], torch.bfloat16
    )


class LargestTensor(TorchDispatchMode):
    """Remembers the most bytes of any tensor an op returned while the mode was active."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        self.bytes = max([self.bytes, *(tensor.numel() * tensor.element_size() for tensor in tensors)])
        return out


def largest_tensor_of_forward_and_backward(cross_entropy, hidden, weight, targets):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with LargestTensor() as largest:
        cross_entropy(hidden, weight, targets).backward()
    return largest.bytes


def test_chunked_cross_entropy_never_makes_a_tensor_of_all_the_logits(chunked):
    kernels, device = chunked
    rows, vocab, chunk_size = 192, 1000, 16
    fp32_logits_bytes = vocab * torch.float32.itemsize
    hidden, weight, targets = lm_head_inputs(rows, 8, vocab, device)
    reference_largest = largest_tensor_of_forward_and_backward(reference.cross_entropy, hidden, weight, targets)
    assert reference_largest >= rows * fp32_logits_bytes, "the check must see the reference's full logits"
    largest = largest_tensor_of_forward_and_backward(
        lambda *inputs: kernels.cross_entropy(*inputs, chunk_size=chunk_size), hidden, weight, targets
    )
    assert largest <= chunk_size * fp32_logits_bytes


# Choosing a backend.


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_auto_picks_triton_on_cuda_and_torch_elsewhere(device):
    assert kernels_for("auto", device).backend == ("triton" if device.type == "cuda" else "torch")


def test_torch_backend_is_the_plain_torch_set_on_any_device():
    assert kernels_for("torch", torch.device("cpu")) is TORCH_KERNELS
    assert kernels_for("torch", torch.device("cuda")) is TORCH_KERNELS


def test_triton_on_cpu_without_the_interpreter_says_what_would_work(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA device.*'auto' or 'torch'.*TRITON_INTERPRET=1"):
        kernels_for("triton", torch.device("cpu"))


def test_without_triton_installed_auto_falls_back_and_triton_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    assert kernels_for("auto", torch.device("cuda")) is TORCH_KERNELS
    with pytest.raises(RuntimeError, match="pip install triton"):
        kernels_for("triton", torch.device("cuda"))


def test_an_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match="'cuda'; choose one of auto, triton, torch"):
        kernels_for("cuda", torch.device("cpu"))


def test_the_torch_kernels_do_not_import_triton():
    code = "import sys, torch, trainer.kernels as k; k.kernels_for('auto', 'cpu'); print('triton' in sys.modules)"
    result = python_without_interpreter(code, timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
