"""What a launched attempt's ranks will train on, and what a new run is warned of because of it.

The local launch backend runs torchrun on the Celery worker's machine, and each rank trains on CUDA
with NCCL when torch there sees a GPU, else on CPU with gloo (trainer.train.run). Where the web and the
worker run on other machines (docker/compose.yaml), LOOM_LAUNCH_GPUS says what the worker's ranks see;
unset, the web process asks the same Python's torch the same question, once per process and in a child
process, so that torch is never loaded into the web process: right in the embedded default, where the
worker runs on this machine.
"""

import functools
import json
import logging
import subprocess
import sys

from django.conf import settings

log = logging.getLogger(__name__)

# The question each rank's trainer asks, and the names of the GPUs it would train on.
PROBE = (
    "import json, torch\n"
    "count = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(json.dumps([torch.cuda.get_device_name(index) for index in range(count)]))"
)
PROBE_TIMEOUT_S = 120


def launch_gpus() -> tuple[str, ...] | None:
    """The names of the GPUs the launcher's ranks will see (torch.cuda's names); empty: they train on CPU;
    None when torch could not be asked, which must not stop a run from being created."""
    stated = settings.LOOM_LAUNCH_GPUS
    if stated is None:
        return _probed_gpus()
    return () if stated.strip().lower() in ("", "none") else tuple(name.strip() for name in stated.split(","))


@functools.cache
def _probed_gpus() -> tuple[str, ...] | None:
    try:
        answer = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True
        )
        return tuple(json.loads(answer.stdout))
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        log.warning("could not ask torch which GPUs the launcher has, so runs get no launch warnings: %s", error)
        return None


def planner_gpu(device_name: str) -> str | None:
    """The planner's GPU type for a name as torch.cuda reports it ("NVIDIA H100 80GB HBM3" is an
    H100-SXM); None for a GPU the planner has no figures for."""
    name = device_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name:
        return "H100-PCIe" if "PCIE" in name else "H100-SXM"
    if "A100" in name:
        return "A100-40GB" if "40GB" in name else "A100-80GB"
    if "B200" in name:
        return "B200"
    return None


def warnings_for(run) -> dict[str, str]:
    """launch_warnings of a run just created, on the launcher's GPUs."""
    return launch_warnings(run.config, run.estimate, launch_gpus())


def launch_warnings(config: dict, estimate: dict | None, gpus: tuple[str, ...] | None) -> dict[str, str]:
    """What a valid run would do on the launcher's hardware (`gpus`, as launch_gpus names them) other
    than its config and its stored estimate suggest, keyed by field path as RunInputError's errors are.
    A warning does not stop the run: training on other hardware than planned is often what is meant."""
    warnings = {}
    if gpus is None:
        return warnings
    if config["compute"]["precision"] == "bf16" and not gpus:
        warnings["config.compute.precision"] = (
            "bf16 but the launcher has no GPU (torch on its machine sees no CUDA device): the ranks will "
            "compute in bf16 on CPU with gloo; auto trains in fp32 there"
        )
    if estimate is not None:
        cluster = estimate["cluster"]
        planned = f"{cluster['nodes'] * cluster['gpus_per_node']} × {cluster['gpu']}"
        if not gpus:
            warnings["cluster.gpu"] = (
                f"the estimate is for {planned} but the launcher has no GPU: the ranks will train on CPU, "
                "where the prediction does not apply"
            )
        elif planner_gpu(gpus[0]) != cluster["gpu"]:
            known = planner_gpu(gpus[0])
            remedy = f"estimate on {known} instead" if known else "the planner has no figures for them"
            warnings["cluster.gpu"] = (
                f"the estimate is for {planned} but the launcher's GPUs are {gpus[0]}: the prediction does "
                f"not apply to them; {remedy}"
            )
    return warnings
