"""Distributed training on the CPU with gloo, through the same launcher as `--gpus N`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, children, one_error_line, rank_of

from nmt_cli.engine import checkpoint, distributed, launcher
from nmt_cli.engine.schedule import learning_rate

NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--relu-dropout", "0"]


def _metrics(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


ADAMW_LINEAR = [
    "--optimizer",
    "adamw",
    "--weight-decay",
    "0.05",
    "--schedule",
    "linear",
    "--warmup",
    "5",
    "--lr",
    "1e-3",
]


# The speed levers a GPU has yet to measure, together (users combine them), clipping too.
LEVERS = ["--fixed-shapes", "--fold-scaling", "--fused-qkv", "--clip-norm", "0.5"]


@pytest.mark.parametrize(
    "options", [[], ADAMW_LINEAR, ["--ema", "0.9"], LEVERS], ids=["adam", "adamw-linear", "ema", "levers"]
)
def test_two_ranks_equal_one_process_with_update_freq_two(run_copy, tmp_path, nmt, options):
    import shutil

    single = tmp_path / "single"
    shutil.copytree(run_copy, single)
    common = [*TINY, *NO_DROPOUT, "--max-steps", "20", "--save-every", "20", "--eval-every", "100", *options]
    result = nmt("train", "--run-dir", single, *common, "--update-freq", "2")
    assert result.code == 0, result.err
    result = nmt("train", "--run-dir", run_copy, *common, "--procs", "2", "--device", "cpu")
    assert result.code == 0, result.err
    assert "x 2 ranks x 1 = 512 tokens per update" in result.err.replace("\n", " ")
    a, meta_a = checkpoint.load_tensors(checkpoint.listed(single / "checkpoints")[-1])
    b, meta_b = checkpoint.load_tensors(checkpoint.listed(run_copy / "checkpoints")[-1])
    assert meta_a["step"] == meta_b["step"] == 20 and meta_b["world"] == 2
    assert ("ema" in a) == ("ema" in b) == ("--ema" in options)
    for part, name in [("model", n) for n in a["model"]] + [("ema", n) for n in a.get("ema", {})]:
        x, y = a[part][name], b[part][name]
        if name.endswith("attn.kv.bias"):
            # The key bias adds one constant to all of a query's scores, which softmax ignores:
            # its gradient is rounding noise, which Adam scales up to steps of the learning
            # rate's size in either direction (a failure seen once in the full suite). The value
            # half is set by the data.
            x, y = x[len(x) // 2 :], y[len(y) // 2 :]
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-5), name
    if options == ADAMW_LINEAR:  # the optimizer and schedule asked for, on both
        for state in (a, b):
            assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.05, 0.0]
        rates = {r["step"]: r["lr"] for r in _metrics(run_copy) if r["kind"] == "train"}
        assert rates and all(
            lr == pytest.approx(learning_rate(step, 16, 5, kind="linear", peak=1e-3, max_steps=20))
            for step, lr in rates.items()
        ), rates
    loss_a = [(r["step"], r["loss"], r["tokens"]) for r in _metrics(single) if r["kind"] == "train"]
    loss_b = [(r["step"], r["loss"], r["tokens"]) for r in _metrics(run_copy) if r["kind"] == "train"]
    assert [x[0] for x in loss_a] == [x[0] for x in loss_b]
    assert [x[2] for x in loss_a] == [x[2] for x in loss_b]  # global token counts
    assert all(abs(x[1] - y[1]) < 1e-4 for x, y in zip(loss_a, loss_b))
    # Each rank validated half the batches: together, the whole validation set.
    valid_a = [r["valid_nll"] for r in _metrics(single) if r["kind"] == "valid"]
    valid_b = [r["valid_nll"] for r in _metrics(run_copy) if r["kind"] == "valid"]
    assert len(valid_a) == len(valid_b) == 1 and valid_a[0] == pytest.approx(valid_b[0], abs=1e-4)


def test_a_dead_rank_stops_the_job_and_the_rerun_resumes(run_copy):
    cmd = [
        sys.executable,
        "-m",
        "nmt_cli",
        "train",
        "--run-dir",
        str(run_copy),
        *TINY,
        "--max-steps",
        "100000",
        "--save-every",
        "5",
        "--eval-every",
        "1000",
        "--procs",
        "2",
        "--device",
        "cpu",
    ]
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    first = run_copy / "checkpoints" / "checkpoint_00000005.json"
    deadline = time.monotonic() + 180
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.exists()
    workers = [p for p in children(launcher.pid) if rank_of(p) is not None]
    victim = next(p for p in workers if rank_of(p) == 1)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert time.monotonic() - killed_at < 60  # bounded, not the 30-minute collective timeout
    assert launcher.returncode == 1
    errors = [line for line in err.splitlines() if line.startswith("nmt: error:")]
    assert len(errors) == 1 and "rank 1" in errors[0] and "resume" in errors[0]
    last = checkpoint.listed(run_copy / "checkpoints")[-1]
    step = json.loads(last.with_suffix(".json").read_text())["step"]
    rerun = subprocess.run(
        cmd[: cmd.index("100000")] + [str(step + 2)] + cmd[cmd.index("100000") + 1 :],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from step {step}" in rerun.stderr
    assert (
        json.loads(checkpoint.listed(run_copy / "checkpoints")[-1].with_suffix(".json").read_text())["step"]
        == step + 2
    )


def test_gpus_without_gpus_says_so(run_copy, nmt):
    line = one_error_line(nmt("train", "--run-dir", run_copy, *TINY, "--gpus", "8"))
    assert "--gpus 8 but this machine has 0 GPUs" in line and "--procs N --device cpu" in line
    line = one_error_line(nmt("train", "--run-dir", run_copy, *TINY, "--procs", "2", "--device", "cuda"))
    assert "--gpus" in line


def test_two_rank_resume_is_exact(run_copy, tmp_path, nmt):
    import shutil

    other = tmp_path / "uninterrupted"
    shutil.copytree(run_copy, other)
    common = [*TINY, "--save-every", "4", "--eval-every", "100", "--procs", "2", "--device", "cpu"]
    assert nmt("train", "--run-dir", other, *common, "--max-steps", "8").code == 0
    assert nmt("train", "--run-dir", run_copy, *common, "--max-steps", "4").code == 0
    result = nmt("train", "--run-dir", run_copy, *common, "--max-steps", "8")
    assert result.code == 0 and "resuming from step 4" in result.err
    a, _ = checkpoint.load_tensors(checkpoint.listed(other / "checkpoints")[-1])
    b, _ = checkpoint.load_tensors(checkpoint.listed(run_copy / "checkpoints")[-1])
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def test_torchrun_starts_the_same_training(run_copy):
    port = launcher._free_port()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            "--master-addr",
            "127.0.0.1",
            "-m",
            "nmt_cli",
            "train",
            "--run-dir",
            str(run_copy),
            *TINY,
            "--max-steps",
            "4",
            "--save-every",
            "4",
            "--eval-every",
            "100",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = checkpoint.listed(run_copy / "checkpoints")[-1]
    meta = json.loads(last.with_suffix(".json").read_text())
    assert meta["step"] == 4 and meta["world"] == 2


def _in_one_process_group() -> dict[str, str]:
    """The environment of a world of one: this process alone in its process group."""
    port = launcher._free_port()
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
    }


def test_host_collectives_take_cpu_tensors_whatever_the_default_backend(monkeypatch):
    """NCCL has a backend for CUDA tensors only; "cuda:gloo" is the same on a CPU machine. The
    checkpoint's RNG states (CPU tensors) must still be gathered."""
    for name, value in _in_one_process_group().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(distributed.BACKENDS, "cpu", "cuda:gloo")
    group, _ = distributed.setup(torch.device("cpu"))
    try:
        assert group.active and group.host is not None
        state = torch.get_rng_state()
        assert torch.equal(group.gather(state)[0], state)  # what Trainer.save gathers
        assert group.host_max([3, 0]) == [3, 0]
        assert group.gather_objects(("step", 7)) == [("step", 7)]
        group.barrier()
    finally:
        group.close()


