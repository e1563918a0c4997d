"""A rank that raises ends the whole torchrun job with that rank's error; a rank killed outright
ends it too, within a bound; nothing hangs, and `resume: latest` continues the same losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import env, metrics, train, write_config

pytestmark = pytest.mark.slow

#: Rank 1 raises in its first optimizer step while rank 0 waits in the same step's all-reduce.
FAILING_WORKER = textwrap.dedent("""
    import os, sys
    import posttune.training.trainer as trainer
    from posttune.training import worker

    step = trainer._optimizer_step

    def failing_step(session, window, log, *rest):
        if os.environ["RANK"] == "1":
            raise RuntimeError("boom on rank 1")
        return step(session, window, log, *rest)

    trainer._optimizer_step = failing_step
    sys.exit(worker.run(sys.argv[1:]))
""")


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    config = write_config(tmp_path, batch_size=4, parallel={"plans": ["fsdp2"]})
    script = tmp_path / "failing_worker.py"
    script.write_text(FAILING_WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(script), str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env())
    assert result.returncode != 0
    assert "boom on rank 1" in result.stderr


def test_posttune_train_reports_the_failing_rank_in_one_line(tmp_path):
    """A user error the workers find (row 3 lacks its field; validate reads only the first row) is one line on
    stderr: not once per rank, not torchrun's agent logs, not the traceback torch records with it."""
    config = write_config(tmp_path, batch_size=4, parallel={"plans": ["fsdp2"]})
    data = tmp_path / "train.jsonl"
    rows = data.read_text().splitlines()
    rows[3] = '{"messages": "not a list"}'
    data.write_text("\n".join(rows) + "\n")
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(config), "--nproc-per-node", "2",
               "--standalone"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env())
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert result.stderr.startswith("posttune: error: rank ") and " failed (exit code 2): data.train: row 3: " \
        in result.stderr, result.stderr



def test_the_reported_failure_is_a_rank_that_ended_on_its_own(tmp_path):
    """Both ranks hit the same bad row; under load torchrun can SIGTERM rank 0 after it recorded the error but
    before it exited, making rank 0's the earliest record with exit code -15. The rank that exited with its own
    code is the one reported; a signal is reported only when every rank died by one."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from posttune.cli.launch import first_failure

    def failure(rank, exitcode, timestamp=None):
        error_file = tmp_path / f"error-{rank}.json"
        if timestamp is not None:
            error_file.write_text(json.dumps({"message": {"message": "ConfigError: data.train: row 3",
                                                          "extraInfo": {"timestamp": timestamp}}}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))

    signalled_first = {0: failure(0, -15, timestamp=10), 1: failure(1, 2, timestamp=11)}
    assert first_failure(signalled_first)[0] == 1
    assert first_failure({0: failure(0, 2, timestamp=10), 1: failure(1, 2, timestamp=11)})[0] == 0
    killed = {0: failure(0, -15), 1: failure(1, -9)}
    rank, chosen = first_failure(killed)
    assert chosen.exitcode < 0 and rank in killed
    # rank 1 SIGKILLed (the OOM killer); rank 0's collective then failed on its own, only because rank 1 was gone
    lost = tmp_path / "error-lost.json"
    lost.write_text(json.dumps({"message": {"message": "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection "
                                                       "closed by peer [127.0.0.1]:46252. This is typically caused by "
                                                       "a remote worker crashing.", "extraInfo": {"timestamp": 10}}}))
    peer_lost = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(lost))
    assert first_failure({0: peer_lost, 1: failure(1, -9)})[0] == 1
    assert first_failure({0: peer_lost, 1: failure(1, 2, timestamp=11)})[0] == 1  # a real error wins too

def test_a_rank_0_stopped_in_setup_by_torchrun_leaves_the_failing_rank_as_the_one_line_and_run_json(
        tmp_path, monkeypatch, capsys):
    """torchrun stops the healthy ranks with SIGTERM once one fails: rank 0, still preparing, records "preempted" in
    run.json and its note in its error file, not on stderr. The job ends in rank 1's error, on stderr in one line
    and in run.json; a job that was only stopped prints rank 0's note and exits 143."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, get_error_handler

    from posttune.cli import launch
    from posttune.errors import PosttuneError
    from posttune.training import output_dir
    from posttune.training.preemption import PREEMPTED, StoppedInSetup

    out = tmp_path / "out"
    out.mkdir()

    def stopped_rank(rank):  # written as a worker writes it: training.run under the launcher
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error-{rank}.json"))
        get_error_handler().record_exception(StoppedInSetup())
        return ProcessFailure(local_rank=rank, pid=os.getpid() if rank == 0 else 101, exitcode=PREEMPTED,
                              error_file=str(tmp_path / f"error-{rank}.json"))

    def job(failures):
        def main(_argv):
            raise ChildFailedError("worker", failures)
        monkeypatch.setattr(torchrun, "main", main)
        monkeypatch.setattr(launch, "torchrun_args", lambda _args: [])
        return launch.run_torchrun(None, "posttune.training.worker", [], out)

    failed = tmp_path / "error-1.json"
    failed.write_text(json.dumps({"message": {"message": "ConfigError: data.train: row 3: no messages",
                                              "extraInfo": {"timestamp": 1}}}))
    output_dir.record_run(out, "run-1", None)  # this process stands for rank 0
    output_dir.record_status(out, "preempted", checkpoint=None)
    rank_0 = stopped_rank(0)
    with pytest.raises(PosttuneError) as raised:
        job({0: rank_0, 1: ProcessFailure(local_rank=1, pid=101, exitcode=2, error_file=str(failed))})
    assert str(raised.value) == "rank 1 failed (exit code 2): data.train: row 3: no messages"
    assert capsys.readouterr().err == ""
    record = json.loads((out / "run.json").read_text())
    assert (record["status"], record["error"]) == ("failed", str(raised.value))

    output_dir.record_status(out, "running")  # another run's folder (its pid not this job's): left as it is
    with pytest.raises(PosttuneError):
        job({0: ProcessFailure(local_rank=0, pid=100, exitcode=2, error_file=str(failed))})
    assert json.loads((out / "run.json").read_text())["status"] == "running"

    assert job({0: stopped_rank(0), 1: stopped_rank(1)}) == PREEMPTED
    assert capsys.readouterr().err == f"posttune: {StoppedInSetup()}\n"


