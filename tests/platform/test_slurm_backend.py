"""The Slurm backend: its parsing of Slurm 22.05's plain output (captured from the real cluster the tests start)
and its mapping of job states, then real jobs on that cluster (tests/slurm_cluster.py): a 2-node x 2-rank
trainer run, a job held back for resources, an excluded node, a cancel that leaves nothing behind, and a rank
that fails on one node."""

import copy
import json
import re

import pytest

from loom.runs.backends import ENDED, PENDING, RUNNING, UNKNOWN, LaunchSpec, NodeInfo, Observation
from loom.runs.backends.slurm import (
    SlurmBackend,
    batch_script,
    decode_wait_status,
    expand_nodelist,
    gpus_in,
    node_script,
    observation_of,
    parse_scontrol_job,
    parse_sinfo_nodes,
    parse_squeue,
    rendezvous_port,
)
from loom.runs.failures import classify
from loom.runs.logs import node_logs, rank_log_files
from trainer.telemetry import read_spool

from ..conftest import wait_for
from .helpers import TINY_CONFIG

# `squeue -h --states=all -O JobID:|,State:|,Reason:|,NodeList:|,exit_code:|` on the test cluster: an exit 3,
# jobs waiting, a running one, a 2x2 trainer run whose rank failed (srun's 143 as the raw status 143 << 8),
# a job whose node's link was cut, and one ending on that node failure.
SQUEUE = """5|CANCELLED|Priority||0|
2|FAILED|NonZeroExitCode|n3|768|
3|PENDING|Resources||0|
4|PENDING|Priority||0|
6|PENDING|DependencyNeverSatisfied||0|
1|RUNNING|None|n[1-2]|0|
8|COMPLETED|None|n[1-2]|0|
9|FAILED|NonZeroExitCode|n[1-2]|36608|
10|COMPLETING|NodeDown|n1|15|
11|NODE_FAIL|NodeDown|n[1,3]|15|
"""
# `scontrol show job -o 11` once squeue had it as NODE_FAIL (cut to the fields that matter, in Slurm's order).
SCONTROL_NODE_FAIL = (
    "JobId=11 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901749 Nice=0 "
    "Account=(null) QOS=(null) JobState=NODE_FAIL Reason=NodeDown Dependency=(null) Requeue=0 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:00:36 TimeLimit=UNLIMITED TimeMin=N/A "
    "ReqNodeList=n[1,3] ExcNodeList=(null) NodeList=n[1,3] BatchHost=n1 NumNodes=2 NumCPUs=4 NumTasks=2"
)
SCONTROL_FAILED = (
    "JobId=9 JobName=loom-run3-attempt1 UserId=root(0) GroupId=root(0) JobState=FAILED Reason=NonZeroExitCode "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=143:0 RunTime=00:00:43 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-2] BatchHost=n1 NumNodes=2"
)
SCONTROL_PENDING = (
    "JobId=3 JobName=wrap UserId=root(0) JobState=PENDING Reason=Resources Dependency=(null) ExitCode=0:0 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=(null) NumNodes=3-3"
)
# `sinfo -h -N -o %N|%T|%c|%G|%E` with n3's link cut; the GPU lines are a GPU cluster's shapes.
SINFO = """n1|idle|2|(null)|none
n2|allocated|2|(null)|none
n3|down*|2|(null)|Not responding
gpu07|drained|64|gpu:a100:8(S:0-1)|Xid 79 GPU fallen off the bus
gpu08|mixed|64|gpu:4,shard:8|none
"""


def job(state, reason="None", nodes="", exit_code=0):
    return {"state": state, "reason": reason, "nodes": nodes, "exit_code": exit_code}


def test_squeue_lines_give_each_jobs_state_reason_nodes_and_exit_code():
    jobs = parse_squeue(SQUEUE)
    assert set(jobs) == {str(number) for number in range(1, 12)} - {"7"}
    assert jobs["2"] == job("FAILED", "NonZeroExitCode", "n3", 3)
    assert jobs["3"] == job("PENDING", "Resources")
    assert jobs["9"]["exit_code"] == 143
    assert jobs["11"] == job("NODE_FAIL", "NodeDown", "n[1,3]", -15)