def test_compile_wraps_the_ddp_model(monkeypatch):
    """torch's order: DDP first, then compile, so gradient buckets still overlap backward."""
    from torch.nn.parallel import DistributedDataParallel

    for name, value in _in_one_process_group().items():
        monkeypatch.setenv(name, value)
    group, device = distributed.setup(torch.device("cpu"))
    try:
        forward = group.wrap(torch.nn.Linear(4, 4), device, compile=True)
        assert isinstance(forward, torch._dynamo.eval_frame.OptimizedModule)
        assert isinstance(forward._orig_mod, DistributedDataParallel)
        assert hasattr(forward, "no_sync")  # reaches DDP's, for --update-freq
    finally:
        group.close()


def test_a_compiled_ddp_model_is_cut_into_a_few_buckets(monkeypatch):
    """Under --compile, DDP's buckets (where the compiler cuts the update into graphs) each
    hold about a quarter of the gradients, not DDP's 25 MB; uncompiled, DDP's default."""
    for name, value in _in_one_process_group().items():
        monkeypatch.setenv(name, value)
    group, device = distributed.setup(torch.device("cpu"))
    try:
        model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.Linear(8192, 2048))  # 128 MB
        compiled = group.wrap(model, device, compile=True)
        assert compiled._orig_mod.bucket_bytes_cap == pytest.approx(128 / 4 * 2**20, rel=0.01)
        assert group.wrap(torch.nn.Linear(4, 4), device).bucket_bytes_cap == 25 * 2**20
        assert distributed.compiled_bucket_mb(torch.nn.Linear(4, 4)) == 25.0
    finally:
        group.close()


