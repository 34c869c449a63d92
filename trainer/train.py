"""Training entry point: `torchrun --standalone --nproc_per_node=N -m trainer.train --config run.json`.

N must equal the config's world size (pp × dp_replicate × dp_shard × cp × tp). Each rank reports
metrics, logs and state changes through its own TelemetryClient (LOOM_URL, LOOM_TOKEN,
LOOM_ATTEMPT; spooled under LOOM_SPOOL_DIR). Checkpoints go to the config's directory, else
LOOM_CHECKPOINT_DIR, and name the run (LOOM_RUN_ID) and attempt. SIGTERM stops every rank at the
same step boundary, saves that step when checkpointing is on, reports the stop and exits with 143.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

from trainer import faults
from trainer.checkpoint import Checkpointer, checkpoint_root
from trainer.comm import comm_recorder
from trainer.config import ConfigError, OptimizerConfig, RunConfig, parse_config
from trainer.data.demo import WindowSampler, check_validation
from trainer.data.order import data_step
from trainer.data.sampler import TokenSampler, open_dataset
from trainer.metrics import memory, mfu, model_flops_per_token, own_work, peak_flops, state_bytes
from trainer.model import Transformer
from trainer.parallel.apply import ParallelModel, parallelize
from trainer.parallel.expert import routing_step
from trainer.parallel.float8 import fp8_refusal
from trainer.parallel.grads import clip_gradients
from trainer.parallel.mesh import MESH_DIMS, ParallelMesh
from trainer.parallel.state import dump_full_parameters
from trainer.plan.parameters import active_parameters, embedding_parameters
from trainer.telemetry import TelemetryClient, TelemetryLogHandler

# 128 + SIGTERM: what a shell reports for a process ended by SIGTERM, so launchers read it as a stop.
STOPPED_EXIT_CODE = 128 + signal.SIGTERM
USAGE_EXIT_CODE = 2
# A stopped rank has little time before torchrun escalates to SIGKILL; leftovers stay spooled.
STOPPED_TELEMETRY_TIMEOUT_S = 3.0
FINAL_TELEMETRY_TIMEOUT_S = 30.0
# After a failure, how long rank 0 may spend sealing a checkpoint every rank had written; torchrun
# waits 30 s after its SIGTERM before it SIGKILLs the survivors.
SALVAGE_TIMEOUT_S = 15.0
DEFAULT_SPOOL_DIR = "telemetry-spool"

logger = logging.getLogger("trainer.train")


class LaunchError(Exception):
    """The process was started in a way that cannot work; the message says how to start it."""


@dataclass(frozen=True)
class Launch:
    """What torchrun and the platform's launcher tell this process through its environment."""

    rank: int
    local_rank: int
    world_size: int
    url: str | None
    token: str | None
    attempt: int | None
    spool_dir: Path
    # LOOM_DUMP_PARAMS_DIR: write the full final parameters there (layout comparisons, debugging).
    dump_params_dir: Path | None = None
    run_id: str | None = None
    checkpoint_dir: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Launch:
        missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name not in environ]
        if missing:
            raise LaunchError(
                f"{', '.join(missing)} not set; start with "
                "`torchrun --standalone --nproc_per_node=<world size> -m trainer.train --config CONFIG.json`"
            )
        url = environ.get("LOOM_URL") or None
        token = environ.get("LOOM_TOKEN") or None
        attempt = environ.get("LOOM_ATTEMPT") or None
        if attempt is not None and not attempt.isdigit():
            raise LaunchError(f"LOOM_ATTEMPT must be a non-negative integer, got {attempt!r}")
        if url is not None and (token is None or attempt is None):
            raise LaunchError("LOOM_URL is set, so LOOM_TOKEN and LOOM_ATTEMPT must be set too")
        return cls(
            rank=int(environ["RANK"]),
            local_rank=int(environ["LOCAL_RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            url=url,
            token=token,
            attempt=int(attempt) if attempt is not None else None,
            spool_dir=Path(environ.get("LOOM_SPOOL_DIR") or DEFAULT_SPOOL_DIR),
            dump_params_dir=Path(environ["LOOM_DUMP_PARAMS_DIR"]) if environ.get("LOOM_DUMP_PARAMS_DIR") else None,
            run_id=environ.get("LOOM_RUN_ID") or None,
            checkpoint_dir=environ.get("LOOM_CHECKPOINT_DIR") or None,
        )


class StopSignal:
    """Set by SIGTERM; the step loop reads it, so a stop never lands in the middle of a step."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True


@dataclass(frozen=True)
class Outcome:
    last_step: int
    stopped: bool
    parallel_model: ParallelModel
    mesh: ParallelMesh


def load_config(path: Path) -> RunConfig:
    try:
        document = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ConfigError({"config": f"is not valid JSON: {error}"}) from None
    return parse_config(document)


def select_backend(requested: str, cuda_available: bool) -> str:
    """The process group's backends by device. With NCCL, CPU tensors still go through gloo: the step's vote
    and the checkpoint's coordination are small CPU collectives, which NCCL alone refuses."""
    if requested == "auto":
        requested = "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise LaunchError("parallel.backend='nccl' needs CUDA GPUs and none is visible; use 'gloo' or 'auto'")
    return "cuda:nccl,cpu:gloo" if requested == "nccl" else requested


def learning_rate(step: int, total_steps: int, optimizer: OptimizerConfig) -> float:
    """Linear warmup to lr over warmup_steps, then cosine decay to min_lr_ratio·lr at total_steps."""
    if step <= optimizer.warmup_steps:
        return optimizer.lr * step / optimizer.warmup_steps
    progress = (step - optimizer.warmup_steps) / max(1, total_steps - optimizer.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return optimizer.lr * (optimizer.min_lr_ratio + (1.0 - optimizer.min_lr_ratio) * cosine)


def build_optimizer(parameters: list[torch.nn.Parameter], optimizer: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW that decays matrices and embeddings only; norm gains keep their scale. Torch's fused AdamW: one
    kernel per step over all of a device's parameters, on CUDA and on CPU (the devices the trainer runs on), and
    on DTensor parameters (tensor parallelism, FSDP) as on plain ones."""
    parameters = [parameter for parameter in parameters if parameter.requires_grad]
    groups = [
        {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": optimizer.weight_decay},
        {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2), fused=True)


def train(
    config: RunConfig, launch: Launch, device: torch.device, telemetry: TelemetryClient, stop: StopSignal
) -> Outcome:
    mesh = ParallelMesh(config.parallel, launch.world_size, device.type)
    # Same seed on every rank: every layout starts from the weights a single process would have.
    torch.manual_seed(config.data.seed)
    model = Transformer(config.model).to(device)
    params_total = model.num_params()
    # A token's matmuls touch its top_k experts of each mixture-of-experts block, not all of them.
    flops_per_token = model_flops_per_token(
        config.model, active_parameters(config.model) - embedding_parameters(config.model)
    )
    peak = peak_flops(device)
    global_tokens = config.tokens_per_step
    sampler = training_data(config)
    if config.data.document_mask:
        model.document_end = sampler.dataset.eot_id
    parallel_model = parallelize(model, mesh, config, device)
    parameters = parallel_model.parameters()
    optimizer = build_optimizer(parameters, config.optimizer)
    data_parallel = config.parallel.data_parallel
    validation = []
    if config.eval.interval_steps:
        validation = sampler.validation_batches(config.eval.batches, mesh.dp_rank, data_parallel)
    comm = comm_recorder(config.telemetry, mesh, telemetry)
    telemetry.heartbeat_details = comm.progress
    checkpointer = Checkpointer(
        config,
        parallel_model.state_modules,
        optimizer,
        telemetry,
        device,
        root=checkpoint_root(config.checkpoint.directory, launch.checkpoint_dir),
        run_id=launch.run_id,
        attempt=launch.attempt,
    )
    checkpointer.data_position = lambda next_step: sampler.position(data_step(next_step, config.data.skip_steps))

    telemetry.emit(
        "state",
        {
            "state": "started",
            "world_size": launch.world_size,
            "device": str(device),
            # What the platform's page compares with the GPU the run was planned for.
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "backend": dist.get_backend(),
            "params": params_total,
            "mesh": mesh.coordinates(),
        },
    )
    logger.info(
        "training %d steps: %d parameters, %d ranks on %s (%s), %d tokens per step",
        config.steps,
        params_total,
        launch.world_size,
        device,
        " × ".join(f"{dim} {getattr(config.parallel, dim)}" for dim in MESH_DIMS),
        config.tokens_per_step,
    )
    restored = checkpointer.restore()
    first_step = restored.step + 1 if restored is not None else 1
    if restored is not None:
        sampler.resume(restored.manifest.get("data"), data_step(first_step, config.data.skip_steps))

    # Each rank reports tokens/s of its share of the global batch (the platform multiplies by the data-parallel
    # degree); tokens counts the whole run's.
    tokens_per_rank_step = global_tokens // data_parallel
    tokens_seen = (first_step - 1) * global_tokens
    last_step, last_loss, stop_votes = first_step - 1, None, 0.0
    leak = faults.Leak(config.faults)
    try:
        for step in range(first_step, config.steps + 1):
            faults.before_step(config.faults, step, launch.rank, settle=checkpointer.wait_for_writes)
            started = time.perf_counter()
            faults.slow_down(config.faults, step, launch.rank)
            with comm.recording():
                lr = learning_rate(step, config.steps, config.optimizer)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                batch = sampler.batch(data_step(step, config.data.skip_steps), mesh.dp_rank, data_parallel)
                inputs, targets = (tensor.to(device, non_blocking=True) for tensor in batch)
                optimizer.zero_grad(set_to_none=True)
                loss = parallel_model.forward_backward(inputs, targets)
                loss = faults.diverge(config.faults, step, loss, parameters)
                loss = faults.spike(config.faults, step, loss, parameters)
                norm = clip_gradients(parameters, config.optimizer.grad_clip, mesh, parallel_model.copies)
                update = update_allowed(config.optimizer.on_non_finite, step, norm)
                if update:
                    checkpointer.before_update()
                    optimizer.step()
                experts = routing_step(
                    parallel_model.state_modules, mesh, config.model.moe.bias_update_rate if update else 0.0
                )

                # One collective per step carries the loss sum, how many ranks hold a loss (only the last
                # pipeline stage does), the stop vote and the checkpoint-clock vote, so every rank leaves
                # the loop, and saves, after the same step.
                local_loss = to_local_value(loss) if loss is not None else None
                votes = [float(stop.requested), float(checkpointer.due_by_time())]
                shared = torch.tensor([local_loss or 0.0, float(local_loss is not None), *votes], dtype=torch.float64)
                dist.all_reduce(shared)
                loss_sum, loss_count, stop_votes, save_votes = shared.tolist()
            step_time = time.perf_counter() - started
            tokens_seen += global_tokens
            metrics = {
                "loss_mean": loss_sum / loss_count,
                "grad_norm": norm,
                "lr": lr,
                "step_time_s": step_time,
                "tokens_per_s": tokens_per_rank_step / step_time,
                "tokens": tokens_seen,
                "mfu": mfu(flops_per_token, global_tokens, step_time, launch.world_size, peak),
                **memory(device),
            }
            if local_loss is not None:
                metrics["loss"] = local_loss
            if not update:
                metrics["update_skipped"] = 1.0
            if experts and mesh.rank_in("dp_cp") == 0 and mesh.rank_in("tp") == 0:
                metrics["experts"] = experts
            if evaluation_due(step, config):
                metrics["eval_loss"] = validation_loss(parallel_model, validation, device)
            if step == first_step:
                metrics |= state_bytes(parameters, optimizer)
            comm_s = comm.step_finished(step)
            if comm_s is not None:
                metrics |= own_work(step_time, comm_s)
            telemetry.emit("metric", metrics, step=step)
            evaluated = f" eval_loss {metrics['eval_loss']:.4f}" if "eval_loss" in metrics else ""
            print(
                f"rank {launch.rank} step {step}/{config.steps} loss {metrics.get('loss', float('nan')):.4f} "
                f"mean {metrics['loss_mean']:.4f} grad_norm {norm:.3f} lr {lr:.2e} "
                f"{metrics['tokens_per_s']:,.0f} tok/s {step_time * 1000:.0f} ms{evaluated}",
                flush=True,
            )
            last_step, last_loss = step, metrics["loss_mean"]
            leak.step_done()
            if checkpointer.due(step) or save_votes:
                checkpointer.save(step, last_loss)
            if stop_votes:
                break
    except BaseException:
        checkpointer.salvage(SALVAGE_TIMEOUT_S)
        raise
    # A run that stops early, or whose steps do not fill the last window, still reports it.
    comm.flush()
    # A stopped run saves the step it completed last, a finished one its final step (unless saved already).
    checkpointer.finish(last_step, last_loss)
    checkpointer.close()
    return Outcome(last_step=last_step, stopped=bool(stop_votes), parallel_model=parallel_model, mesh=mesh)


def training_data(config: RunConfig) -> TokenSampler | WindowSampler:
    """The sampler of the run's data: the prepared dataset data.dataset names, else the demo corpus."""
    if config.data.dataset is not None:
        return TokenSampler(open_dataset(config), config)
    return WindowSampler.from_config(config)


def evaluation_due(step: int, config: RunConfig) -> bool:
    """Every eval.interval_steps steps, and after the last step; never when the interval is 0."""
    interval = config.eval.interval_steps
    return interval > 0 and (step % interval == 0 or step == config.steps)


def validation_loss(
    parallel_model: ParallelModel, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    """The mean loss over the validation batches' tokens, the same on every rank. Every rank that computes a loss
    holds as many tokens as any other (or the same tokens, across tp), so the mean of their means is the mean
    over the tokens."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        loss = parallel_model.evaluate(inputs.to(device), targets.to(device))
        if loss is not None:
            total, count = total + to_local_value(loss), count + 1
    shared = torch.tensor([total, float(count)], dtype=torch.float64)
    dist.all_reduce(shared)
    loss_sum, loss_count = shared.tolist()
    return loss_sum / loss_count


class NonFiniteError(RuntimeError):
    pass


def update_allowed(policy: str, step: int, grad_norm: float) -> bool:
    """Whether the optimizer applies this step (optimizer.on_non_finite). The norm is global, so every rank
    decides alike and none waits in a collective the others skip."""
    if math.isfinite(grad_norm) or policy == "continue":
        return True
    if policy == "stop":
        raise NonFiniteError(f"gradient norm {grad_norm} at step {step}: stopping (optimizer.on_non_finite = stop)")
    logger.warning("gradient norm %s at step %d: update skipped (optimizer.on_non_finite = skip)", grad_norm, step)
    return False


def to_local_value(value: torch.Tensor) -> float:
    return (value.full_tensor() if isinstance(value, DTensor) else value).item()


def run(config: RunConfig, launch: Launch, telemetry: TelemetryClient, stop: StopSignal) -> Outcome:
    """Train inside a process group and report how it ended."""
    cuda_available = torch.cuda.is_available()
    backend = select_backend(config.parallel.backend, cuda_available)
    device = torch.device("cuda", launch.local_rank) if cuda_available else torch.device("cpu")
    if cuda_available:
        torch.cuda.set_device(device)
    if config.compute.precision == "fp8" and (refusal := fp8_refusal(device)):
        raise LaunchError(refusal)
    dist.init_process_group(backend)
    try:
        outcome = train(config, launch, device, telemetry, stop)
    except BaseException:
        # No barrier here: the other ranks are inside a different collective and would never
        # meet it. Tearing the group down makes their collectives fail fast instead of hanging.
        dist.destroy_process_group()
        raise
    if outcome.stopped:
        stopped = {"state": "stopped", "reason": "SIGTERM", "step": outcome.last_step}
        telemetry.emit("state", stopped, step=outcome.last_step)
        logger.info("stopped by SIGTERM after step %d", outcome.last_step)
    else:
        telemetry.emit("state", {"state": "finished", "steps": outcome.last_step}, step=outcome.last_step)
    if launch.dump_params_dir is not None:
        dump_full_parameters(outcome.parallel_model, outcome.mesh, launch.dump_params_dir)
    # Every rank reaches this point after the same step; without the barrier gloo can abort a peer still exiting.
    dist.barrier()
    dist.destroy_process_group()
    return outcome


def configure(argv: list[str] | None, environ: Mapping[str, str]) -> tuple[RunConfig, Launch]:
    """The validated run config and launch environment, or ConfigError/LaunchError saying what to fix."""
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="run-config JSON document")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    if config.data.dataset is not None:
        open_dataset(config)
    else:
        check_validation(config)
    launch = Launch.from_environment(environ)
    expected = config.parallel.world_size
    if launch.world_size != expected:
        raise LaunchError(
            f"torchrun started {launch.world_size} ranks but the layout needs {expected} "
            f"(pp × dp_replicate × dp_shard × cp × tp); launch with --nproc_per_node={expected}"
        )
    return config, launch


# torchrun then writes each failing rank's error and its time to error.json, which is how the
# launcher tells the rank that failed first from the ranks that failed because it did.
@record
def main(argv: list[str] | None = None) -> int:
    try:
        config, launch = configure(argv, os.environ)
    except (ConfigError, LaunchError, OSError) as error:
        print(f"trainer: {error}", file=sys.stderr, flush=True)
        return USAGE_EXIT_CODE

    stop = StopSignal()
    stop.install()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{launch.rank} %(levelname)s %(name)s: %(message)s")
    telemetry = TelemetryClient(
        url=launch.url,
        token=launch.token,
        attempt=launch.attempt,
        rank=launch.rank,
        spool_dir=launch.spool_dir,
        flush_interval_s=config.telemetry.flush_interval_s,
        heartbeat_interval_s=config.telemetry.heartbeat_interval_s,
    )
    log_handler = TelemetryLogHandler(telemetry)
    logging.getLogger().addHandler(log_handler)
    telemetry_timeout_s = FINAL_TELEMETRY_TIMEOUT_S
    try:
        outcome = run(config, launch, telemetry, stop)
        if outcome.stopped:
            telemetry_timeout_s = STOPPED_TELEMETRY_TIMEOUT_S
        return STOPPED_EXIT_CODE if outcome.stopped else 0
    except BaseException:
        logger.exception("training failed on rank %d", launch.rank)
        raise
    finally:
        logging.getLogger().removeHandler(log_handler)
        undelivered = telemetry.close(telemetry_timeout_s)
        if undelivered and launch.url is not None:
            print(
                f"trainer: {undelivered} telemetry batches are still spooled in {telemetry.rank_dir}",
                file=sys.stderr,
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