def test_one_rule_says_which_nodes_a_launch_may_count_on():
    usable = ["idle", "mixed", "allocated", "completing", "planned"]
    unusable = ["down", "drained", "draining", "drain", "fail", "failing", "unknown", "inval", "idle+drain",
                "mixed+drain", "not_responding"]  # fmt: skip
    assert [state for state in usable + unusable if NodeInfo("n1", state, cpus=2, gpus=0).usable] == usable
    assert {node.name: node.usable for node in parse_sinfo_nodes(SINFO)} == {
        "n1": True, "n2": True, "n3": False, "gpu07": False, "gpu08": True
    }  # fmt: skip


def test_scontrol_gives_the_same_fields_as_squeue():
    assert parse_scontrol_job(SCONTROL_NODE_FAIL) == job("NODE_FAIL", "NodeDown", "n[1,3]", -15)
    assert parse_scontrol_job(SCONTROL_FAILED) == job("FAILED", "NonZeroExitCode", "n[1-2]", 143)
    assert parse_scontrol_job(SCONTROL_PENDING) == job("PENDING", "Resources", "", 0)


@pytest.mark.parametrize(
    "raw, code", [("0", 0), ("768", 3), ("36608", 143), ("15", -15), ("9", -9), ("", None), ("N/A", None)]
)
def test_the_raw_wait_status_is_an_exit_code_or_a_negative_signal(raw, code):
    assert decode_wait_status(raw) == code


@pytest.mark.parametrize(
    "nodelist, names",
    [
        ("n1", ("n1",)),
        ("n[1-2]", ("n1", "n2")),
        ("n[1,3]", ("n1", "n3")),
        ("gpu-[008-010],login1", ("gpu-008", "gpu-009", "gpu-010", "login1")),
        ("a[1-2,5],b[09-10]", ("a1", "a2", "a5", "b09", "b10")),
    ],
)
def test_nodelists_expand_in_slurms_order(nodelist, names):
    assert expand_nodelist(nodelist) == names


@pytest.mark.parametrize(
    "state, reason, pending_reason",
    [
        ("PENDING", "Resources", "Resources"),
        ("PENDING", "Priority", "Priority"),
        ("CONFIGURING", "None", ""),
        ("REQUEUE_HOLD", "JobHeldAdmin", "JobHeldAdmin"),
    ],
)
def test_a_job_waiting_for_its_nodes_is_pending_with_slurms_reason(state, reason, pending_reason):
    observation = observation_of("3", job(state, reason))
    assert (observation.state, observation.pending_reason, observation.nodes) == (PENDING, pending_reason, ())


@pytest.mark.parametrize("state", ["RUNNING", "COMPLETING", "SUSPENDED"])
def test_a_job_holding_its_nodes_is_running_on_them(state):
    observation = observation_of("1", job(state, nodes="n[1-2]"))
    assert (observation.state, observation.nodes, observation.backend_failure) == (RUNNING, ("n1", "n2"), None)


def test_a_job_the_program_ended_gives_its_exit_code_and_no_backend_failure():
    completed = observation_of("8", job("COMPLETED", nodes="n[1-2]"))
    failed = observation_of("9", parse_squeue(SQUEUE)["9"])
    assert (completed.state, completed.exit_code, completed.backend_failure) == (ENDED, 0, None)
    assert (failed.state, failed.exit_code, failed.backend_failure, failed.nodes) == (ENDED, 143, None, ("n1", "n2"))


@pytest.mark.parametrize(
    "state, kind, words",
    [
        ("CANCELLED", "cancelled", "cancelled job 4"),
        ("TIMEOUT", "timeout", "time limit"),
        ("DEADLINE", "timeout", "deadline"),
        ("OUT_OF_MEMORY", "out_of_memory", "out of memory"),
        ("PREEMPTED", "preempted", "preempted"),
        ("BOOT_FAIL", "node_failure", "failed to boot"),
        ("NODE_FAIL", "node_failure", "node failure"),
    ],
)
def test_an_end_that_was_slurms_doing_is_a_backend_failure(state, kind, words):
    observation = observation_of("4", job(state, "None", "n2", -15))
    assert observation.state == ENDED
    assert observation.backend_failure[0] == kind and words in observation.backend_failure[1]