#: Rank 1 dies by SIGKILL right after optimizer step 3 (a lost node, the OOM killer): no Python
#: error handler runs, so only torchrun's agent and the other rank's collectives notice.
KILLED_RANK_WORKER = textwrap.dedent("""
    import os, signal, sys
    import posttune.training.trainer as trainer
    from posttune.training import worker

    step = trainer._optimizer_step

    def step_then_die(session, window, log, *rest):
        tokens = step(session, window, log, *rest)
        if os.environ["RANK"] == "1" and session.step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return tokens

    trainer._optimizer_step = step_then_die
    sys.exit(worker.run(sys.argv[1:]))
""")
KILL_BOUND_S = 120  # torchrun's agent stops the surviving rank; a hang would run to the timeout


def ends_within_bound(tmp_path, worker: str, config, what: str) -> None:
    """torchrun runs ``worker`` (rank 1 fails at step 3) on ``config``: the job fails within ``KILL_BOUND_S``."""
    script = tmp_path / f"{what}_rank_worker.py"
    script.write_text(worker)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(script), str(config)]
    started = time.monotonic()
    ended = subprocess.run(command, capture_output=True, text=True, timeout=KILL_BOUND_S + 60, env=env())
    elapsed = time.monotonic() - started
    assert ended.returncode != 0
    assert elapsed < KILL_BOUND_S, f"the job took {elapsed:.0f} s to end after rank 1 {what}"


def test_a_rank_killed_by_sigkill_ends_the_job_and_resume_continues_the_losses(runs, tmp_path):
    straight = runs("fsdp2_saving", nproc=2, batch_size=4, parallel={"plans": ["fsdp2"]},
                    checkpoint={"save_every": 2})
    config = write_config(tmp_path / "killed", batch_size=4, parallel={"plans": ["fsdp2"]},
                          checkpoint={"save_every": 2})
    ends_within_bound(tmp_path, KILLED_RANK_WORKER, config, "died")
    out = tmp_path / "killed" / "out"
    assert [p.name for p in sorted((out / "checkpoints").glob("step-*"))] == ["step-00000002"]

    train(config, "checkpoint.resume=latest", nproc=2)
    assert [(r["step"], r["loss"]) for r in metrics(out)] == [(r["step"], r["loss"]) for r in metrics(straight)]


STALLED_RANK_WORKER = KILLED_RANK_WORKER.replace("os.kill(os.getpid(), signal.SIGKILL)",
                                                 "__import__('time').sleep(600)")


