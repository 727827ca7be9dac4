"""slurm/train.sbatch: each node's launch.sh gets the GPUs SLURM allocated to that node, and srun's options.

The real batch script runs with bash, as sbatch runs it on the first node, under stand-ins on PATH:
`scontrol` names two hosts, and `srun` records its argv and environment, then plays two nodes by running
the command it was given twice, with SLURM_NODEID 0 and 1 and per-node GPU variables chosen by the test
(SRUN_NODES). SLURM_SUBMIT_DIR holds a stub `.venv/bin/activate` and a spy `launch.sh`; the last test puts
the real launch.sh there instead, with a stand-in `nvidia-smi` and torchrun/pre-flight spies.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run

SBATCH = REPO / "slurm" / "train.sbatch"
HOSTS = ["node-a", "node-b"]
GPU_VARS = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS")  # what slurmstepd sets for each step on each node
LIMIT = str(24 * 3600 - 600)  # the stand-in squeue's 24 h left, less the script's 10 minutes' margin

# Plays srun on two nodes: the step's GPU variables of the batch environment are dropped and replaced by the
# node's own, as slurmstepd sets them per node; the rest passes on (srun's --export=ALL), SLURM_JOB_GPUS
# (the first node's, set in the batch shell alone) included; the exit status is the worst of the nodes'.
SRUN = """\
import json, os, subprocess, sys
records = os.environ["RECORDS"]
json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, open(os.path.join(records, "srun.json"), "w"))
command = sys.argv[1 + next(i for i, a in enumerate(sys.argv[1:]) if not a.startswith("-")) :]
status = 0
for node_id, gpu_vars in enumerate(json.loads(os.environ["SRUN_NODES"])):
    env = {k: v for k, v in os.environ.items() if k not in %r}
    env.update(gpu_vars, SLURM_NODEID=str(node_id), SLURMD_NODENAME=%r[node_id])
    status = max(status, subprocess.call(command, env=env))
sys.exit(status)
"""

# Records what it was started with, one file per node (NODE_RANK), under the name given as first argument.
RECORD = """\
import json, os, sys
name = sys.argv[1] + "-" + os.environ.get("NODE_RANK", "none") + ".json"
json.dump({"argv": sys.argv[2:], "env": dict(os.environ), "cwd": os.getcwd()},
          open(os.path.join(os.environ["RECORDS"], name), "w"))
