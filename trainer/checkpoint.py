"""Checkpoints: model and optimizer state through torch.distributed.checkpoint (DCP), committed atomically.

On disk, under the checkpoint directory:

    step-000010/                  committed: the name has no suffix and manifest.json lists every file
        .metadata  __0_0.distcp  __1_0.distcp  …   DCP's files, one or more per rank
        manifest.json             run, attempt, step, layout, world size, parent, data position, RNG,
                                  learning-rate schedule, loss, and every file with its size and sha256
    step-000020.tmp-<nonce>/      being written (or abandoned by a crash): never loaded

Every rank writes its shards into the temporary directory; when DCP's finish step tells rank 0 that
all ranks are done (its .metadata is written only after gathering every rank's results), rank 0
hashes the files, writes the manifest and renames the directory. A rename is atomic, so a reader
sees a checkpoint whole or not at all; loading hashes every file again, so one damaged afterwards
is refused, naming the file.

State is keyed by full parameter names (`blocks.7.attention.wq.weight`), which pipeline stages keep,
and the optimizer's state is flattened per parameter, so DCP reshards a checkpoint from any layout
into any other. Data and the learning rate are pure functions of the step, so the step is the
data-loader and scheduler position.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from trainer import faults
from trainer.config import ModelConfig, RunConfig
from trainer.telemetry import Pins, PlatformUnreachable, TelemetryClient

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
COMMITTED_NAME = re.compile(r"^step-(\d+)$")
HASH_CHUNK_BYTES = 1 << 20
DEFAULT_DIRECTORY = "checkpoints"
# How long a commit waits for training to reach its next optimizer step before reporting the stall so far.
STALL_KNOWN_TIMEOUT_S = 300.0

logger = logging.getLogger("trainer.checkpoint")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names it and says why."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files are missing, truncated or changed since it was committed."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(path: Path) -> int | None:
    """The step of a committed checkpoint's directory name; None for any other name."""
    match = COMMITTED_NAME.match(path.name)
    return int(match[1]) if match else None


def checkpoint_root(configured: str | None, from_environment: str | None) -> Path:
    """The directory that holds this run's checkpoints, absolute: the config's, else $LOOM_CHECKPOINT_DIR,
    else `checkpoints` in the working directory."""
    return Path(configured or from_environment or DEFAULT_DIRECTORY).absolute()


# Files and manifests: plain Python, no process group.


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(directory: Path) -> list[dict[str, Any]]:
    """Every file of a checkpoint except its manifest, by name, with its size and sha256."""
    files = sorted(path for path in directory.iterdir() if path.is_file() and path.name != MANIFEST)
    return [{"path": path.name, "bytes": path.stat().st_size, "sha256": sha256_of(path)} for path in files]