def test_a_node_failure_names_the_node_slurm_holds_down():
    down = {node.name: f"{node.state}: {node.reason}" for node in parse_sinfo_nodes(SINFO) if node.reason}
    observation = observation_of("11", parse_squeue(SQUEUE)["11"], down)
    kind, reason = observation.backend_failure
    assert kind == "node_failure"
    assert reason.startswith("node n3 failed (down: Not responding)") and "n1" not in reason.split(":")[0]
    # When Slurm no longer holds any of them down, the reason says so instead of guessing.
    _, unnamed = observation_of("11", parse_squeue(SQUEUE)["11"], {}).backend_failure
    assert "no longer says which of n1, n3" in unnamed


def test_a_state_the_backend_does_not_know_decides_nothing():
    assert observation_of("1", job("SOMETHING_NEW")).state == UNKNOWN


def test_sinfo_lines_give_each_node_once_with_its_plain_state_cpus_and_gpus():
    assert parse_sinfo_nodes(SINFO + "n1|idle|2|(null)|none\n") == [
        NodeInfo("n1", "idle", 2, 0),
        NodeInfo("n2", "allocated", 2, 0),
        NodeInfo("n3", "down", 2, 0, "Not responding"),
        NodeInfo("gpu07", "drained", 64, 8, "Xid 79 GPU fallen off the bus"),
        NodeInfo("gpu08", "mixed", 64, 4),
    ]


@pytest.mark.parametrize("gres, gpus", [("(null)", 0), ("gpu:8", 8), ("gpu:a100:4(S:0-1),gpu:v100:2", 6)])
def test_gpus_are_counted_from_gres(gres, gpus):
    assert gpus_in(gres) == gpus


def spec_for(tmp_path, attempt_id=7, nodes=2, exclude=(), faults=None, steps=6):
    work_dir = tmp_path / f"attempt-{attempt_id}"
    work_dir.mkdir(parents=True)
    config = copy.deepcopy(TINY_CONFIG) | {"steps": steps, "parallel": {"dp_replicate": 2, "tp": 2}}
    if faults:
        config["faults"] = faults
    (work_dir / "config.json").write_text(json.dumps(config))
    return LaunchSpec(
        attempt_id=attempt_id,
        run_id=3,
        number=attempt_id,
        work_dir=work_dir,
        config_path=work_dir / "config.json",
        nodes=nodes,
        ranks_per_node=2,
        # No ingest URL: each rank keeps its telemetry in its spool, where the test reads it.
        env={"LOOM_URL": "", "LOOM_SPOOL_DIR": str(work_dir / "spool"), "PYTHONUNBUFFERED": "1"},
        exclude=exclude,
    )


def test_the_batch_script_asks_for_whole_nodes_without_requeue_and_runs_one_torchrun_per_node(tmp_path):
    spec = spec_for(tmp_path, attempt_id=12345, exclude=("n1", "n4"))
    script = batch_script(spec, partition="gpu", account="ml")
    for option in (
        "--job-name=loom-run3-attempt12345",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--no-requeue",
        "--open-mode=append",
        f"--output={spec.work_dir / 'logs' / 'batch.out'}",
        "--exclude=n1,n4",
        "--partition=gpu",
        "--account=ml",
    ):
        assert f"#SBATCH {option}\n" in script
    assert "--requeue" not in script.replace("--no-requeue", "")
    assert f"export LOOM_SPOOL_DIR={spec.work_dir / 'spool'}\n" in script
    assert "srun --kill-on-bad-exit=1" in script
    node = node_script(spec)
    assert f'--rdzv_endpoint="$LOOM_RENDEZVOUS_HOST:{rendezvous_port(12345)}"' in node
    assert '--node_rank="$SLURM_NODEID"' in node and "--nproc_per_node=2" in node and "--nnodes=2" in node
    assert node.index("--log-dir") < node.index("-m trainer.train")
    assert rendezvous_port(12345) != rendezvous_port(12346)


