"""Starting the processes of a multi-process test: the workers beside this file, one process a rank with
the rendezvous variables torchrun would give it, side by side on the loopback interface.

The ranks are started directly rather than under torchrun: its agent now and then never started the
second worker on the 2-core CI machine, and the agent is not what these tests are about.

A worker script's rank is forked from a fork server that has imported torch and transformers once:
each fresh interpreter spent 10-13 s of CPU on those imports alone on a 2-core AVX2 EPYC, and the suite
starts a hundred ranks. The fork then runs the script as ``python script args`` would (its folder first
on ``sys.path``, ``__name__ == "__main__"``, the rank's environment, its output to the log). Other
commands (``hf-fp8 launch``, torchrun) start as processes of their own."""

from __future__ import annotations

import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "dist_worker.py"
FSDP_WORKER = HERE / "dist_fsdp_worker.py"
TRAINER_WORKER = HERE / "dist_trainer_worker.py"
TRAINER_FSDP_WORKER = HERE / "dist_trainer_fsdp_worker.py"
TP_WORKER = HERE / "dist_tp_worker.py"
DEEPSPEED_WORKER = HERE / "dist_deepspeed_worker.py"
ACCELERATE_DEEPSPEED_WORKER = HERE / "dist_accelerate_deepspeed_worker.py"
HF_FP8 = Path(sys.executable).with_name("hf-fp8")
TIMEOUT_S = 180
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(
    [
        "torch",
        "torch.distributed.tensor",
        "transformers.modeling_utils",
        "transformers.models.llama.modeling_llama",
    ]
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(commands: list[tuple[list[str], dict[str, str]]], log: Path) -> None:
    """Run processes side by side on the loopback interface, their output to ``log`` (pipes have been
    seen to stall the ranks here); if one hangs, kill them all with everything they started."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    log.write_text("")
    with log.open("a") as out:
        processes = [_start(cmd, {**env, **extra}, out, log) for cmd, extra in commands]
        hung = False
        for process in processes:
            hung = hung or not _ended(process, TIMEOUT_S)
        if hung:
            for process in processes:
                for child in psutil.Process(process.pid).children(recursive=True):
                    child.kill()
                process.kill()
                _ended(process, None)
            raise AssertionError(f"hung for {TIMEOUT_S} s; output:\n{log.read_text()[-3000:]}")
    codes = [p.returncode if isinstance(p, subprocess.Popen) else p.exitcode for p in processes]
    assert codes == [0] * len(codes), log.read_text()[-3000:]


def _start(command: list[str], env: dict[str, str], out, log: Path):
    """``command`` as a process: forked from the fork server when it runs a Python script, else its own."""
    if len(command) >= 2 and command[0] == sys.executable and command[1].endswith(".py"):
        fork = _FORKS.Process(target=_run_script, args=(command[1:], env, str(log)))
        fork.start()
        return fork
    return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


def _ended(process, timeout: float | None) -> bool:
    if isinstance(process, subprocess.Popen):
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    process.join(timeout)
    return process.exitcode is not None


def _run_script(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the fork: run the script ``argv[0]`` with its arguments as ``python`` would."""
    os.environ.clear()
    os.environ.update(env)
    with open(log, "ab", buffering=0) as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the process's standard input until it ends)
    if "OMP_NUM_THREADS" in env:  # read by OpenMP when torch loaded, in the fork server
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def ranks(world: int, worker: Path = WORKER) -> list[tuple[list[str], dict[str, str]]]:
    """What torchrun --nproc_per_node WORLD starts: one worker per rank with its rendezvous variables."""
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    return [
        ([sys.executable, str(worker)], {**rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(world)
    ]
