"""The environment a rank starts with: what the toolchain and the accelerators need, from an allow-list, and
never the platform's own secrets. A worker's environment holds LOOM_SECRET_KEY, DATABASE_URL and REDIS_URL;
a rank runs the user's config (and, once models can be imported, the user's code) and needs none of them."""

from collections.abc import Mapping

from django.conf import settings

ALLOWED_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH", "VIRTUAL_ENV"}
)
# Python's own switches, locales, and the knobs of CUDA, NCCL, PyTorch, Triton and the math libraries'
# thread pools (CUDA_VISIBLE_DEVICES, NCCL_SOCKET_IFNAME, TORCH_NCCL_*, TRITON_INTERPRET, OMP_NUM_THREADS, …).
ALLOWED_PREFIXES = (
    "PYTHON", "LC_", "CUDA_", "NCCL_", "NVIDIA_", "TORCH", "TRITON_", "OMP_", "MKL_", "OPENBLAS_", "GLOO_",
)  # fmt: skip


def rank_environment(inherited: Mapping[str, str], launch: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of `inherited` (plus the names in LOOM_RANK_ENV), then the launch's own variables
    (LOOM_URL, LOOM_TOKEN, LOOM_ATTEMPT, …)."""
    passed = set(settings.LOOM_RANK_ENV)
    kept = {
        name: value
        for name, value in inherited.items()
        if name in ALLOWED_NAMES or name in passed or name.startswith(ALLOWED_PREFIXES)
    }
    return {**kept, **launch}