def fsync_directory(directory: Path) -> None:
    """Makes renames and new entries in the directory survive a crash of the machine."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Adds the files' sizes and checksums to the manifest and writes it, durably, into the directory."""
    files = describe_files(directory)
    manifest = {**manifest, "files": files, "bytes": sum(entry["bytes"] for entry in files)}
    with (directory / MANIFEST).open("w") as file:
        json.dump(manifest, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    fsync_directory(directory)
    return manifest


def commit(temporary: Path, final: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Writes the manifest into the fully written temporary directory, then renames it to its final name.

    A committed checkpoint of the same step (a resumed run passing a step again) is replaced: it is
    renamed away first, so there is never a moment where a mix of the two looks committed."""
    manifest = write_manifest(temporary, manifest)
    replaced = final.with_name(f"{temporary.name}.replaced") if final.exists() else None
    if replaced is not None:
        os.rename(final, replaced)
    os.rename(temporary, final)
    fsync_directory(final.parent)
    if replaced is not None:
        logger.info("replaced the older checkpoint %s", final)
        shutil.rmtree(replaced)
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointCorrupt(f"{directory.name}/{MANIFEST}: missing, so the checkpoint was never committed")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointCorrupt(f"{directory.name}/{MANIFEST}: unreadable ({error})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise CheckpointCorrupt(f"{directory.name}/{MANIFEST}: has no list of files")
    return manifest


def file_problem(directory: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with one file the manifest lists, or None when it is as committed."""
    path = directory / entry["path"]
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"size {size} bytes, the manifest says {entry['bytes']}"
    if sha256_of(path) != entry["sha256"]:
        return "sha256 mismatch"
    return None


def problems_in(directory: Path, entries: list[dict[str, Any]]) -> list[str]:
    return [
        f"{directory.name}/{entry['path']}: {problem}"
        for entry in entries
        if (problem := file_problem(directory, entry)) is not None
    ]


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint whose every file checks out; CheckpointCorrupt names the first that does not."""
    manifest = read_manifest(directory)
    problems = problems_in(directory, manifest["files"])
    if problems:
        raise CheckpointCorrupt(problems[0])
    return manifest


def committed_checkpoints(root: Path) -> list[Path]:
    """Directories that look committed (final name, manifest present), oldest step first.
    Whether their files still check out is for verify() to say."""
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if step_of(path) is not None and (path / MANIFEST).is_file()]
    return sorted(found, key=step_of)


def written_by(path: Path, run_id: str | None, attempt: int | None) -> bool:
    """Whether the committed checkpoint at `path` is one that this run's attempt wrote: a directory of its own
    (not a link to one elsewhere) whose manifest names the same run and attempt. Without the platform both are
    null, so the trainer run by hand retires what earlier runs by hand left in its directory."""
    if path.is_symlink():
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and (manifest.get("run_id"), manifest.get("attempt")) == (run_id, attempt)


def holds_checkpoints(path: Path) -> bool:
    """Whether `resume` names a directory of checkpoints rather than one checkpoint: a directory that is
    not itself a checkpoint (no manifest, no step-NNNNNN name) is searched like "latest" searches its own."""
    return path.is_dir() and not (path / MANIFEST).is_file() and step_of(path) is None


def latest_good(
    root: Path,
    check: Callable[[Path], dict[str, Any]],
    on_corrupt: Callable[[Path, CheckpointCorrupt], None],
) -> tuple[Path, dict[str, Any]] | None:
    """The newest committed checkpoint that `check` accepts, with its manifest; corrupt ones are
    reported to on_corrupt and skipped. None when no committed checkpoint checks out."""
    for path in reversed(committed_checkpoints(root)):
        try:
            return path, check(path)
        except CheckpointCorrupt as error:
            on_corrupt(path, error)
    return None


def steps_to_delete(
    steps: list[int], committed_step: int, keep_last: int, keep_every: int, pinned: frozenset[int] = frozenset()
) -> list[int]:
    """Retention once committed_step is committed: the newest keep_last steps stay, every multiple of
    keep_every (0: none), and every pinned step. Steps past committed_step go, pinned or not: a run resumed
    from an earlier checkpoint left their branch behind, and "latest" must not lead back to it."""
    lineage = sorted(step for step in steps if step <= committed_step)
    newest = set(lineage[-keep_last:])
    milestones = {step for step in lineage if keep_every and step % keep_every == 0}
    return sorted(set(steps) - newest - milestones - (set(pinned) & set(lineage)))


AWAITING_JUDGEMENT = "the platform's alerts have judged steps only to"
# How long the end of training waits for the platform to judge its last steps, so that retention can delete what
# it held for them; past it, those checkpoints stay on disk (the run is over either way).
FINAL_JUDGEMENT_WAIT_S = 30.0
JUDGEMENT_POLL_S = 0.5


def pinned_among(candidates: dict[int, Path], ask: Callable[[], Pins], steps: list[int]) -> dict[int, str]:
    """Which of the checkpoints retention would delete (by step) are pinned, with why, given `ask` for the
    platform's pins (TelemetryClient.pinned_checkpoints) and every committed step. When the platform cannot say,
    any of them might be pinned: all are kept until it can. A checkpoint is also kept while the platform's alerts
    have not judged every step up to the next checkpoint: an alert at one of those steps would pin it."""
    if not candidates:
        return {}
    try:
        pins = ask()
    except PlatformUnreachable as error:
        return dict.fromkeys(candidates, f"the platform could not say whether it is pinned ({error})")
    kept = {step: "; ".join(pins.paths[str(path)]) for step, path in candidates.items() if str(path) in pins.paths}
    if pins.judged_through is not None:
        for step in candidates.keys() - kept.keys():
            following = min((later for later in steps if later > step), default=None)
            if following is not None and following > pins.judged_through:
                kept[step] = (
                    f"{AWAITING_JUDGEMENT} {pins.judged_through}; one at steps {step + 1}–{following} would restore "
                    "from it"
                )
    return kept


# Model and optimizer state under full parameter names.

# training_state() holds a rank's stages in an nn.ModuleList, which numbers them (0., 1., …); the
# names in a checkpoint must not depend on how a layout spreads stages over ranks, so the number is
# taken off. Flattened optimizer keys carry it after their section: state.0.blocks.3.….exp_avg.
STAGE_NUMBER = re.compile(r"^((?:state|param_groups)\.)?\d+\.")
# One entry per parameter instead of per param group, so a rank holding other stages finds its own.
FLATTENED = StateDictOptions(flatten_optimizer_state_dict=True)
# With tied embeddings the output layer's matrix is the embedding's: one parameter under both names, or, across
# pipeline stages, the last stage's copy of it (parallel/tied.py), whose optimizer state is a copy too. A checkpoint
# holds it once, under the embedding's name, so it resumes into one stage or several alike.
TIED_OUTPUT = re.compile(r"^((?:state|param_groups)\.)?output\.weight(\.|$)")


def without_stage_number(key: str) -> str:
    return STAGE_NUMBER.sub(r"\1", key, count=1)


def full_name(key: str, tied: bool) -> str:
    """A holder's key as the checkpoint names it."""
    name = without_stage_number(key)
    return TIED_OUTPUT.sub(r"\1embedding.weight\2", name, count=1) if tied else name


class FullNameState:
    """A Stateful view DCP saves and loads: keys renamed to full parameter names on the way out and
    back to this rank's holder on the way in. With tied embeddings two of the holder's keys may take one name
    (TIED_OUTPUT): both are loaded from it."""

    def __init__(
        self,
        holder: nn.Module,
        get: Callable[[], dict[str, Any]],
        put: Callable[[dict[str, Any]], Any],
        tied: bool,
    ):
        self.holder = holder
        self._get = get
        self._put = put
        self._tied = tied
        self._holder_keys: dict[str, list[str]] = {}

    def state_dict(self) -> dict[str, Any]:
        reshard(self.holder)
        named: dict[str, Any] = {}
        self._holder_keys = {}
        for key, value in self._get().items():
            name = full_name(key, self._tied)
            self._holder_keys.setdefault(name, []).append(key)
            named[name] = value
        return named

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        reshard(self.holder)
        local = {}
        for name, value in state_dict.items():
            first, *others = self._holder_keys[name]
            local[first] = value
            # Each copy keeps tensors of its own: an optimizer state two parameters shared would be stepped twice.
            local.update({key: value.clone() if torch.is_tensor(value) else value for key in others})
        self._put(local)


def training_state(modules: list[nn.Module], optimizer: torch.optim.Optimizer, tied: bool) -> dict[str, FullNameState]:
    """What DCP saves and loads: this rank's stages and the one optimizer over all of them; `tied`: whether the
    model ties its embeddings."""
    holder = nn.ModuleList(modules)
    return {
        "model": FullNameState(
            holder,
            lambda: get_model_state_dict(holder),
            lambda state: set_model_state_dict(holder, state),
            tied,
        ),
        "optimizer": FullNameState(
            holder,
            lambda: get_optimizer_state_dict(holder, optimizer, options=FLATTENED),
            lambda state: set_optimizer_state_dict(holder, optimizer, state, options=FLATTENED),
            tied,
        ),
    }


def reshard(holder: nn.Module) -> None:
    """FSDP2 can leave a root's parameters gathered (after a forward without grad); state dicts need shards."""
    for module in holder.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# Random-number generators. Every rank seeds them alike and draws the same numbers (batches come
# from their own generator), so rank 0's states stand for all ranks.


def rng_states(device: torch.device) -> dict[str, str | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"cpu": _encode(torch.get_rng_state()), "cuda": _encode(cuda) if cuda is not None else None}


def restore_rng_states(states: dict[str, str | None], device: torch.device) -> None:
    torch.set_rng_state(_decode(states["cpu"]))
    if device.type == "cuda" and states.get("cuda") is not None:
        torch.cuda.set_rng_state(_decode(states["cuda"]), device)


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# Saving, committing and loading across ranks.


@dataclass(frozen=True)
class Restored:
    path: Path
    step: int
    manifest: dict[str, Any]


@dataclass
class PendingSave:
    step: int
    temporary: Path
    final: Path
    manifest: dict[str, Any]
    started: float
    # DCP's future: done on a rank once every rank's files are written (its finish step gathers them all).
    upload: Future
    # Done once this rank's state is copied to host memory: from then on training may change it.
    staged: Future
    stall_s: float = 0.0
    # Set once stall_s is final: the copy is done and whatever training waited for it is counted.
    stall_known: threading.Event = field(default_factory=threading.Event)
    # Rank 0 only: the manifest written and the directory renamed.
    committed: Future | None = None


class Checkpointer:
    """Saves, commits, retires and restores this run's checkpoints. Create, restore, save, finish and
    close on every rank, in the same order: they are collective."""

    def __init__(
        self,
        config: RunConfig,
        modules: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        telemetry: TelemetryClient,
        device: torch.device,
        root: Path,
        run_id: str | None,
        attempt: int | None,
    ):
        self.config = config
        self.settings = config.checkpoint
        self.optimizer = optimizer
        self.telemetry = telemetry
        self.device = device
        self.root = root
        self.run_id = run_id
        self.attempt = attempt
        self.state = training_state(modules, optimizer, config.model.tie_embeddings)
        # Background saves run their collectives on a group of their own, so they never interleave
        # with the training step's collectives; gloo, because async saves need a CPU group.
        self.group = dist.new_group(backend="gloo")
        self.is_committer = dist.get_rank() == 0
        # The newest step this process committed (rank 0 only): retention runs only after a commit of its own.
        self.committed_step: int | None = None
        self.nonce = self._shared_nonce()
        cuda = device.type == "cuda"
        # Staged copies are cached and reused by the next save, which waits for this one first. The copy
        # runs in the background too, beside the next step's forward and backward, which read the
        # parameters but do not change them; the optimizer step waits for it (before_update).
        staging = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
        self.stager = DefaultStager(staging) if self.settings.async_save else None
        self.committer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit") if self.is_committer else None
        self.pending: PendingSave | None = None
        self.parent: Path | None = None
        self.last_saved_step: int | None = None
        self.last_save_time = time.monotonic()
        # Why retention last kept each pinned checkpoint it would have deleted, as reported.
        self._kept_reasons: dict[int, str] = {}
        # The data sampler's position before a step's batch, for the manifest; the trainer sets its sampler's.
        self.data_position: Callable[[int], dict[str, Any]] = lambda next_step: {}

    def _shared_nonce(self) -> str:
        """Names this attempt's temporary directories; rank 0 draws it so every rank writes to the same one."""
        attempt = f"a{self.attempt}" if self.attempt is not None else "local"
        nonce = [f"{attempt}-{secrets.token_hex(4)}"]
        dist.broadcast_object_list(nonce, src=0, group=self.group)
        return nonce[0]

    # Restoring.

    def restore(self) -> Restored | None:
        """Loads the checkpoint `resume` names into the model, optimizer and RNGs; None to start fresh, from the
        weights init_from names when it is set."""
        resume = self.settings.resume
        if resume is None:
            self._load_initial_weights()
            return None
        if resume == "latest":
            chosen = latest_good(self.root, self.verify, self._report_corrupt)
            if chosen is None:
                if self.is_committer:
                    logger.info("no committed checkpoint in %s; starting from step 1", self.root)
                self._load_initial_weights()
                return None
            path, manifest = chosen
        else:
            path, manifest = self._named_checkpoint(Path(resume).absolute())
        self._check_model(path, manifest)
        if manifest.get("rng") is None:
            raise CheckpointError(
                f"{path.name}: holds model weights only (an import, no optimizer or RNG state), so it cannot be "
                "resumed; start from it with checkpoint.init_from"
            )
        started = time.perf_counter()
        dcp.load(self.state, checkpoint_id=path, process_group=self.group)
        restore_rng_states(manifest["rng"], self.device)
        restored = Restored(path, manifest["step"], manifest)
        self.parent = path
        self.last_saved_step = restored.step
        self._report_restored(restored, time.perf_counter() - started)
        return restored

    def _named_checkpoint(self, path: Path) -> tuple[Path, dict[str, Any]]:
        """The checkpoint a path names, verified: itself, or the newest good one in a directory of them."""
        if holds_checkpoints(path):
            return self._newest_good_in(path)
        return path, self.verify(path)

    def _load_initial_weights(self) -> None:
        """checkpoint.init_from: only the model weights of a committed checkpoint (an import, or another run's
        in any layout); the optimizer, the RNGs and the step start fresh."""
        if self.settings.init_from is None:
            return
        path, manifest = self._named_checkpoint(Path(self.settings.init_from).absolute())
        # The weights do not depend on the sequence length: a model imported at one trains at another.
        self._check_model(path, manifest, ignored=frozenset({"seq_len"}), use="start from it")
        started = time.perf_counter()
        dcp.load({"model": self.state["model"]}, checkpoint_id=path, process_group=self.group)
        # The run's first checkpoint descends from the weights it started from: the lineage's root.
        self.parent = path
        self._report_restored(Restored(path, manifest["step"], manifest), time.perf_counter() - started, initial=True)

    def _newest_good_in(self, directory: Path) -> tuple[Path, dict[str, Any]]:
        """Like "latest", in a directory named explicitly; whoever names one expects a checkpoint there,
        so finding none that verifies is an error, not a fresh start."""
        problems: list[CheckpointCorrupt] = []

        def on_corrupt(path: Path, error: CheckpointCorrupt) -> None:
            problems.append(error)
            self._report_corrupt(path, error)

        chosen = latest_good(directory, self.verify, on_corrupt)
        if chosen is not None:
            return chosen
        if not problems:
            raise CheckpointError(
                f"{directory}: neither a committed checkpoint (no {MANIFEST}) nor a directory of them "
                f"(no step-NNNNNN directory with a {MANIFEST})"
            )
        raise CheckpointError(
            f"{directory}: no committed checkpoint there verifies ({len(problems)} checked); the newest: {problems[0]}"
        )

    def verify(self, path: Path) -> dict[str, Any]:
        """verify(), with the hashing split over the ranks; every rank gets the same answer."""
        rank, world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        manifest: dict[str, Any] = {}
        try:
            manifest = read_manifest(path)
            my_share = manifest["files"][rank::world_size]
            problems = [(CheckpointCorrupt, problem) for problem in problems_in(path, my_share)]
        except CheckpointError as error:
            problems = [(type(error), str(error))]
        gathered: list[list[tuple[type[CheckpointError], str]] | None] = [None] * world_size
        dist.all_gather_object(gathered, problems, group=self.group)
        for error_type, message in (problem for rank_problems in gathered for problem in rank_problems):
            raise error_type(message)
        return manifest

    def _check_model(
        self, path: Path, manifest: dict[str, Any], ignored: frozenset[str] = frozenset(), use: str = "resume"
    ) -> None:
        # A model field added after the checkpoint was written (rope_theta) is missing from its
        # manifest; the field's default is what every model was built with before it existed.
        saved = {**ModelConfig().model_dump(), **(manifest.get("model") or {})}
        wanted = self.config.model.model_dump()
        differing = [
            f"model.{key}={saved.get(key)!r}" for key in wanted if key not in ignored and saved.get(key) != wanted[key]
        ]
        if differing:
            raise CheckpointError(
                f"{path.name}: saved for another model ({', '.join(differing)}); {use} with that model section"
            )

    def _report_corrupt(self, path: Path, error: CheckpointCorrupt) -> None:
        if self.is_committer:
            logger.warning("checkpoint %s is corrupt (%s); falling back to the one before it", path.name, error)
            self.telemetry.emit(
                "checkpoint", {"state": "corrupt", "step": step_of(path), "path": str(path), "error": str(error)}
            )

    def _report_restored(self, restored: Restored, load_s: float, initial: bool = False) -> None:
        """initial: only its weights were loaded (init_from), so its step is not this run's and the event
        carries none of this run's steps."""
        if self.is_committer:
            manifest = restored.manifest
            logger.info(
                "%s %s (step %d, saved by %d ranks) in %.2f s",
                "took the initial weights from" if initial else "resumed from",
                restored.path,
                restored.step,
                manifest["world_size"],
                load_s,
            )
            payload = {
                "state": "loaded",
                "step": restored.step,
                "path": str(restored.path),
                "layout": manifest["layout"],
                "world_size": manifest["world_size"],
                "load_s": load_s,
            }
            if initial:
                payload["initial"] = True
            self.telemetry.emit("checkpoint", payload, step=None if initial else restored.step)

    # Saving.

    def due(self, step: int) -> bool:
        """Whether the step count says to save after this step."""
        interval = self.settings.interval_steps
        return interval > 0 and step % interval == 0

    def due_by_time(self) -> bool:
        """This rank's clock says a save is due; ranks vote, so they all save after the same step."""
        minutes = self.settings.interval_minutes
        return minutes > 0 and time.monotonic() - self.last_save_time >= minutes * 60

    def save(self, step: int, loss: float) -> None:
        """Saves the state after `step`. Training is blocked (stall_s) while the previous save finishes, the
        state dicts are gathered, and then, with async_save, only where the next optimizer step has to
        wait for the copy to host memory (pinned on CUDA) to end; with async_save off, for the whole
        write. Rank 0 hashes, commits and retires old checkpoints in the background either way."""
        started = time.perf_counter()
        self.wait()
        temporary = self.root / f"{checkpoint_name(step)}.tmp-{self.nonce}"
        manifest = self._manifest(step, loss)
        writer = dcp.FileSystemWriter(temporary)
        staged: Future = Future()
        if self.stager is not None:
            response = dcp.async_save(
                self.state, storage_writer=writer, process_group=self.group, async_stager=self.stager
            )
            upload, staged = response.upload_completion, response.staging_completion
        else:
            upload = Future()
            upload.set_result(dcp.save(self.state, storage_writer=writer, process_group=self.group))
            staged.set_result(None)
        pending = PendingSave(step, temporary, self.root / checkpoint_name(step), manifest, started, upload, staged)
        pending.stall_s = time.perf_counter() - started
        if staged.done():
            pending.stall_known.set()
        if self.committer is not None:
            pending.committed = self.committer.submit(self._commit, pending)
        self.pending = pending
        self.last_saved_step = step
        self.last_save_time = time.monotonic()

    def finish(self, last_step: int, loss: float | None) -> None:
        """Saves the last completed step unless it is saved already (a stopped or finished run), then
        waits for every save to be committed."""
        if self.settings.saves and loss is not None and self.last_saved_step != last_step:
            self.save(last_step, loss)
        self.wait()
        if self.committed_step is not None:
            self._settle_retention(self.committed_step)

    def _settle_retention(self, committed_step: int) -> None:
        """Retention once more as the platform judges the last steps: a checkpoint held until then goes (or is
        pinned by an alert) instead of outliving keep_last because the run ended first."""
        deadline = time.monotonic() + FINAL_JUDGEMENT_WAIT_S
        while self._retire_old(committed_step) and time.monotonic() < deadline:
            time.sleep(JUDGEMENT_POLL_S)

    def before_update(self) -> None:
        """Call before the optimizer changes the state: waits for the pending save's copy to host memory,
        counting the wait as stall."""
        pending = self.pending
        if pending is None or pending.stall_known.is_set():
            return
        started = time.perf_counter()
        try:
            pending.staged.result()
        except Exception as error:  # the upload fails with it and is reported by wait()
            logger.error("staging the checkpoint of step %d failed: %s", pending.step, error)
        pending.stall_s += time.perf_counter() - started
        pending.stall_known.set()

    def wait(self) -> None:
        """Blocks until the pending save is written by every rank and, on rank 0, committed.
        A failed save is reported and training goes on; the next save tries again."""
        self.before_update()
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            (pending.committed or pending.upload).result()
        except Exception as error:
            logger.error("checkpoint of step %d failed: %s", pending.step, error)
            if self.is_committer:
                payload = {"state": "failed", "step": pending.step, "path": str(pending.temporary), "error": str(error)}
                self.telemetry.emit("checkpoint", payload, step=pending.step)

    def wait_for_writes(self) -> None:
        """Blocks until every rank has written the pending save (not until rank 0 has committed it)."""
        if self.pending is not None:
            try:
                self.pending.upload.result()
            except Exception as error:
                logger.error("checkpoint of step %d failed: %s", self.pending.step, error)

    def salvage(self, timeout_s: float) -> None:
        """After the training loop failed: a save that every rank had finished writing is still committed
        and reported by rank 0, so a restart finds it; one still being written cannot finish and is left
        as its temporary directory."""
        self.before_update()
        pending, self.pending = self.pending, None
        if pending is None or pending.committed is None:
            return
        try:
            pending.committed.result(timeout=timeout_s)
        except Exception as error:  # a peer gone mid-write, or the timeout
            logger.warning("checkpoint of step %d left uncommitted after the failure: %r", pending.step, error)

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
        if self.committer is not None:
            self.committer.shutdown()

    def _manifest(self, step: int, loss: float) -> dict[str, Any]:
        optimizer = self.config.optimizer
        return {
            "format": MANIFEST_FORMAT,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "step": step,
            "created_at": datetime.now(UTC).isoformat(),
            "layout": self.config.parallel.model_dump(),
            "world_size": self.config.parallel.world_size,
            "model": self.config.model.model_dump(),
            "parent": str(self.parent) if self.parent is not None else None,
            # Batches are a pure function of (seed, step); the sampler adds the dataset it reads and where its
            # stream stands (epoch, sequence_offset), so a resume continues exactly there, on the same data.
            "data": {"next_step": step + 1, "seed": self.config.data.seed, **self.data_position(step + 1)},
            "rng": rng_states(self.device),
            # Likewise the learning rate: warmup then cosine over total_steps, evaluated at each step.
            "lr_schedule": {
                "step": step,
                "lr": self.optimizer.param_groups[0]["lr"],
                "total_steps": self.config.steps,
                "peak_lr": optimizer.lr,
                "warmup_steps": optimizer.warmup_steps,
                "min_lr_ratio": optimizer.min_lr_ratio,
            },
            "loss": loss,
        }

    def _commit(self, pending: PendingSave) -> None:
        """Rank 0, in the background: once every rank has written, seal the checkpoint and retire old ones."""
        pending.upload.result()
        manifest = commit(pending.temporary, pending.final, pending.manifest)
        # The stall is final once training has passed its next optimizer step (or stopped).
        pending.stall_known.wait(timeout=STALL_KNOWN_TIMEOUT_S)
        save_s = time.perf_counter() - pending.started
        self.parent = pending.final
        logger.info(
            "checkpoint %s committed: %.1f MB, training blocked %.3f s of %.3f s",
            pending.final,
            manifest["bytes"] / 1e6,
            pending.stall_s,
            save_s,
        )
        payload = {
            "state": "committed",
            "step": pending.step,
            "path": str(pending.final),
            "bytes": manifest["bytes"],
            "layout": manifest["layout"],
            "world_size": manifest["world_size"],
            "parent": manifest["parent"],
            "stall_s": pending.stall_s,
            "save_s": save_s,
            "loss": manifest["loss"],
        }
        self.telemetry.emit("checkpoint", payload, step=pending.step)
        faults.corrupt_checkpoint(self.config.faults, pending.step, pending.final)
        self.committed_step = pending.step
        self._retire_old(pending.step)

    def _retire_old(self, committed_step: int) -> bool:
        """Delete what retention lets go once committed_step is committed; True when a checkpoint is held only
        until the platform's alerts have judged the steps after it. Only checkpoints this attempt wrote count:
        one it resumed from, or another run's in the same directory, is never deleted (nor counted)."""
        by_step = {
            step_of(path): path
            for path in committed_checkpoints(self.root)
            if written_by(path, self.run_id, self.attempt)
        }
        settings = self.settings
        due = steps_to_delete(list(by_step), committed_step, settings.keep_last, settings.keep_every)
        candidates = {step: by_step[step] for step in due if step <= committed_step}
        kept = pinned_among(candidates, self.telemetry.pinned_checkpoints, list(by_step))
        for step, why in kept.items():
            self._report_kept(step, by_step[step], why)
        pinned = frozenset(kept)
        for step in steps_to_delete(list(by_step), committed_step, settings.keep_last, settings.keep_every, pinned):
            path = by_step[step]
            # Renamed first: a directory half deleted must not keep its committed name.
            doomed = path.with_name(f"{path.name}.deleting-{self.nonce}")
            os.rename(path, doomed)
            shutil.rmtree(doomed)
            reason = (
                f"after step {committed_step}, on a branch left behind"
                if step > committed_step
                else f"keep_last {settings.keep_last}, keep_every {settings.keep_every}"
            )
            logger.info("deleted checkpoint %s (%s)", path, reason)
            self.telemetry.emit("checkpoint", {"state": "deleted", "step": step, "path": str(path)}, step=step)
        return any(why.startswith(AWAITING_JUDGEMENT) for why in kept.values())

    def _report_kept(self, step: int, path: Path, why: str) -> None:
        """Once per checkpoint and reason: every later retention pass keeps it for the same reason."""
        if self._kept_reasons.get(step) == why:
            return
        self._kept_reasons[step] = why
        logger.info("kept checkpoint %s past keep_last %d: %s", path, self.settings.keep_last, why)
        payload = {"state": "kept", "step": step, "path": str(path), "reason": why}
        self.telemetry.emit("checkpoint", payload, step=step)