"""


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def cluster(tmp_path, monkeypatch) -> dict:
    """Stand-ins for scontrol and srun, a submit dir with a spy launch.sh, and the batch environment."""
    for key in list(os.environ):
        if key.startswith("SLURM") or key in (*GPU_VARS, "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK"):
            monkeypatch.delenv(key)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    records = tmp_path / "records"
    records.mkdir()
    nodelist = "node-[a-b]"
    hosts = "\\n".join(HOSTS)
    _script(
        bin_dir / "scontrol",
        f'#!/bin/sh\n[ "$1 $2 $3" = "show hostnames {nodelist}" ] || exit 1\nprintf "{hosts}\\n"\n',
    )
    _script(bin_dir / "srun", f"#!{sys.executable}\n" + SRUN % (GPU_VARS, HOSTS))
    _script(bin_dir / "squeue", '#!/bin/sh\n[ "$*" = "-h -j 4242 -o %L" ] && echo 1-00:00:00\n')  # a 24 h job
    record = _script(tmp_path / "record.py", RECORD)
    submit = tmp_path / "submit"
    (submit / ".venv" / "bin").mkdir(parents=True)
    (submit / ".venv" / "bin" / "activate").write_text('export STUB_VENV="$PWD"\n')
    _script(submit / "launch.sh", f'#!/bin/bash\nexec {sys.executable} {record} launch "$@"\n')
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORDS": str(records),
        "SLURM_SUBMIT_DIR": str(submit),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_PER_TASK": "16",
        # What SLURM sets in the batch step, i.e. on the first node: a step on another node that read these
        # from the batch shell instead of its own would get the first node's values.
        "SLURM_NODEID": "0",
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "SLURM_JOB_GPUS": "4,5,6,7",
    }
    return {"env": env, "records": records, "submit": submit, "tmp": tmp_path}


def sbatch(cluster: dict, nodes: list[dict[str, str]], *args: str, **env: str):
    """Run the batch script as sbatch would on the first node, from a directory other than the submit dir."""
    full_env = {**cluster["env"], "SRUN_NODES": json.dumps(nodes), **env}
    return run(["bash", str(SBATCH), *args], env=full_env, cwd=cluster["tmp"], timeout=60)


def recorded(cluster: dict, name: str) -> dict | None:
    path = cluster["records"] / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_each_node_launches_on_its_own_allocated_gpus(cluster):
    nodes = [{"CUDA_VISIBLE_DEVICES": "4,5,6,7", "SLURM_STEP_GPUS": "4,5,6,7"}, {"SLURM_STEP_GPUS": "0,2"}]
    ends = int(time.time()) + 4 * 3600  # sbatch --time=4:00:00, against the script's 24 h
    result = sbatch(cluster, nodes, "--data-dir", "/data/my set", "--epochs", "3", SLURM_JOB_END_TIME=str(ends))
    assert result.returncode == 0, result.stderr

    srun = recorded(cluster, "srun")
    options = srun["argv"][: srun["argv"].index("bash")]
    assert "--cpus-per-task=16" in options, "steps no longer inherit the batch's --cpus-per-task (SLURM >= 22.05)"
    assert "--ntasks-per-node=1" in options and "--kill-on-bad-exit=1" in options
    assert srun["env"]["MASTER_ADDR"] == "node-a" and srun["env"]["MASTER_PORT"] == str(15000 + 4242)

    extra = ["--data-dir", "/data/my set", "--epochs", "3"]
    limits = set()
    for rank, gpus in [(0, "4,5,6,7"), (1, "0,2")]:
        launch = recorded(cluster, f"launch-{rank}")
        assert launch is not None, f"node {rank} did not start launch.sh: {result.stderr}"
        argv = launch["argv"]
        assert argv[:4] == [gpus, "--out-dir", "runs/unet3d", "--time-limit"] and argv[5:] == extra, argv
        assert 4 * 3600 - 600 - 30 <= int(argv[4]) <= 4 * 3600 - 600, "the job's own limit less 10 minutes"
        limits.add(argv[4])
        env = launch["env"]
        assert (env["NODE_RANK"], env["NNODES"], env["MASTER_ADDR"]) == (str(rank), "2", "node-a")
        assert (env["MASTER_PORT"], env["RDZV_ID"]) == (str(15000 + 4242), "4242")
        assert launch["cwd"] == str(cluster["submit"]) and env["STUB_VENV"] == str(cluster["submit"])
    assert sorted(p.name for p in cluster["records"].iterdir()) == ["launch-0.json", "launch-1.json", "srun.json"]
    assert len(limits) == 1, "read once, on the first node: every node trains to the same limit"


@pytest.mark.parametrize(
    ("left", "expected"),
    [("1-02:03:04", 93784 - 600), ("23:59:00", 86340 - 600), ("59:30", 3570 - 600), ("UNLIMITED", None), ("", None)],
)
def test_without_an_end_time_the_limit_is_what_squeue_says_is_left(cluster, left, expected):
    """Before SLURM 23.02 (no SLURM_JOB_END_TIME) the script asks squeue; an unlimited or unknown limit
    trains without --time-limit, and says so. A --time-limit given to the script wins (the later option)."""
    _script(cluster["tmp"] / "bin" / "squeue", f'#!/bin/sh\n[ "$*" = "-h -j 4242 -o %L" ] || exit 1\necho "{left}"\n')
    result = sbatch(cluster, [{"CUDA_VISIBLE_DEVICES": "0"}] * 2, "--time-limit", "100")
    assert result.returncode == 0, result.stderr
    argv = recorded(cluster, "launch-0")["argv"]
    if expected is None:
        assert argv == ["0", "--out-dir", "runs/unet3d", "--time-limit", "100"]
        assert (
            "the job's time limit is unknown" in result.stderr and f"squeue gave '{left or 'nothing'}'" in result.stderr
        )
    else:
        assert argv == ["0", "--out-dir", "runs/unet3d", "--time-limit", str(expected), "--time-limit", "100"]


def test_an_end_time_a_year_ahead_is_a_job_without_a_time_limit(cluster):
    """SLURM gives a job without a time limit an end time a year ahead: a --time-limit of a year would stretch
    the learning-rate schedule over it, so the job trains as for an unknown limit."""
    year = str(int(time.time()) + 365 * 86400)
    result = sbatch(cluster, [{"CUDA_VISIBLE_DEVICES": "0"}] * 2, "--epochs", "3", SLURM_JOB_END_TIME=year)
    assert result.returncode == 0, result.stderr
    assert recorded(cluster, "launch-0")["argv"] == ["0", "--out-dir", "runs/unet3d", "--epochs", "3"]
    assert "time limit is unknown (SLURM_JOB_END_TIME is 364 days away, as for a job without one)" in result.stderr


def test_a_job_too_short_for_its_margin_is_refused(cluster):
    result = sbatch(cluster, [{"CUDA_VISIBLE_DEVICES": "0"}] * 2, SLURM_JOB_END_TIME=str(int(time.time()) + 300))
    assert result.returncode == 2 and "too little for 10 minutes' margin" in result.stderr
    assert recorded(cluster, "srun") is None and recorded(cluster, "launch-0") is None


def test_jobs_get_ports_of_their_own_and_a_given_port_is_kept(cluster):
    """Two jobs whose first node is the same must not meet at one rendezvous store (job ids 15000 apart share a
    port: MASTER_PORT overrides it)."""
    ports = set()
    for job in ("4242", "4243", "99"):
        assert sbatch(cluster, [{"CUDA_VISIBLE_DEVICES": "0"}] * 2, SLURM_JOB_ID=job).returncode == 0
        ports.add(recorded(cluster, "launch-0")["env"]["MASTER_PORT"])
    assert len(ports) == 3 and all(15000 <= int(p) < 30000 for p in ports), ports
    assert sbatch(cluster, [{"CUDA_VISIBLE_DEVICES": "0"}] * 2, MASTER_PORT="29611").returncode == 0
    assert recorded(cluster, "launch-1")["env"]["MASTER_PORT"] == "29611"


def test_the_log_goes_where_slurm_can_write_it_in_a_fresh_clone():
    """SLURM creates no folder for --output or --error: a job whose log folder is missing (runs/ is ignored by
    git, so a fresh clone has none) fails before its first line, without a log to say why."""
    directives = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH ")]
    logs = [d.split("=", 1)[1] for d in directives if d.startswith(("--output=", "--error=", "-o ", "-e "))]
    assert logs, directives
    for log in logs:
        assert Path(log).parent == Path("."), f"{log}: SLURM would need that folder to exist"
    body = SBATCH.read_text().split("\n#SBATCH ")[-1].splitlines()[1:]
    first_command = next(line for line in body if line.strip() and not line.startswith("#"))
    assert all(SBATCH.read_text().index(d) < SBATCH.read_text().index(first_command) for d in directives)


@pytest.mark.parametrize(
    ("gpu_vars", "expected"),
    [
        ({"CUDA_VISIBLE_DEVICES": "6,7", "SLURM_STEP_GPUS": "1,2"}, "6,7"),
        ({"SLURM_STEP_GPUS": "1,2"}, "1,2"),
        ({"CUDA_VISIBLE_DEVICES": "", "SLURM_STEP_GPUS": "5"}, "5"),
    ],
)
def test_gpu_variables_are_taken_in_order(cluster, gpu_vars, expected):
    result = sbatch(cluster, [{"CUDA_VISIBLE_DEVICES": "0"}, gpu_vars])
    assert result.returncode == 0, result.stderr
    assert recorded(cluster, "launch-0")["argv"][0] == "0"
    assert recorded(cluster, "launch-1")["argv"] == [expected, "--out-dir", "runs/unet3d", "--time-limit", LIMIT]


def test_a_node_without_gpus_is_refused(cluster):
    """The batch shell's SLURM_JOB_GPUS (the first node's 4,5,6,7) reaches the second node through srun: it
    must not be taken for that node's cards."""
    result = sbatch(cluster, [{"CUDA_VISIBLE_DEVICES": "0,1"}, {}], "--epochs", "1")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "train.sbatch" in line]
    assert len(lines) == 1, result.stderr
    assert "node 1 (node-b)" in lines[0]
    assert "neither CUDA_VISIBLE_DEVICES nor SLURM_STEP_GPUS is set" in lines[0]
    assert recorded(cluster, "launch-1") is None


