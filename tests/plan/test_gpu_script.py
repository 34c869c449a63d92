"""The GPU script's dry run: every part runs on CPU at tiny sizes and leaves the files the GPU run would, so the
minutes on a lent GPU go to measuring rather than to finding a broken import."""

import json
import subprocess
import sys

import pytest

from tests.trainer.torchrun import ROOT


@pytest.mark.slow
def test_the_gpu_script_runs_every_part_on_cpu(tmp_path):
    finished = subprocess.run(
        [sys.executable, "benchmarks/gpu/run.py", str(tmp_path), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    summary = (tmp_path / "summary.txt").read_text()
    for part in ("gemm", "memory", "throughput", "kernels", "profile"):
        assert f"{part} " in summary and (tmp_path / f"{part}.log").exists()
    assert "device: cpu" in summary
    # What a lent GPU machine hands back: at most eight files.
    assert len(list(tmp_path.iterdir())) <= 8

    gemm = json.loads((tmp_path / "gemm.json").read_text())
    products = {(row["hidden"], row["tp"], row["product"]) for row in gemm["bf16"]}
    # Two hidden sizes × two tp degrees × four linears × three products each.
    assert len(products) == 48 and all(row["flops_per_s"] > 0 for row in gemm["bf16"])
    # SDPA's own choice and each forced backend (on CPU the math one), each timed.
    assert {row["backend"] for row in gemm["attention"]} == {"default", "MATH"}
    assert all(row["flops_per_s"] > 0 for row in gemm["attention"]) and gemm["copy"]["bytes_per_s"] > 0

    memory = json.loads((tmp_path / "memory.json").read_text())
    assert len(memory["cases"]) == 2
    for case in memory["cases"]:
        assert case["measured_peak_bytes"] > 0 and case["measured_step_s"] > 0, case
        assert case["estimated_peak_bytes"] > 0 and case["estimated_step_s"] > 0
    throughput = (tmp_path / "throughput.log").read_text()
    assert "ratio loom/HF" in throughput
    # bf16, then fp8 matmuls with each scaling recipe, against it.
    assert throughput.count("× bf16") == 3, throughput
    # A mixture of experts and the dense model of its active width, each measured and planned.
    assert throughput.count("tokens/s, MFU") == 2 and "MoE/dense tokens/s" in throughput, throughput
    kernels = (tmp_path / "kernels.log").read_text()
    assert "tests collected" in kernels
    # Four kernels, each at TP 1 and at a TP-8 rank's local shapes, each timed eager, compiled and fused.
    assert kernels.count("compiled/fused") == 8, kernels
    assert "planned per step" in (tmp_path / "profile.log").read_text()
