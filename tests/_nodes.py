"""Two (or more) simulated nodes of one job: concurrent ``torchrun --nnodes N`` launches on loopback (gloo).

Tests that launch them take a port on 127.0.0.1 for the rendezvous: they share the ``ports`` xdist group
(``pytestmark``), so that two of them never race for the same free port in parallel test workers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def launch_nodes(
    out: Path,
    script: str,
    arguments: Sequence[str],
    node_dirs: Sequence[Path],
    *,
    timeout: float,
    cache_dir_env: bool = False,
) -> None:
    """Run ``script`` (in tests/) under one torchrun launch per node, 2 ranks each, concurrently.

    ``arguments`` are the script's; ``{dir}`` and ``{node}`` in them become the node's directory and rank.
    ``cache_dir_env``: the node's directory is also its ``MMAPCACHE_DIR``. Each node's output goes to
    ``out / node{k}.log``; a node that fails or outlives ``timeout`` fails the test with the end of its log.
    """
    port = free_port()
    nodes = len(node_dirs)
    runs = []
    for node, directory in enumerate(node_dirs):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}"]
        command += ["--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}", str(HERE / script)]
        command += [argument.format(dir=directory, node=node) for argument in arguments]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        if cache_dir_env:
            env["MMAPCACHE_DIR"] = str(directory)
        log = open(out / f"node{node}.log", "w")  # noqa: SIM115 - closed below, after the process ends
        runs.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    failures = []
    for node, (run, log) in enumerate(runs):
        try:
            code = run.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            code = run.wait()
        log.close()
        if code != 0:
            failures.append(f"node {node} exited {code}:\n{(out / f'node{node}.log').read_text()[-3000:]}")
    assert not failures, "\n".join(failures)