def test_a_stalled_rank_fails_the_job_after_parallel_timeout_s(tmp_path):
    """A rank stuck (a filesystem, a device) leaves the others waiting in a collective: torch's default waits 30
    minutes on gloo; parallel.timeout_s ends the job after that many seconds instead."""
    config = write_config(tmp_path / "stalled", batch_size=4, parallel={"plans": ["fsdp2"], "timeout_s": 5})
    ends_within_bound(tmp_path, STALLED_RANK_WORKER, config, "stalled")


@pytest.mark.extended
def test_sigterm_to_posttune_train_under_torchrun_saves_on_every_rank_and_resumes(tmp_path):
    """What SLURM does on preemption: SIGTERM to the launcher; torchrun forwards it to the workers,
    which agree on a step, write one checkpoint there and exit; the launcher exits with 143."""
    steps = 24
    straight = write_config(tmp_path / "straight", batch_size=4, parallel={"plans": ["fsdp2"]}, steps=steps)
    train(straight, nproc=2)
    config = write_config(tmp_path / "preempted", batch_size=4, parallel={"plans": ["fsdp2"]}, steps=steps)
    out = tmp_path / "preempted" / "out"
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(config), "--nproc-per-node", "2",
               "--standalone"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=KILL_BOUND_S)
    assert proc.returncode == 143, stderr[-3000:]
    logged = metrics(out)
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved == [f"step-{logged[-1]['step']:08d}"] and logged[-1]["step"] < steps, (saved, stderr[-2000:])

    train(config, "checkpoint.resume=latest", nproc=2)
    expected = metrics(tmp_path / "straight" / "out")
    assert [(r["step"], r["loss"]) for r in metrics(out)] == [(r["step"], r["loss"]) for r in expected]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its new parent reaps it


@pytest.mark.extended
def test_workers_whose_launcher_is_killed_stop_with_a_checkpoint_and_resume(tmp_path):
    """SIGKILL to `posttune train --nproc-per-node 2` (torchrun's agent runs in that process): no
    signal reaches the workers, so each notices its parent is gone, they agree on a step, save it
    and exit; resuming continues the same losses."""
    steps = 200
    config = write_config(tmp_path / "orphaned", batch_size=4, parallel={"plans": ["fsdp2"]}, steps=steps)
    out = tmp_path / "orphaned" / "out"
    log = (tmp_path / "launcher.log").open("w")
    command = [sys.executable, "-m", "posttune.cli.main", "train", str(config), "--nproc-per-node", "2",
               "--standalone"]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env())
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    workers = _children(proc.pid)
    assert len(workers) == 2, (workers, (tmp_path / "launcher.log").read_text()[-3000:])
    proc.kill()
    proc.wait()
    stopped_by = time.monotonic() + 60
    try:
        while time.monotonic() < stopped_by and any(_alive(pid) for pid in workers):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "the workers trained on after their launcher died"
    finally:
        for pid in filter(_alive, workers):  # a failing run must not leave them training
            os.kill(pid, signal.SIGKILL)
    logged = metrics(out)
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved == [f"step-{logged[-1]['step']:08d}"] and logged[-1]["step"] < steps, saved
    assert "the launcher (pid" in (tmp_path / "launcher.log").read_text()

    resumed = train(config, "checkpoint.resume=latest", f"train.max_steps={logged[-1]['step'] + 2}", nproc=2)
    assert f"resumed from step {logged[-1]['step']}" in resumed.stdout


#: Rank 1 works in a folder of its own: a relative output_dir is then another folder there, as a node-local disk
#: mounted at the same path on another node would be.
ELSEWHERE_WORKER = textwrap.dedent("""
    import os, sys
    from posttune.training import worker

    if os.environ["RANK"] == "1":
        os.makedirs("elsewhere", exist_ok=True)
        os.chdir("elsewhere")
    sys.exit(worker.run(sys.argv[1:]))
""")


def test_an_output_dir_that_is_not_one_folder_for_every_rank_is_refused_before_the_model(tmp_path):
    """Each rank writes its shards of a checkpoint into the directory rank 0 names: on node-local disks rank 0's
    checkpoints lacked rank 1's shards, passed their manifest (what rank 0 could see) and could not resume."""
    config = write_config(tmp_path, batch_size=4, parallel={"plans": ["fsdp2"]}, checkpoint={"save_every": 1})
    script = tmp_path / "elsewhere_worker.py"
    script.write_text(ELSEWHERE_WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(script), str(config), "checkpoint.output_dir=out"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env(), cwd=tmp_path)
    assert result.returncode != 0
    assert ("checkpoint.output_dir: out is not one folder for every rank: rank 1 (") in result.stderr, result.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()  # refused before training: nothing saved
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".posttune-probe-")]

