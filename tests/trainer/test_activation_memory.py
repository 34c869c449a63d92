"""The planner's activation memory, tensor by tensor (trainer/plan/activations.py), against what loom's model
really keeps for backward in each layout: byte for byte, per layer, in fp32 and in bf16 under autocast (on CPU,
whose autocast casts these ops as CUDA's does)."""

import itertools
import json
import subprocess
import sys

import pytest

from tests.trainer.saved_activations import MICRO_BATCH, layout_config
from tests.trainer.torchrun import ROOT
from trainer.plan.activations import Shape, layer_bytes
from trainer.plan.layout import Layout
from trainer.plan.memory import layer_tensors

LAYOUTS = (
    [
        (tp, sequence_parallel, recompute, precision, "swiglu")
        for (tp, sequence_parallel), recompute, precision in itertools.product(
            [(1, False), (2, False), (2, True)], ["none", "selective", "full"], ["fp32", "bf16"]
        )
    ]
    + [
        # GPT-3's GELU block keeps its own tensors where the MLP keeps any (not under full recompute).
        (tp, sequence_parallel, recompute, precision, "gelu")
        for (tp, sequence_parallel), recompute, precision in itertools.product(
            [(1, False), (2, True)], ["none", "selective"], ["fp32", "bf16"]
        )
    ]
    + [
        # A mixture of experts keeps its routing (choices, gates, dispatched tokens, what comes back, the indices that
        # sort them) besides its experts' products; a shared expert adds a dense block's. Under tensor parallelism
        # the router keeps its part of the sequence, the experts their columns of every token.
        (1, False, recompute, precision, mixture)
        for recompute, precision, mixture in itertools.product(
            ["none", "selective", "full"], ["fp32", "bf16"], ["moe", "moe_shared"]
        )
    ]
    + [
        (2, sequence_parallel, recompute, precision, mixture)
        for sequence_parallel, recompute, precision, mixture in itertools.product(
            [True, False], ["none", "selective"], ["fp32", "bf16"], ["moe", "moe_shared"]
        )
    ]
    + [
        # A parallel block keeps one norm's input and statistics, and its output once for attention and the MLP where
        # they both keep it uncast: not under autocast, and not where sequence parallelism gathers it for a dense MLP
        # (a copy); a mixture's router keeps it on the rank's own tokens, except where tensor parallelism without
        # sequence parallelism splits a copy off for the router.
        (tp, sequence_parallel, recompute, precision, "parallel_swiglu")
        for (tp, sequence_parallel), recompute, precision in itertools.product(
            [(1, False), (2, False), (2, True)], ["none", "selective"], ["fp32", "bf16"]
        )
    ]
    + [(1, False, "full", "fp32", "parallel_swiglu"), (2, True, "full", "bf16", "parallel_swiglu")]
    + [
        (tp, sequence_parallel, recompute, "fp32", "parallel_moe_shared")
        for (tp, sequence_parallel), recompute in itertools.product(
            [(1, False), (2, False), (2, True)], ["none", "selective"]
        )
    ]
    + [(1, False, "none", "bf16", "parallel_moe_shared"), (2, True, "selective", "bf16", "parallel_moe_shared")]
    + [(1, False, "none", "bf16", "parallel_gelu"), (2, True, "selective", "fp32", "parallel_gelu")]
)


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    finished = subprocess.run(
        [sys.executable, "tests/trainer/saved_activations.py", json.dumps(LAYOUTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.splitlines()[-1])


@pytest.mark.parametrize(("tp", "sequence_parallel", "recompute", "precision", "mlp"), LAYOUTS)
def test_the_planner_counts_what_a_layer_keeps(measured, tp, sequence_parallel, recompute, precision, mlp):
    layout = Layout(layout_config(tp, sequence_parallel, recompute, precision, mlp, layers=1))
    tensors = layer_tensors(layout, Shape.of(layout.model, layout.model.seq_len, MICRO_BATCH))
    planned = layer_bytes(tensors, recompute, tp, sequence_parallel and tp > 1)
    assert planned == measured[json.dumps([tp, sequence_parallel, recompute, precision, mlp])]