def test_launch_environments_find_their_gpu(monkeypatch):
    from nmt_cli.errors import NmtError

    for name in ("WORLD_SIZE", "RANK", *distributed.LOCAL_RANK_VARIABLES, "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    # SLURM, one task per GPU bound with --gpus-per-task: task 3 sees only its own GPU.
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    rank, world, local = distributed.from_environment()
    assert (rank, world, local) == (3, 4, 3)
    assert distributed.gpu_index(rank, local, visible=1) == 0
    assert distributed.gpu_index(rank, local, visible=4) == 3
    with pytest.raises(NmtError, match="local rank 3 but sees 2 GPUs"):
        distributed.gpu_index(rank, local, visible=2)
    # A launcher that sets RANK and WORLD_SIZE only: no guessing which GPU is whose.
    for name in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    assert distributed.from_environment() == (5, 8, None)
    with pytest.raises(NmtError, match="LOCAL_RANK"):
        distributed.gpu_index(5, None, visible=8)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "5")  # mpirun says it
    assert distributed.from_environment() == (5, 8, 5)
    assert distributed.shared_gpus([("a", "g0"), ("a", "g1"), ("b", "g0")]) is None
    problem = distributed.shared_gpus([("a", "g0"), ("a", "g1"), ("a", "g0")])
    assert "ranks 0 and 2 both use GPU g0 of a" in problem