@pytest.mark.parametrize(
    ("gpu_vars", "shown"),
    [
        (
            {"CUDA_VISIBLE_DEVICES": "GPU-8c1f1bc4-2a7e-4b4e-9d1c-3f2e5a6b7c8d"},
            "CUDA_VISIBLE_DEVICES=GPU-8c1f1bc4-2a7e-4b4e-9d1c-3f2e5a6b7c8d",
        ),
        ({"CUDA_VISIBLE_DEVICES": "MIG-4d3b2a1f-0000-1111-2222-333344445555"}, "CUDA_VISIBLE_DEVICES=MIG-4d3b2a1f"),
        ({"SLURM_STEP_GPUS": "0,,1"}, "SLURM_STEP_GPUS=0,,1"),
        ({"SLURM_STEP_GPUS": "0-3"}, "SLURM_STEP_GPUS=0-3"),
    ],
)
def test_gpu_ids_that_are_not_indices_are_refused(cluster, gpu_vars, shown):
    result = sbatch(cluster, [gpu_vars, {"CUDA_VISIBLE_DEVICES": "0"}])
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "train.sbatch" in line]
    assert len(lines) == 1, result.stderr
    assert "node 0 (node-a)" in lines[0] and shown in lines[0] and "launch.sh needs nvidia-smi indices" in lines[0]
    assert recorded(cluster, "launch-0") is None


