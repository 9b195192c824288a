"""Python programs of the suite (worker scripts, examples, benchmarks, the command line) forked from a
fork server that has imported torch and transformers once, instead of started as fresh interpreters.

On a 2-core AVX2 EPYC a fresh interpreter spends 10-13 s of CPU importing torch and transformers' model
code, and the suite starts well over a hundred. A fork runs its program as ``python`` would: the same
``sys.argv``, ``__name__ == "__main__"``, the script's folder (or, for ``-m``, the working folder) first
on ``sys.path``, the given environment and working folder, its standard input empty and its output to
the files given. What a fork cannot show is what happens at import time of the modules the server
loaded (a test of that starts an interpreter of its own). Programs nested inside these (a benchmark's
rows, torchrun's ranks) still start as processes of their own.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

HF_FP8 = Path(sys.executable).with_name("hf-fp8")

_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(
    [
        "torch",
        "torch.distributed.tensor",
        "transformers.modeling_utils",
        "transformers.models.llama.modeling_llama",
    ]
)


def forkable(command: list[str]) -> bool:
    """Whether ``command`` is a program a fork can run: ``python script ...``, ``python -m module ...``
    or the ``hf-fp8`` command line."""
    if command[:1] == [str(HF_FP8)]:
        return True
    if len(command) < 2 or command[0] != sys.executable:
        return False
    return command[1].endswith(".py") or (command[1] == "-m" and len(command) > 2)


def start(command: list[str], env: dict[str, str], out: str, err: str, cwd: str | None = None):
    """``command`` (see :func:`forkable`) forked and started, its output appended to the files ``out``
    and ``err`` (the same file for both is fine); a ``multiprocessing`` process."""
    command = [os.fspath(part) for part in command]
    fork = _FORKS.Process(target=_run_program, args=(command, env, out, err, cwd))
    fork.start()
    return fork


def run(
    command: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """What ``subprocess.run(command, capture_output=True, text=True, stdin=DEVNULL, ...)`` returns, for
    a program a fork can run; anything else runs as that call would. A fork still running after
    ``timeout`` seconds is killed and ``subprocess.TimeoutExpired`` raised."""
    command, env = [os.fspath(part) for part in command], dict(os.environ if env is None else env)
    cwd = None if cwd is None else str(cwd)
    if not forkable(command):
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
        if fork.exitcode is None:
            fork.kill()
            fork.join()
            raise subprocess.TimeoutExpired(command, timeout)
        stdout, stderr = (Path(p).read_text() if os.path.exists(p) else "" for p in (out, err))
    return subprocess.CompletedProcess(command, fork.exitcode, stdout, stderr)


def _run_program(command: list[str], env: dict[str, str], out: str, err: str, cwd: str | None) -> None:
    """In the fork: run ``command`` as its interpreter would."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        with open(path, "ab", buffering=0) as file:
            os.dup2(file.fileno(), fd)
    sys.stdin = open(os.devnull)  # noqa: SIM115 (the process's standard input until it ends)
    if "OMP_NUM_THREADS" in env:  # read by OpenMP when torch loaded, in the fork server
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if command[0] == str(HF_FP8):  # the console script: hf_fp8.apps.cli:main
            sys.argv = ["hf-fp8", *command[1:]]
            from hf_fp8.apps.cli import main

            sys.exit(main())
        if command[1] == "-m":
            sys.argv = [command[2], *command[3:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(command[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = command[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[1])))
            runpy.run_path(command[1], run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
