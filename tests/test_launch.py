"""launch.sh: GPU-id validation, masking before Python starts, the rank mapping, option pass-through.

These machines have no GPU: a stand-in `nvidia-smi` on PATH lists four, and spies in place of torchrun
(TORCHRUN) and of the pre-flight's Python (PYTHON) record what they would have been started with. The
real torchrun and pre-flight run in test_train_e2e.py and test_reliability.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run

GPUS = [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd)" for i in range(4)]


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listing = "\n".join(GPUS)
    _script(bin_dir / "nvidia-smi", f'#!/bin/sh\n[ "$1" = "-L" ] && cat <<"EOF"\n{listing}\nEOF\n')
    spies = {}
    for name in ("torchrun", "python"):
        record = str(tmp_path / f"{name}.json")
        spies[name] = _script(
            tmp_path / f"{name}-spy",
            f"#!{sys.executable}\nimport json, os, sys\n"
            f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({record!r}, 'w'))\n"
            f"sys.exit(int(os.environ.get('SPY_EXIT_{name.upper()}', os.environ.get('SPY_EXIT', '0'))))\n",
        )
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "TORCHRUN": str(spies["torchrun"]),
        "PYTHON": str(spies["python"]),
    }


def started(tmp_path, name: str = "torchrun") -> dict | None:
    path = tmp_path / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ("5,5", "GPU id 5 appears twice in '5,5'"),
        ("3,03", "GPU id 3 appears twice in '3,03'"),  # CUDA reads a repeated ordinal as no GPU at all
        ("1,2,1", "GPU id 1 appears twice"),
        ("a", "GPU id 'a' in 'a' is not a number"),
        ("1,x", "GPU id 'x' in '1,x' is not a number"),
        ("-1", "negative GPU id '-1'"),
        ("", "empty GPU list"),
        ("1,,2", "empty entry in GPU list '1,,2'"),
        ("2,", "empty entry in GPU list '2,'"),
        ("4", "GPU id 4 is not among the 4 GPU(s) that nvidia-smi -L lists"),
        ("0,9", "GPU id 9 is not among the 4 GPU(s)"),
        # "$(nvidia-smi --query-gpu=index ...)" is one id per line: `read` took the first line alone
        ("0\n1\n2", "GPU list '0\\n1\\n2' holds a space or a line break: give ids separated by commas alone"),
        ("5, 6", "GPU list '5, 6' holds a space or a line break"),
        ("cpu:0", "cpu:N needs a positive number of processes, got '0'"),
        ("cpu:two", "cpu:N needs a positive number of processes, got 'two'"),
        ("cpu:", "cpu:N needs a positive number of processes, got ''"),
        ("cpu:10000", "got '10000' (1 to 9999)"),
        ("18446744073709551616", "GPU id '18446744073709551616' in '18446744073709551616' is too large"),  # not 0
        ("--epochs", "the first argument must be GPU ids or cpu[:N]"),
    ],
)
def test_bad_ids_are_refused_before_anything_starts(ids, message, env, tmp_path):
    result = run(["bash", "launch.sh", ids, "--epochs", "1"], env=env, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, "one line"
    assert message in result.stderr
    assert started(tmp_path) is None and started(tmp_path, "python") is None, "no process may start"


def test_gpu_ids_are_masked_and_mapped(env, tmp_path):
    result = run(["bash", "launch.sh", "3,1", "--epochs", "5", "--out-dir", "runs/x y"], env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    spy = started(tmp_path)
    assert spy["env"]["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert spy["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert int(spy["env"]["OMP_NUM_THREADS"]) >= 1
    assert spy["argv"] == [
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        str(REPO / "train_ddp.py"),
        "--epochs",
        "5",
        "--out-dir",
        "runs/x y",
    ]
    preflight = started(tmp_path, "python")
    assert preflight["argv"] == [str(REPO / "train_ddp.py"), "--epochs", "5", "--out-dir", "runs/x y", "--prepare-only"]
    assert preflight["env"]["CUDA_VISIBLE_DEVICES"] == "3,1" and preflight["env"]["WORLD_SIZE"] == "2"
    assert preflight["env"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1", "the pre-flight must not initialise CUDA"
    assert preflight["env"]["UNET3D_EXPECT_CUDA"] == spy["env"]["UNET3D_EXPECT_CUDA"] == "1"
    lines = result.stdout.splitlines()
    assert (
        "  rank 0 -> cuda:0 -> physical GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-00000003-aaaa-bbbb-cccc-dddddddddddd)"
        in lines
    )
    assert (
        "  rank 1 -> cuda:1 -> physical GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-00000001-aaaa-bbbb-cccc-dddddddddddd)"
        in lines
    )


def test_gpu_ids_with_leading_zeros_are_the_same_gpus(env, tmp_path):
    """`03,1` names GPUs 3 and 1: CUDA is given `3,1` (the ids as nvidia-smi numbers them)."""
    result = run(["bash", "launch.sh", "03,001", "--epochs", "1"], env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert started(tmp_path)["env"]["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert "CUDA_VISIBLE_DEVICES=3,1, 2 process(es)" in result.stdout
    assert any(line.startswith("  rank 1 -> cuda:1 -> physical GPU 1: NVIDIA") for line in result.stdout.splitlines())


def test_cpu_mode_hides_gpus_and_shares_cores(env, tmp_path):
    result = run(["bash", "launch.sh", "cpu:3", "--resume", "none"], env={**env, "OMP_NUM_THREADS": ""}, timeout=30)
    assert result.returncode == 0, result.stderr
    spy = started(tmp_path)
    assert spy["env"]["CUDA_VISIBLE_DEVICES"] == "" and spy["env"]["UNET3D_EXPECT_CUDA"] == "0"
    assert spy["env"]["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 3))
    assert spy["argv"][:3] == ["--standalone", "--nproc-per-node", "3"] and spy["argv"][-2:] == ["--resume", "none"]
    assert "rank 2 -> cpu" in result.stdout
    default = run(["bash", "launch.sh", "cpu"], env=env, timeout=30)
    assert default.returncode == 0 and started(tmp_path)["argv"][2] == "2"


def test_gpu_ids_on_a_machine_whose_torch_sees_no_gpu_are_refused_not_run_on_the_cpu(env, tmp_path, monkeypatch):
    """nvidia-smi lists GPUs (the stand-in) but this torch sees none (a CPU build, or a driver it cannot use):
    the real pre-flight stops the job with one message instead of the ranks training on the CPU with gloo
    after the launcher said nccl; a rank started without the pre-flight refuses the same way."""
    real = {"PATH": env["PATH"], "UNET3D_LAUNCH_TIME": ""}  # the stand-in nvidia-smi, the real python and torchrun
    out = tmp_path / "run"
    result = run(["bash", "launch.sh", "0,1", "--out-dir", str(out), "--synthetic-dir", str(tmp_path)], env=real)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "launch.sh was given GPUs (CUDA_VISIBLE_DEVICES=0,1) but PyTorch sees none" in errors[0]
    assert not (out / "logs").exists() and not any(tmp_path.glob("cases*")), "nothing started, nothing written"

    from unet3d.training import dist

    monkeypatch.setenv("UNET3D_EXPECT_CUDA", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(ValueError, match=r"given GPUs \(CUDA_VISIBLE_DEVICES=2\) but PyTorch sees none"):
        dist.setup()
    monkeypatch.setenv("UNET3D_EXPECT_CUDA", "0")
    assert dist.check_gpus_visible() is None


def test_help_explains_ids_and_pass_through(env):
    result = run(["bash", "launch.sh", "--help"], env=env, timeout=30)
    assert result.returncode == 0
    assert "5 -> cuda:0" in result.stdout and "cpu[:N]" in result.stdout and "train_ddp.py" in result.stdout
    assert run(["bash", "launch.sh"], env=env, timeout=30).returncode == 2


def test_missing_nvidia_smi_is_a_clear_error(tmp_path):
    spy = _script(tmp_path / "spy", f"#!/bin/sh\ntouch {tmp_path / 'started'}\n")
    result = run(["bash", "launch.sh", "0"], env={"PATH": "/usr/bin:/bin", "TORCHRUN": str(spy)}, timeout=30)
    assert result.returncode == 2 and "nvidia-smi not found" in result.stderr
    assert not (tmp_path / "started").exists()


def test_failed_preflight_starts_no_rank(env, tmp_path):
    result = run(["bash", "launch.sh", "cpu:2", "--epochs", "1"], env={**env, "SPY_EXIT": "2"}, timeout=30)
    assert result.returncode == 2
    assert started(tmp_path, "python") is not None and started(tmp_path) is None


def test_restarts_and_multi_node_rendezvous(env, tmp_path):
    multi = {
        **env,
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29611",
        "MAX_RESTARTS": "5",
        "RDZV_ID": "job42",
    }
    result = run(["bash", "launch.sh", "0,1", "--epochs", "1"], env=multi, timeout=30)
    assert result.returncode == 0, result.stderr
    argv = started(tmp_path)["argv"]
    assert argv[: argv.index(str(REPO / "train_ddp.py"))] == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.0.0.7:29611",
        "--rdzv-id",
        "job42",
        "--rdzv-conf",
        "is_host=0,join_timeout=600,read_timeout=600",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "5",
    ]
    assert started(tmp_path, "python")["env"]["WORLD_SIZE"] == "4"
    node0 = run(["bash", "launch.sh", "0,1"], env={**multi, "NODE_RANK": "0", "RDZV_TIMEOUT": "0900"}, timeout=30)
    assert node0.returncode == 0, node0.stderr
    argv = started(tmp_path)["argv"]
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=1,join_timeout=900,read_timeout=900", "node 0 hosts"
    assert "node 1 local rank 0 -> cuda:0 -> physical GPU 0" in result.stdout
    for bad, message in [
        ({"NNODES": "2"}, "needs MASTER_ADDR"),
        ({"NODE_RANK": "3", "NNODES": "2", "MASTER_ADDR": "x"}, "NODE_RANK must be in 0..1"),
        ({"MAX_RESTARTS": "many"}, "MAX_RESTARTS"),
        ({"RDZV_TIMEOUT": "0"}, "RDZV_TIMEOUT must be a positive number of seconds, got '0'"),
        ({"RDZV_TIMEOUT": "10m"}, "RDZV_TIMEOUT must be a positive number of seconds, got '10m'"),
    ]:
        refused = run(["bash", "launch.sh", "cpu"], env={**env, **bad}, timeout=30)
        assert refused.returncode == 2 and message in refused.stderr


def test_gpu_check_script_explains_itself_and_refuses_a_machine_without_cuda(tmp_path):
    """tests/gpu_check.sh runs on GPU machines only; here: its usage, and a clear verdict without CUDA."""
    usage = run(["bash", "tests/gpu_check.sh"], timeout=30)
    assert usage.returncode == 2 and "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory" in usage.stdout
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(
        bin_dir / "nvidia-smi",
        '#!/bin/sh\ncase "$*" in *index,uuid*) echo "0, GPU-aaaa"; echo "1, GPU-bbbb";; esac\n',
    )
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}
    missing = run(["bash", "tests/gpu_check.sh", "0,7", str(tmp_path / "gc")], env=env, timeout=60)
    assert missing.returncode == 1 and "FAIL  GPU 7 is not among the 2 GPU(s) nvidia-smi lists" in missing.stdout
    result = run(["bash", "tests/gpu_check.sh", "0,1", str(tmp_path / "gc")], env=env, timeout=60)
    assert result.returncode == 1
    assert "FAIL  PyTorch sees no CUDA GPU with CUDA_VISIBLE_DEVICES=0" in result.stdout
    assert "0 passed, 1 failed" in result.stdout and not (tmp_path / "gc").exists(), "nothing trained"


def test_counts_with_leading_zeros_are_decimal_as_torchrun_reads_them(env, tmp_path):
    """bash reads 010 as octal 8 and fails on 08; torchrun reads 10 and 8: the launcher must agree with it."""
    result = run(["bash", "launch.sh", "cpu:010", "--epochs", "1"], env={**env, "OMP_NUM_THREADS": ""}, timeout=30)
    assert result.returncode == 0, result.stderr
    assert started(tmp_path)["argv"][:3] == ["--standalone", "--nproc-per-node", "10"]
    assert started(tmp_path, "python")["env"]["WORLD_SIZE"] == "10"
    assert "rank 9 -> cpu" in result.stdout and "rank 10 -> cpu" not in result.stdout
    assert started(tmp_path)["env"]["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 10))
    nodes = {**env, "NNODES": "08", "NODE_RANK": "07", "MAX_RESTARTS": "09", "MASTER_ADDR": "10.0.0.7"}
    result = run(["bash", "launch.sh", "cpu:1", "--epochs", "1"], env=nodes, timeout=30)
    assert result.returncode == 0, result.stderr
    argv = started(tmp_path)["argv"]
    assert argv[:4] == ["--nnodes", "8", "--node-rank", "7"] and argv[argv.index("--max-restarts") + 1] == "9"
    refused = run(["bash", "launch.sh", "cpu"], env={**env, "NNODES": "09"}, timeout=30)
    assert (
        refused.returncode == 2
        and refused.stderr
        == "launch.sh: NNODES=9 needs MASTER_ADDR (the address of the node that hosts the rendezvous)\n"
    )


def test_help_among_the_options_prints_train_ddp_help_once_and_starts_nothing(env, tmp_path):
    result = run(["bash", "launch.sh", "cpu:2", "--epochs", "1", "--help"], env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert started(tmp_path) is None, "no torchrun"
    assert started(tmp_path, "python")["argv"] == [str(REPO / "train_ddp.py"), "--help"]
    real = run(["bash", "launch.sh", "0,1", "-h"], env={"PATH": env["PATH"]}, timeout=60)  # real python
    assert real.returncode == 0, real.stderr
    assert real.stdout.count("usage: train_ddp.py") == 1 and "--time-limit" in real.stdout


def test_without_torchrun_given_one_python_runs_the_preflight_and_then_torchruns_agent(env, tmp_path):
    """PYTHON names the environment: the ranks must not run under another one's torchrun found on PATH. One
    process of it checks the job and goes on as torchrun's agent (`train_ddp.py --torchrun`), with the GPU
    mask and NVML's check of the pre-flight, and the NVML setting it came with to give back to the ranks."""
    other = _script(tmp_path / "bin" / "torchrun", f"#!/bin/sh\ntouch {tmp_path / 'other_torchrun'}\n")
    for given, was in ((None, ""), ("0", "set:0")):
        nvml = {} if given is None else {"PYTORCH_NVML_BASED_CUDA_CHECK": given}
        result = run(["bash", "launch.sh", "2,0", "--epochs", "1"], env={**env, "TORCHRUN": "", **nvml}, timeout=30)
        assert result.returncode == 0, result.stderr
        assert other.exists() and not (tmp_path / "other_torchrun").exists()
        agent = started(tmp_path, "python")
        script = str(REPO / "train_ddp.py")
        assert agent["argv"][:6] == [script, "--torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts"]
        assert agent["argv"][-3:] == [script, "--epochs", "1"] and "--prepare-only" not in agent["argv"]
        assert agent["env"]["CUDA_VISIBLE_DEVICES"] == "2,0" and agent["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert agent["env"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1" and agent["env"]["UNET3D_NVML_CHECK_WAS"] == was
        assert "WORLD_SIZE" not in agent["env"], "the agent sets the pre-flight's world itself"


@pytest.mark.parametrize("stuck", ["sleep 60", "trap '' TERM; exec sleep 60"])  # the second ignores SIGTERM
def test_a_hung_nvidia_smi_stops_the_launch_with_a_message(env, tmp_path, stuck):
    _script(tmp_path / "bin" / "nvidia-smi", f"#!/bin/sh\n{stuck}\n")
    began = time.monotonic()
    result = run(["bash", "launch.sh", "0", "--epochs", "1"], env={**env, "NVIDIA_SMI_TIMEOUT": "1"}, timeout=30)
    assert result.returncode == 2 and time.monotonic() - began < 20
    assert "nvidia-smi -L failed or did not answer within 1 s" in result.stderr
    assert started(tmp_path) is None and started(tmp_path, "python") is None
    for value in ("soon", "0"):  # 0: `timeout 0` waits for ever, so the hung driver hung the launch
        bad = run(["bash", "launch.sh", "0"], env={**env, "NVIDIA_SMI_TIMEOUT": value}, timeout=30)
        message = f"NVIDIA_SMI_TIMEOUT must be a positive number of seconds, got '{value}'"
        assert bad.returncode == 2 and message in bad.stderr, value


def test_one_gpu_id_starts_one_process_on_that_card(env, tmp_path):
    """`bash launch.sh 5` (here 2): one rank, masked to that card, which is its cuda:0."""
    result = run(["bash", "launch.sh", "2", "--epochs", "1"], env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    spy = started(tmp_path)
    assert spy["env"]["CUDA_VISIBLE_DEVICES"] == "2" and spy["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert spy["argv"][:3] == ["--standalone", "--nproc-per-node", "1"]
    assert started(tmp_path, "python")["env"]["WORLD_SIZE"] == "1"
    assert "  rank 0 -> cuda:0 -> physical GPU 2: NVIDIA H100 80GB HBM3" in result.stdout


def test_the_exit_code_of_the_ranks_is_the_launchers(env, tmp_path):
    """A job whose ranks fail (torchrun exits non-zero once its restarts are spent) must not look successful."""
    result = run(["bash", "launch.sh", "cpu:2", "--epochs", "1"], env={**env, "SPY_EXIT_TORCHRUN": "3"}, timeout=30)
    assert result.returncode == 3 and started(tmp_path) is not None


def test_gpus_are_named_by_the_index_nvidia_smi_prints_not_by_line_position(env, tmp_path):
    """A card nvidia-smi cannot query prints an error line instead of its GPU line: the cards after it were
    shifted by one (GPU 2 shown with GPU 3's name, GPU 3 refused)."""
    listing = "\n".join(
        [GPUS[0], "Unable to determine the device handle for GPU1: 0000:41:00.0: Unknown Error", *GPUS[2:]]
    )
    _script(tmp_path / "bin" / "nvidia-smi", f'#!/bin/sh\n[ "$1" = "-L" ] && cat <<"EOF"\n{listing}\nEOF\n')
    result = run(["bash", "launch.sh", "2,3", "--epochs", "1"], env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "  rank 0 -> cuda:0 -> physical GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-00000002-" in result.stdout
    assert "  rank 1 -> cuda:1 -> physical GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-00000003-" in result.stdout
    refused = run(["bash", "launch.sh", "1", "--epochs", "1"], env=env, timeout=30)
    assert refused.returncode == 2 and "GPU id 1 is not among the 3 GPU(s) that nvidia-smi -L lists" in refused.stderr


def test_an_inherited_gpu_mask_is_named_when_the_ids_given_replace_it(env, tmp_path):
    """Inside an allocation that set CUDA_VISIBLE_DEVICES=2,3 (no device cgroups), `launch.sh 0,1` trains on
    physical 0 and 1, which may be another job's: said, not silent. The same mask given again says nothing."""
    result = run(["bash", "launch.sh", "0,1", "--epochs", "1"], env={**env, "CUDA_VISIBLE_DEVICES": "2,3"}, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "launch.sh: warning: CUDA_VISIBLE_DEVICES was '2,3'; the ids given are physical" in result.stderr
    assert started(tmp_path)["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    same = run(["bash", "launch.sh", "2,3", "--epochs", "1"], env={**env, "CUDA_VISIBLE_DEVICES": "2,3"}, timeout=30)
    assert same.returncode == 0 and "warning" not in same.stderr, same.stderr


def test_a_separator_bad_port_and_missing_tmpdir(env, tmp_path):
    """`launch.sh cpu -- OPTIONS`: the `--` is not passed on (train_ddp.py refused it as an option never given).
    MASTER_PORT=abc is refused before the pre-flight. A TMPDIR that does not exist (a login node's, exported)
    falls back to /tmp instead of failing after the pre-flight."""
    result = run(["bash", "launch.sh", "cpu", "--", "--epochs", "1"], env={**env, "TMPDIR": "/no/such/dir"}, timeout=30)
    assert result.returncode == 0, result.stderr
    assert started(tmp_path)["argv"][-2:] == ["--epochs", "1"] and "--" not in started(tmp_path)["argv"]
    assert started(tmp_path, "python")["argv"][1:] == ["--epochs", "1", "--prepare-only"]
    assert started(tmp_path)["env"]["UNET3D_STOP_FILE"].startswith("/tmp/unet3d-stop.")
    bad = run(["bash", "launch.sh", "cpu", "--epochs", "1"], env={**env, "MASTER_PORT": "abc"}, timeout=30)
    assert bad.returncode == 2 and "MASTER_PORT must be a port number, 1 to 65535, got 'abc'" in bad.stderr
    assert started(tmp_path, "python")["argv"][1:] == ["--epochs", "1", "--prepare-only"], "(the first run's)"


def _signalled_while_waiting(argv: list[str], env: dict, pid_file: Path, sig: int) -> tuple[int, str, int, float]:
    """launch.sh with `argv`, signalled with `sig` once the stand-in it waits on has written its pid to
    `pid_file`: (exit code, stderr, the stand-in's pid, seconds from the signal to the exit)."""
    proc = subprocess.Popen(
        ["bash", "launch.sh", *argv], cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline and proc.poll() is None, "the stand-in never started"
            time.sleep(0.05)
        waited_on = int(pid_file.read_text())
        began = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err.decode(), waited_on, took


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("torchrun_given", [True, False])  # its own process, or the one that goes on as the agent
def test_a_signal_during_the_preflight_ends_it_with_the_job(env, tmp_path, torchrun_given):
    """The traps came after the pre-flight, so SIGTERM ended launch.sh and left the pre-flight (a first run's
    preprocessing) running on without it. A process that has not yet passed the pre-flight is not torchrun
    yet: the job ends, nothing stops gracefully."""
    pid_file = tmp_path / "preflight.pid"
    slow = _script(tmp_path / "slow-python", f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    argv = ["cpu:2", "--epochs", "1"]
    given = {"PYTHON": str(slow), **({} if torchrun_given else {"TORCHRUN": ""})}
    code, err, preflight, _ = _signalled_while_waiting(argv, {**env, **given}, pid_file, signal.SIGTERM)
    assert code == 143 and "launch.sh: SIGTERM before training: the job ends" in err
    assert _gone(preflight), "the pre-flight ended with the job"
    assert started(tmp_path) is None, "no rank started"


def test_ctrl_c_while_nvidia_smi_hangs_ends_the_launch_at_once(env, tmp_path):
    """A hung driver: Ctrl-C (SIGINT to the launcher) waited for NVIDIA_SMI_TIMEOUT (60 s by default) before."""
    pid_file = tmp_path / "smi.pid"
    _script(tmp_path / "bin" / "nvidia-smi", f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    argv = ["0", "--epochs", "1"]
    code, err, smi, took = _signalled_while_waiting(argv, {**env, "NVIDIA_SMI_TIMEOUT": "50"}, pid_file, signal.SIGINT)
    assert code == 130 and took < 5
    assert "launch.sh: SIGINT while waiting for nvidia-smi -L: the job ends" in err
    assert _gone(smi) and started(tmp_path, "python") is None


def test_the_agent_process_starts_torchrun_only_once_the_preflight_has_passed(tmp_path, monkeypatch):
    """`train_ddp.py --torchrun ARGS`: the pre-flight with the world ARGS name (2 nodes of 3), then torchrun's
    own `main` on ARGS, with the environment as launch.sh gave it back and the mark that tells launch.sh a
    signal is now torchrun's; a refused pre-flight's code, and no torchrun, when it fails."""
    import torch.distributed.run

    from unet3d.training.agent import run_agent

    stop = tmp_path / "stop"
    monkeypatch.setenv("UNET3D_STOP_FILE", str(stop))
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    calls = []
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: calls.append(("torchrun", argv, dict(os.environ))))
    argv = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3", "train_ddp.py", "--epochs", "1"]

    def preflight(code):
        def main(args):
            calls.append(("preflight", args, dict(os.environ)))
            return code

        return main

    monkeypatch.setenv("UNET3D_NVML_CHECK_WAS", "")
    assert run_agent(argv, preflight(2)) == 2
    assert [c[0] for c in calls] == ["preflight"] and not Path(f"{stop}.agent").exists()
    _, args, seen = calls[0]
    assert args == ["--epochs", "1", "--prepare-only"]
    assert (seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"], seen["PYTORCH_NVML_BASED_CUDA_CHECK"]) == ("6", "3", "1")

    for was, then in (("", None), ("set:0", "0")):  # unset before launch.sh, or set to 0
        calls.clear()
        monkeypatch.setenv("UNET3D_NVML_CHECK_WAS", was)
        monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        assert run_agent(argv, preflight(0)) == 0
        assert [c[0] for c in calls] == ["preflight", "torchrun"] and Path(f"{stop}.agent").exists()
        _, args, seen = calls[1]
        assert args == argv and seen.get("PYTORCH_NVML_BASED_CUDA_CHECK") == then
        assert "WORLD_SIZE" not in seen and "LOCAL_WORLD_SIZE" not in seen and "UNET3D_NVML_CHECK_WAS" not in seen
        Path(f"{stop}.agent").unlink()
