"""Starting the processes of a multi-process test: the workers beside this file, one process a rank with
the rendezvous variables torchrun would give it, side by side on the loopback interface.

The ranks are started directly rather than under torchrun: its agent now and then never started the
second worker on the 2-core CI machine, and the agent is not what these tests are about.

A worker script's rank is forked from the suite's fork server (see :mod:`forked`), as ``python script
args`` would run it, with the rank's environment and its output to the log. Other commands (``hf-fp8
launch``, torchrun) start as processes of their own: what they start is what they test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import forked

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "dist_worker.py"
FSDP_WORKER = HERE / "dist_fsdp_worker.py"
TRAINER_WORKER = HERE / "dist_trainer_worker.py"
TRAINER_FSDP_WORKER = HERE / "dist_trainer_fsdp_worker.py"
TP_WORKER = HERE / "dist_tp_worker.py"
DEEPSPEED_WORKER = HERE / "dist_deepspeed_worker.py"
ACCELERATE_DEEPSPEED_WORKER = HERE / "dist_accelerate_deepspeed_worker.py"
HF_FP8 = forked.HF_FP8
TIMEOUT_S = 180


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
                forked.kill_with_children(process.pid)
                _ended(process, None)
            raise AssertionError(f"hung for {TIMEOUT_S} s; output:\n{log.read_text()[-3000:]}")
    codes = [p.returncode if isinstance(p, subprocess.Popen) else p.exitcode for p in processes]
    assert codes == [0] * len(codes), log.read_text()[-3000:]


def _start(command: list[str], env: dict[str, str], out, log: Path):
    """``command`` as a process: forked from the fork server when it runs a Python script, else its own."""
    if forked.forkable(command, env) and command[1].endswith(".py"):
        return forked.start(command, env, str(log), str(log))
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


def ranks(world: int, worker: Path = WORKER) -> list[tuple[list[str], dict[str, str]]]:
    """What torchrun --nproc_per_node WORLD starts: one worker per rank with its rendezvous variables."""
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    return [
        ([sys.executable, str(worker)], {**rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(world)
    ]