@pytest.fixture
def backend(settings, slurm_cluster):
    settings.LOOM_SLURM_CONF = str(slurm_cluster.conf)
    settings.LOOM_SLURM_PARTITION = settings.LOOM_SLURM_ACCOUNT = ""
    return SlurmBackend()


def wait_for_state(backend, handles, attempt_id, state, timeout=180):
    return wait_for(
        lambda: (observation := backend.observe(handles)[attempt_id]).state == state and observation,
        timeout=timeout,
        interval=0.5,
        message=f"attempt {attempt_id} to be {state}",
    )


def hosts_by_rank(work_dir):
    heartbeats = [
        (batch["rank"], event["payload"]["host"])
        for batch in read_spool(work_dir / "spool")
        for event in batch["events"]
        if event["kind"] == "heartbeat"
    ]
    return dict(sorted(set(heartbeats)))


@pytest.mark.slow
@pytest.mark.slurm
def test_a_two_node_run_ends_well_while_a_three_node_job_waits_for_resources(backend, slurm_cluster, tmp_path):
    # Long enough that the three-node job is seen waiting while this one holds two nodes.
    spec = spec_for(tmp_path, attempt_id=101, steps=20)
    handle = backend.submit(spec)
    handles = {101: handle}
    running = wait_for_state(backend, handles, 101, RUNNING)
    assert running.nodes == ("n1", "n2")

    big = backend.submit(spec_for(tmp_path, attempt_id=102, nodes=3))
    held = wait_for(
        lambda: (seen := backend.observe({102: big})[102]).pending_reason == "Resources" and seen,
        timeout=30,
        message="the three-node job to wait for resources",
    )
    assert held.state == PENDING and held.nodes == ()
    backend.cancel(big, grace_s=5)
    assert wait_for_state(backend, {102: big}, 102, ENDED).backend_failure[0] == "cancelled"

    ended = wait_for_state(backend, handles, 101, ENDED)
    assert (ended.exit_code, ended.backend_failure, ended.nodes) == (0, None, ("n1", "n2"))
    assert [(node.node, node.first_rank) for node in node_logs(spec.work_dir)] == [("n1", 0), ("n2", 2)]
    for rank, node in enumerate(["n1", "n1", "n2", "n2"]):
        files = rank_log_files(spec.work_dir, rank)
        assert files and all(path.relative_to(spec.work_dir / "logs").parts[0] == node for path in files)
        assert f"rank{rank} INFO" in "".join(path.read_text() for path in files)
    assert hosts_by_rank(spec.work_dir) == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
    # Asked again after the end (squeue keeps it for MinJobAge), the answer is the same.
    assert backend.observe(handles)[101] == ended


@pytest.mark.slow
@pytest.mark.slurm
def test_an_excluded_node_is_avoided_and_a_cancel_leaves_no_process_on_any_node(backend, slurm_cluster, tmp_path):
    spec = spec_for(tmp_path, attempt_id=201, exclude=("n1",), steps=100_000)
    handle = backend.submit(spec)
    assert wait_for_state(backend, {201: handle}, 201, RUNNING).nodes == ("n2", "n3")
    wait_for(lambda: len(hosts_by_rank(spec.work_dir)) == 4, timeout=180, message="every rank to start")
    assert slurm_cluster.processes_on("n2") and slurm_cluster.processes_on("n3")
    assert not slurm_cluster.processes_on("n1")

    backend.cancel(handle, grace_s=5)
    backend.cancel(handle, grace_s=5)
    ended = wait_for_state(backend, {201: handle}, 201, ENDED, timeout=30)
    assert ended.backend_failure[0] == "cancelled"
    wait_for(
        lambda: not any(slurm_cluster.processes_on(node) for node in slurm_cluster.nodes),
        timeout=30,
        message="every process of the cancelled job to be gone",
    )
    backend.cancel(handle, grace_s=5)
    assert backend.observe({201: handle})[201].state == ENDED


