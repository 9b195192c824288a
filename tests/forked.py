"""Python programs of the suite (worker scripts, examples, benchmarks, the command line) forked from a
fork server that has imported torch and transformers once, instead of started as fresh interpreters.

On a 2-core AVX2 EPYC a fresh interpreter spends 10-13 s of CPU importing torch and transformers' model
code, and the suite starts well over a hundred. A fork runs its program as ``python`` would: the same
``sys.argv``, ``__name__ == "__main__"``, the script's folder (or, for ``-m``, the working folder) first
on ``sys.path``, the given environment and working folder, its standard input empty and its output to
the files given. What a fork cannot show is what happens when the server's modules are imported: their
warnings, and variables read then (``PYTHON*``, ``TORCH*``, ``HF_*``, ``TRANSFORMERS_*``: a command
given other values of those, hf-fp8's own aside, starts an interpreter of its own, as does a test of
import time). Programs nested inside these (a benchmark's rows, torchrun's ranks) start as processes of
their own.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

HF_FP8 = Path(sys.executable).with_name("hf-fp8")

_READ_AT_START = ("PYTHON", "TORCH", "HF_", "TRANSFORMERS_")
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(
    [
        "torch",
        "torch.distributed.tensor",
        "transformers.modeling_utils",
        "transformers.models.llama.modeling_llama",
    ]
)


def forkable(command: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether ``command`` is a program a fork can run: ``python script ...``, ``python -m module ...``
    or the ``hf-fp8`` command line, in an environment that agrees with this process's on the variables
    read at start-up (see the module docstring)."""
    if env is not None and _start_up_variables(env) != _start_up_variables(os.environ):
        return False
    if command[:1] == [str(HF_FP8)]:
        return True
    if len(command) < 2 or command[0] != sys.executable:
        return False
    return command[1].endswith(".py") or (command[1] == "-m" and len(command) > 2)


def start(command: list[str], env: dict[str, str], out: str, err: str, cwd: str | None = None):
    """``command`` (see :func:`forkable`) forked and started in ``cwd`` (default: this process's working
    folder), its output appended to the files ``out`` and ``err`` (the same file for both is fine); a
    ``multiprocessing`` process."""
    command, cwd = [os.fspath(part) for part in command], os.getcwd() if cwd is None else str(cwd)
    fork = _FORKS.Process(target=_run_program, args=(command, env, out, err, cwd))
    fork.start()
    return fork


def run(
    command: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """What ``subprocess.run(command, capture_output=True, text=True, stdin=DEVNULL, ...)`` returns, for
    a program a fork can run; anything else runs as that call would. A fork still running after
    ``timeout`` seconds is killed with what it started, and ``subprocess.TimeoutExpired`` raised."""
    command, env = [os.fspath(part) for part in command], dict(os.environ if env is None else env)
    cwd = None if cwd is None else str(cwd)
    if not forkable(command, env):
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        fork = start(command, env, out, err, cwd)
        fork.join(timeout)
        hung = fork.exitcode is None
        if hung:
            kill_with_children(fork.pid)
            fork.join()
        stdout, stderr = (Path(p).read_text() if os.path.exists(p) else "" for p in (out, err))
    if hung:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, fork.exitcode, stdout, stderr)


def _start_up_variables(env) -> dict[str, str]:
    """The variables the server's modules may have read when it imported them (not hf-fp8's own)."""
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_START) and not k.startswith("HF_FP8")}


def kill_with_children(pid: int) -> None:
    """Kill process ``pid`` and every process it started (torchrun's ranks, a benchmark's rows)."""
    try:
        process = psutil.Process(pid)
        family = [*process.children(recursive=True), process]
    except psutil.NoSuchProcess:
        return
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()


def _run_program(command: list[str], env: dict[str, str], out: str, err: str, cwd: str | None) -> None:
    """In the fork: run ``command`` as its interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    multiprocessing.set_start_method(None, force=True)  # the program's own default, as in a fresh python
    with open(os.devnull, "rb") as empty:
        os.dup2(empty.fileno(), 0)
    for fd, path in ((1, out), (2, err)):
        with open(path, "ab", buffering=0) as file:
            os.dup2(file.fileno(), fd)
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the process's standard input until it ends)
    base_path = [p for p in sys.path if p not in ("", ".")]  # the server's -c put the working folder first
    if "OMP_NUM_THREADS" in env:  # read by OpenMP when torch loaded, in the fork server
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if command[0] == str(HF_FP8):  # the console script: hf_fp8.apps.cli:main
            sys.argv = ["hf-fp8", *command[1:]]
            sys.path[:] = base_path
            from hf_fp8.apps.cli import main

            sys.exit(main())
        if command[1] == "-m":
            sys.argv = [command[2], *command[3:]]
            sys.path[:] = [os.getcwd(), *base_path]
            runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = command[1:]
            sys.path[:] = [os.path.dirname(os.path.realpath(command[1])), *base_path]
            runpy.run_path(command[1], run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