def test_the_launcher_reports_the_worker_that_started_it():
    from nmt_cli.engine.distributed import LOST_CONTACT
    from nmt_cli.engine.launcher import WORKER_ERROR, root_cause

    own = WORKER_ERROR + "out of memory on cuda:1 at step 9: lower --max-tokens"
    lost = WORKER_ERROR + LOST_CONTACT + " at step 8 (Connection reset by peer)"
    # Rank 0 lost contact first (in the same second), rank 1 ran out of memory: rank 1 it is.
    failure = root_cause({0: (1, 100, lost), 1: (1, 100, own)})
    assert failure.message == "rank 1: out of memory on cuda:1 at step 9: lower --max-tokens"
    assert not failure.restartable
    failure = root_cause({0: (1, 100, lost), 1: (-9, 101, "")})
    assert failure.message == "rank 1 was killed by SIGKILL" and failure.restartable
    # The launcher stops the survivors with SIGTERM, maybe before they notice on their own.
    failure = root_cause({0: (-15, 100, ""), 1: (-9, 100, "")})
    assert failure.message == "rank 1 was killed by SIGKILL"
    assert root_cause({2: (1, 100, ""), 1: (1, 99, "")}).message == "rank 1 exited with code 1"


def _two_nodes(node_dirs, extra):
    """`nmt train` on two 'nodes' of one CPU worker each (this machine twice): node 0 and
    node 1 each run their own launcher, as on a cluster."""
    port = launcher._free_port()
    common = [
        *TINY,
        "--save-every",
        "3",
        "--eval-every",
        "100",
        "--device",
        "cpu",
        "--procs",
        "1",
        "--nnodes",
        "2",
        "--threads",  # two 'nodes' on one machine's cores
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        *extra,
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "nmt_cli", "train", "--run-dir", str(d), *common, "--node-rank", str(i)],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, d in enumerate(node_dirs)
    ]
    return [(p.wait(timeout=180), p.stderr.read()) for p in procs]


def test_nodes_share_one_run_directory(run_copy):
    done = _two_nodes([run_copy, run_copy], ["--max-steps", "6"])
    assert [code for code, _ in done] == [0, 0], done
    meta = json.loads(checkpoint.listed(run_copy / "checkpoints")[-1].with_suffix(".json").read_text())
    assert meta["step"] == 6 and meta["world"] == 2


def test_nodes_that_would_resume_apart_stop_with_one_error(run_copy, tmp_path):
    import shutil

    fresh = tmp_path / "node1"  # a node-local run directory without node 0's checkpoints
    shutil.copytree(run_copy, fresh)
    done = _two_nodes([run_copy, run_copy], ["--max-steps", "3"])
    assert [code for code, _ in done] == [0, 0], done
    done = _two_nodes([run_copy, fresh], ["--max-steps", "6"])
    for code, err in done:
        errors = [line for line in err.splitlines() if line.startswith("nmt: error:")]
        assert code == 1 and len(errors) == 1, err
        assert "different checkpoints to resume from (rank 0: step 3, rank 1: none)" in errors[0]
        assert "must be one directory that every node shares" in errors[0]
    assert not (fresh / "checkpoints").exists()


def test_a_workers_own_error_is_told_from_losing_the_others():
    from nmt_cli.engine.distributed import LOST_CONTACT
    from nmt_cli.engine.launcher import WORKER_ERROR, root_cause

    # Rank 1 stopped on an error of its own; the launcher then SIGTERMed rank 0.
    own = WORKER_ERROR + "internal error: KeyError: 'valid_bleu'"
    failure = root_cause({0: (-15, 100, ""), 1: (1, 100, own)})
    assert failure.message == "rank 1: internal error: KeyError: 'valid_bleu'" and not failure.restartable
    lost = WORKER_ERROR + LOST_CONTACT + " at step 8 (Connection reset by peer)"
    failure = root_cause({0: (1, 100, lost), 1: (-15, 101, "")})
    assert failure.message == f"rank 0: {LOST_CONTACT} at step 8 (Connection reset by peer)"
    assert failure.restartable