@pytest.mark.slow
@pytest.mark.slurm
def test_a_rank_failing_on_one_node_ends_the_job_on_both_and_its_logs_name_it(backend, slurm_cluster, tmp_path):
    spec = spec_for(tmp_path, attempt_id=301, faults={"crash_at_step": 2, "crash_rank": 3})
    handle = backend.submit(spec)
    ended = wait_for_state(backend, {301: handle}, 301, ENDED)
    assert ended.exit_code != 0 and ended.backend_failure is None and ended.nodes == ("n1", "n2")
    failure = classify(spec.work_dir)
    assert (failure.kind, failure.rank, failure.retryable) == ("exception", 3, False)
    assert "rank 3 failed first: InjectedFault" in failure.reason
    # srun stopped n1's torchrun too: nothing of the job is left on either node.
    wait_for(
        lambda: not any(slurm_cluster.processes_on(node) for node in slurm_cluster.nodes),
        timeout=30,
        message="every process of the failed job to be gone",
    )
    assert (spec.work_dir / "logs" / "n1" / "launcher.log").exists()


@pytest.mark.slurm
def test_nodes_lists_every_node_with_its_cpus(backend, slurm_cluster):
    nodes = {node.name: node for node in backend.nodes()}
    assert sorted(nodes) == ["n1", "n2", "n3"]
    assert all(node.cpus == 2 and node.gpus == 0 for node in nodes.values())
    assert all(node.state in ("idle", "allocated", "mixed", "completing") for node in nodes.values())


@pytest.mark.slurm
def test_a_job_slurm_never_knew_is_lost_and_a_controller_that_does_not_answer_decides_nothing(
    backend, settings, slurm_cluster, tmp_path
):
    lost = backend.observe({1: {"job_id": "987654"}})[1]
    assert (lost.state, lost.backend_failure) == (ENDED, ("lost", "Slurm no longer knows job 987654"))
    # The cluster's slurm.conf with the controller on a port nothing listens on (and a short message timeout,
    # so the clients give up at once): every attempt is unknown, none is taken for ended.
    conf = slurm_cluster.conf.read_text()
    down = re.sub(r"(?m)^SlurmctldPort=.*$", "SlurmctldPort=1", conf)
    down = re.sub(r"(?m)^MessageTimeout=.*$", "MessageTimeout=1", down)
    (tmp_path / "slurm.conf").write_text(down)
    settings.LOOM_SLURM_CONF = str(tmp_path / "slurm.conf")
    observations = backend.observe({1: {"job_id": "1"}, 2: {"job_id": "987654"}})
    assert observations == {1: Observation(UNKNOWN), 2: Observation(UNKNOWN)}


@pytest.mark.slow
@pytest.mark.slurm
def test_a_node_that_loses_its_link_ends_the_job_as_a_node_failure_naming_it(backend, slurm_cluster, tmp_path):
    spec = spec_for(tmp_path, attempt_id=401, exclude=("n1",), steps=100_000)
    handle = backend.submit(spec)
    assert wait_for_state(backend, {401: handle}, 401, RUNNING).nodes == ("n2", "n3")
    # The job runs once its batch script does, before srun has launched the step on n3: cut the link then and the
    # launch fails, which ends the job as the program's failure, not a node's.
    wait_for(lambda: len(hosts_by_rank(spec.work_dir)) == 4, timeout=180, message="every rank to start")
    slurm_cluster.link_down("n3")
    try:
        ended = wait_for_state(backend, {401: handle}, 401, ENDED)
    finally:
        slurm_cluster.link_up("n3")
    kind, reason = ended.backend_failure
    assert kind == "node_failure" and reason.startswith("node n3 failed (down") and "n2 failed" not in reason
    # Not requeued by Slurm behind loom's back: the job stays ended, and n3 comes back for the next tests.
    assert backend.observe({401: handle})[401].state == ENDED
    wait_for(lambda: slurm_cluster.node_states()["n3"] == "idle", timeout=180, message="n3 to be idle again")
