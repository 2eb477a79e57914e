"""Resume mid-epoch over packed sequences: ``PackedSequences.loader(stateful=True)`` killed, then resumed.

This file is also the training run (``python tests/torch/test_packed_resume.py
--path ...``): it reads one epoch of packed batches and appends each batch's
rows, one JSON line per batch, to ``--out``; ``--save-at k`` saves the
loader's state after batch k, says so by writing ``--saved``, and keeps going
slowly until the test kills it with SIGKILL (with its workers: its whole
process group). ``--resume`` loads the checkpoint and reads the rest. The
killed run's first k batches and the resumed run's must be an uninterrupted
run's, batch by batch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmapcache import Field
from mmapcache.torch import CachedDataset, NodeShardSampler, PackedSequences

HERE = Path(__file__).resolve().parents[1]
K = 4  # batches read before the checkpoint
BATCH = 3
LENGTHS = [int(n) for n in np.random.default_rng(7).integers(0, 60, 300)]


class Documents:
    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> dict[str, Any]:
        start = sum(LENGTHS[:i])
        return {"input_ids": torch.arange(start, start + LENGTHS[i], dtype=torch.int32)}


def make_loader(path: str, workers: int, sampler: str, mode: str) -> Any:
    ds = CachedDataset(Documents(), path, key="packed-resume", fields={"input_ids": Field((None,), "int32")}, check=0)
    packed = PackedSequences(ds, 32, mode=mode)
    options: dict[str, Any] = {"num_workers": workers, "stateful": True}
    if workers:
        options["multiprocessing_context"] = "fork"
    if sampler == "node":
        chosen = NodeShardSampler(packed, num_nodes=2, node_rank=1, local_rank=0, local_world_size=2, seed=5)
        chosen.set_epoch(2)
        options["sampler"] = chosen
    else:
        options["shuffle"] = True
        options["generator"] = torch.Generator().manual_seed(13)
    return packed.loader(BATCH, **options)


def rows(batch: dict[str, Any]) -> list[Any]:
    return [batch["input_ids"].tolist(), batch["doc_ids"][:, 0].tolist(), batch["cu_seqlens"].tolist()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--sampler", choices=("shuffle", "node"), default="shuffle")
    parser.add_argument("--mode", choices=("bfd", "concat"), default="bfd")
    parser.add_argument("--checkpoint")
    parser.add_argument("--saved")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    loader = make_loader(args.path, args.workers, args.sampler, args.mode)
    if args.resume:
        loader.load_state_dict(torch.load(args.checkpoint, weights_only=False))
    with open(args.out, "a") as out:
        for k, batch in enumerate(loader, start=1):
            out.write(json.dumps(rows(batch)) + "\n")
            out.flush()
            if args.save_at is not None and k == args.save_at:
                torch.save(loader.state_dict(), args.checkpoint)
                Path(args.saved).write_text(str(os.getpid()))
            if args.save_at is not None and k >= args.save_at:
                time.sleep(0.2)  # still training when the test kills it


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, str(HERE), env.get("PYTHONPATH", "")]))
    return env


def _run(args: list[str], *, kill_after: Path | None = None) -> None:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args], env=_env(), start_new_session=True, stderr=subprocess.PIPE
    )
    try:
        if kill_after is None:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err.decode()[-3000:]
            return
        deadline = time.monotonic() + 240
        while not kill_after.exists():
            assert proc.poll() is None, f"the run ended before its checkpoint: {proc.stderr.read().decode()[-3000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL, "the run was still going when it was killed"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()


def _batches(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("workers", "sampler", "mode"),
    [(0, "shuffle", "bfd"), (2, "shuffle", "concat"), (0, "node", "concat"), (2, "node", "bfd")],
)
def test_a_packed_run_killed_after_batch_k_resumes_with_exactly_the_remaining_batches(
    workers: int, sampler: str, mode: str, cache_dir: Path
) -> None:
    pytest.importorskip("torchdata", reason="loader(stateful=True) needs torchdata: pip install torchdata")
    path = cache_dir / "c.mmc"
    whole = make_loader(str(cache_dir / "whole.mmc"), workers, sampler, mode)
    expected = [json.loads(json.dumps(rows(batch))) for batch in whole]
    assert len(expected) > K + 2
    checkpoint, saved = cache_dir / "state.pt", cache_dir / "saved"
    killed, resumed = cache_dir / "killed.jsonl", cache_dir / "resumed.jsonl"
    common = ["--path", str(path), "--workers", str(workers), "--sampler", sampler, "--mode", mode]
    extra = ["--checkpoint", str(checkpoint), "--saved", str(saved)]
    _run([*common, *extra, "--out", str(killed), "--save-at", str(K)], kill_after=saved)
    _run([*common, *extra, "--out", str(resumed), "--resume"])
    assert _batches(killed)[:K] + _batches(resumed) == expected


if __name__ == "__main__":
    main()