_PEER = """
import datetime, os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK=str(rank), WORLD_SIZE="2")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(sys.argv[3])))
t = torch.ones(1)
dist.all_reduce(t)
if rank == 1:
    if sys.argv[4] == "exit":
        os._exit(0)
    import time; time.sleep(30); os._exit(0)
from nmt_cli.engine.distributed import is_lost_contact
try:
    dist.all_reduce(t)
except Exception as e:
    print(type(e).__name__, is_lost_contact(e), flush=True)
    os._exit(0)
print("no error", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("peer", ["exit", "hang"])
def test_gloos_own_errors_for_a_lost_rank_count_as_lost_contact(peer):
    """What a real gloo collective raises when the other rank is gone or silent (a plain
    RuntimeError, not a DistError) is "lost contact"; a worker's own errors are not."""
    from nmt_cli.engine.distributed import is_lost_contact

    port = str(launcher._free_port())
    other = subprocess.Popen([sys.executable, "-c", _PEER, "1", port, "3", peer])
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PEER, "0", port, "3", peer], capture_output=True, text=True, timeout=60
        )
    finally:
        other.kill()
        other.wait()
    assert done.stdout.split() == ["RuntimeError", "True"], done.stdout + done.stderr[-2000:]
    assert is_lost_contact(torch.distributed.DistNetworkError("connection refused"))
    assert not is_lost_contact(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_lost_contact(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"))
    assert not is_lost_contact(KeyError("valid_bleu"))


def test_mpirun_and_pmi_ranks_are_read(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", *distributed.LOCAL_RANK_VARIABLES, "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for ranks in distributed.RANK_VARIABLES:
        for name in ranks:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert distributed.from_environment() == (5, 8, 1)
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    assert distributed.from_environment() == (3, 4, 3)
    monkeypatch.setenv("PMI_SIZE", "1")  # a world of one is no distributed run
    assert distributed.from_environment() == (0, 1, 0)


def test_gloo_binds_the_interface_that_reaches_the_rendezvous_host(monkeypatch):
    """Where the hostname resolves to 127.0.1.1 (Ubuntu's /etc/hosts), gloo would tell the other
    nodes to connect to a loopback address: the interface towards MASTER_ADDR is chosen."""
    import socket

    real = socket.gethostbyname
    hostname = socket.gethostname()

    def resolve(name, address):
        return lambda host: address if host == name else real(host)

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", resolve(hostname, "127.0.1.1"))
    assert distributed.choose_gloo_interface("127.0.0.1") == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    # The user's choice stays, and a hostname that resolves to a routable address needs none.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert distributed.choose_gloo_interface("127.0.0.1") is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(socket, "gethostbyname", resolve(hostname, "192.0.2.10"))
    assert distributed.choose_gloo_interface("127.0.0.1") is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    # Every interface this machine has is found by its own address.
    for _, name in socket.if_nameindex():
        address = distributed.interface_address(name)
        if address is not None:
            assert distributed.interface_towards(address) in {name, "lo"}


def test_the_launchers_workers_share_the_cores_unless_a_thread_count_was_chosen(monkeypatch):
    """OMP_NUM_THREADS: cores // workers while the launcher starts them, then gone again; a
    value the user (or CI) set is theirs, kept as it is."""
    from nmt_cli.config import cpus

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with launcher._worker_threads(2):
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, cpus() // 2))
    assert "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with launcher._worker_threads(2):
        assert os.environ["OMP_NUM_THREADS"] == "7"
    assert os.environ["OMP_NUM_THREADS"] == "7"


def test_batched_grad_copy_reaches_ddp_only_when_asked(monkeypatch):
    """--batched-grad-copy: DDP told to copy a bucket's gradients at once; off by default."""
    for name, value in _in_one_process_group().items():
        monkeypatch.setenv(name, value)
    group, device = distributed.setup(torch.device("cpu"))
    try:
        assert group.wrap(torch.nn.Linear(4, 4), device, batched_grad_copy=True).batched_grad_copy is True
        assert group.wrap(torch.nn.Linear(4, 4), device).batched_grad_copy is False
    finally:
        group.close()