def test_real_launch_sh_masks_each_node_to_its_allocation(cluster):
    """With the real launch.sh on nodes of eight GPUs, torchrun starts with the node's allocated ids."""
    submit, tmp = cluster["submit"], cluster["tmp"]
    shutil.copy(REPO / "launch.sh", submit / "launch.sh")
    listing = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000{i}-aaaa)" for i in range(8))
    _script(tmp / "bin" / "nvidia-smi", f'#!/bin/sh\n[ "$1" = "-L" ] && cat <<"EOF"\n{listing}\nEOF\n')
    record = tmp / "record.py"
    spies = {
        name: _script(tmp / f"{name}-spy", f'#!/bin/bash\nexec {sys.executable} {record} {name} "$@"\n')
        for name in ("torchrun", "python")
    }
    nodes = [{"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, {"SLURM_STEP_GPUS": "0,2,3,5"}]
    result = sbatch(
        cluster,
        nodes,
        "--data-dir",
        "/data/my set",
        TORCHRUN=str(spies["torchrun"]),
        PYTHON=str(spies["python"]),
        MASTER_PORT="29611",
    )
    assert result.returncode == 0, result.stderr
    for rank, gpus in [(0, "4,5,6,7"), (1, "0,2,3,5")]:
        torchrun = recorded(cluster, f"torchrun-{rank}")
        assert torchrun is not None, result.stderr
        assert torchrun["env"]["CUDA_VISIBLE_DEVICES"] == gpus
        assert torchrun["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        argv = torchrun["argv"]
        train = str(submit / "train_ddp.py")
        assert argv[: argv.index(train)] == [
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "node-a:29611",
            "--rdzv-id",
            "4242",
            "--rdzv-conf",
            f"is_host={int(rank == 0)},join_timeout=600,read_timeout=600",  # SLURM_NODEID 0 hosts the store
            "--nproc-per-node",
            "4",
            "--max-restarts",
            "3",
        ]
        assert argv[argv.index(train) + 1 :] == [
            "--out-dir",
            "runs/unet3d",
            "--time-limit",
            LIMIT,
            "--data-dir",
            "/data/my set",
        ]
        preflight = recorded(cluster, f"python-{rank}")
        assert preflight["env"]["CUDA_VISIBLE_DEVICES"] == gpus and preflight["env"]["WORLD_SIZE"] == "8"
    assert "node 1 local rank 3 -> cuda:3 -> physical GPU 5: NVIDIA H100 80GB HBM3" in result.stdout
