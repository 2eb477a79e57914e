"""The `mmapcache` console script, run for real in subprocesses against real cache files and holders."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _caches import DAY, Holder, age, make_cache

import mmapcache
import mmapcache.cli
from mmapcache import Cache, Field
from mmapcache._file.validate import read_header

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = shutil.which("mmapcache")
COMMANDS = ["ls", "info", "verify", "rm", "gc", "df", "budget"]


@pytest.fixture(autouse=True)
def _console_script_installed() -> None:
    # Not a skip: the README's test command installs the package, script included.
    assert SCRIPT is not None, "the mmapcache console script is not on PATH: run `pip install -e .` first"


def run(*args: str, env_dir: Path | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed console script; user errors must never show a traceback."""
    env = dict(os.environ)
    if env_dir is not None:
        env["MMAPCACHE_DIR"] = str(env_dir)
    assert SCRIPT is not None
    result = subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.fixture
def hold() -> Iterator[object]:
    """``hold(path)`` starts a process that keeps the cache open; all are SIGKILLed at the end."""
    started: list[Holder] = []

    def start(path: Path) -> Holder:
        started.append(Holder(path))
        return started[-1]

    yield start
    for holder in started:
        holder.kill()


# -- help and usage -------------------------------------------------------------------------


def test_help() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert command in result.stdout
    assert "exit status" in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_each_command_has_an_example(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The console script's own start is test_help's: here the parser's help, in this process.
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as done:
        mmapcache.cli.main([command, "--help"])
    assert done.value.code == 0
    stdout = capsys.readouterr().out
    assert f"usage: mmapcache {command}" in stdout
    assert f"examples:\n  mmapcache {command}" in stdout


def test_python_dash_m() -> None:
    result = subprocess.run([sys.executable, "-m", "mmapcache", "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.startswith("mmapcache ")


def test_usage_errors_exit_2() -> None:
    assert run().returncode == 2
    assert run("frobnicate").returncode == 2
    result = run("gc", "--older-than", "soon")
    assert result.returncode == 2
    assert "cannot read 'soon' as a duration" in result.stderr


def test_exit_statuses_are_stated_once_and_match_what_gc_does(cache_dir: Path, hold: object) -> None:
    """--help, the cli docstring and docs/operating.md state EXIT_STATUSES, and gc keeping a cache in use exits 0."""
    path = make_cache(cache_dir / "a.mmc")
    hold(path)  # type: ignore[operator]
    age(path, 30 * DAY)
    status = run("gc", str(cache_dir)).returncode
    assert status == mmapcache.cli.EXIT_OK
    assert "gc: also when it kept caches in use" in mmapcache.cli.EXIT_STATUSES[status]
    text = mmapcache.cli.exit_status_text()
    assert f"exit status:\n{text}\n" in run("--help").stdout
    assert f"Exit status:\n\n{text}\n" in (mmapcache.cli.__doc__ or "")
    assert f"the exit status is still {status}." in " ".join(run("gc", "--help").stdout.split())
    guide = GUIDE.read_text(encoding="utf-8")
    table = guide[guide.index("| status | meaning |") :].splitlines()[2:]
    rows = [line for line in table if line.startswith("|")]
    assert rows == [f"| {code} | {meaning} |" for code, meaning in mmapcache.cli.EXIT_STATUSES.items()]


# -- ls -------------------------------------------------------------------------------------


def test_ls_table(cache_dir: Path) -> None:
    make_cache(cache_dir / "train.mmc", filled=4, key="cifar-v1")
    result = run("ls", str(cache_dir))
    assert result.returncode == 0
    header, row, footer = result.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "SIZE", "FILLED"]
    assert row.startswith("train.mmc")
    assert "4/10 (40%)" in row
    assert "'cifar-v1'" in row
    assert "image 3x4x4 uint8, label int64" in row
    # Made a moment ago: "just now" under a second, a few seconds when the machine is loaded.
    assert re.search(r"just now|\b([1-9]|[1-5]\d)s ago", row), row
    assert footer.startswith("1 cache, ")
    assert str(cache_dir) in footer


def test_ls_defaults_to_mmapcache_dir(cache_dir: Path) -> None:
    make_cache(cache_dir / "a.mmc")
    assert "a.mmc" in run("ls", env_dir=cache_dir).stdout
    assert run("ls", env_dir=cache_dir / "nowhere-yet").stdout.startswith("no caches")


def test_ls_lists_corrupt_files_and_never_crashes(cache_dir: Path) -> None:
    make_cache(cache_dir / "good.mmc")
    (cache_dir / "bad.mmc").write_bytes(b"definitely not a cache file, no")
    (cache_dir / "empty.mmc").write_bytes(b"")
    (cache_dir / "link.mmc").symlink_to(cache_dir / "good.mmc")
    result = run("ls", str(cache_dir))
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    bad = next(i for i, line in enumerate(lines) if line.startswith("bad.mmc"))
    assert "CORRUPT" in lines[bad]
    assert "not an mmapcache file" in lines[bad + 1]
    assert any(line.startswith("link.mmc") and "UNSAFE" in line for line in lines)
    assert "4 caches, 3 damaged" in lines[-1]
    assert ".lock" not in result.stdout


def test_ls_json(cache_dir: Path) -> None:
    make_cache(cache_dir / "a.mmc", filled=2)
    (cache_dir / "b.mmc").write_bytes(b"junk")
    result = run("ls", str(cache_dir), "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert [(d["name"], d["status"]) for d in data] == [("a.mmc", "ok"), ("b.mmc", "corrupt")]
    assert data[0]["filled"] == 2
    assert data[0]["in_use"] is False
    assert data[1]["error"]


def test_ls_shows_holders(cache_dir: Path, hold: object) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holder = hold(path)  # type: ignore[operator]
    (row,) = [line for line in run("ls", str(cache_dir)).stdout.splitlines() if line.startswith("a.mmc")]
    assert f"yes (pid {holder.pid})" in row


def test_ls_missing_directory(cache_dir: Path) -> None:
    result = run("ls", str(cache_dir / "nope"))
    assert result.returncode == 1
    assert result.stderr.startswith("FileNotFoundError: no such directory")


# -- info -----------------------------------------------------------------------------------


def test_info_text(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "train.mmc", filled=3, key="v2")
    result = run("info", str(path))
    assert result.returncode == 0
    out = result.stdout
    for expected in (
        "format       version 2",  # fixed fields only: the lowest version that holds them
        "key          'v2'",
        "length       10 samples",
        "filled       3 of 10 slots (30.0%)",
        "image  3x4x4   uint8  48 B",
        "label  scalar  int64  8 B",
        f"by pid {os.getpid()}",
        "in use       no",
        "file system  tmpfs, ",
    ):
        assert expected in out, out


def test_info_finds_bare_names_in_the_default_dir(cache_dir: Path, tmp_path: Path) -> None:
    make_cache(cache_dir / "train.mmc")
    for name in ("train", "train.mmc"):
        result = run("info", name, env_dir=cache_dir, cwd=tmp_path)
        assert result.returncode == 0
        assert str(cache_dir / "train.mmc") in result.stdout


def test_info_json(cache_dir: Path, hold: object) -> None:
    path = make_cache(cache_dir / "a.mmc", filled=1)
    holder = hold(path)  # type: ignore[operator]
    data = json.loads(run("info", str(path), "--json").stdout)
    assert data["in_use"] is True
    assert data["pids"] == [holder.pid]
    assert data["fields"][1] == {"name": "label", "shape": [], "dtype": "int64", "nbytes": 8}


def test_info_errors(cache_dir: Path) -> None:
    result = run("info", str(cache_dir / "missing.mmc"))
    assert result.returncode == 1
    assert result.stderr.startswith("FileNotFoundError: ")
    (cache_dir / "bad.mmc").write_bytes(b"\0" * 64)
    result = run("info", str(cache_dir / "bad.mmc"))
    assert result.returncode == 1
    assert result.stderr.startswith("CacheFormatError: ")
    assert result.stdout == ""


def test_looking_does_not_make_a_cache_look_used(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc")
    age(path, 10 * DAY)
    before = os.stat(path).st_mtime
    run("ls", str(cache_dir))
    run("info", str(path))
    run("df", str(cache_dir))
    run("gc", str(cache_dir), "--dry-run")
    assert os.stat(path).st_mtime == before


# -- verify ---------------------------------------------------------------------------------


def damage_slot(path: Path, index: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        header, layout = read_header(fd, str(path))
        offset = layout.field_offsets["image"] + index * header.fields["image"].nbytes
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def test_verify_clean(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc", filled=5)
    result = run("verify", str(path))
    assert (result.returncode, result.stdout.strip()) == (0, f"{path}: clean")


def test_verify_reports_then_fixes(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc", filled=5)
    damage_slot(path, 3)
    result = run("verify", str(path))
    assert result.returncode == 1
    assert "1 problem" in result.stdout
    assert "slot 3 does not match its checksum" in result.stdout
    assert "mmapcache verify --fix" in result.stdout
    result = run("verify", "--fix", str(path))
    assert result.returncode == 1  # problems were found (and fixed)
    assert "fixed 1 of 1" in result.stdout
    assert run("verify", str(path)).returncode == 0
    with Cache.open(path, readonly=True) as cache:
        assert 3 not in cache
        assert cache.filled == 4


def test_verify_corrupt_header(cache_dir: Path) -> None:
    path = make_cache(cache_dir / "a.mmc")
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    result = run("verify", str(path))
    assert result.returncode == 1
    assert "1 problem" in result.stdout
    assert "corrupt header" in result.stdout
    garbage = cache_dir / "garbage.mmc"
    garbage.write_bytes(b"hello")
    result = run("verify", str(garbage))
    assert result.returncode == 1
    assert "not an mmapcache file" in result.stdout


def test_verify_missing(cache_dir: Path) -> None:
    result = run("verify", str(cache_dir / "missing.mmc"))
    assert result.returncode == 1
    assert result.stderr.startswith("FileNotFoundError: ")


# -- rm -------------------------------------------------------------------------------------


def test_rm(cache_dir: Path) -> None:
    a, b = make_cache(cache_dir / "a.mmc"), make_cache(cache_dir / "b.mmc")
    result = run("rm", str(a), str(b))
    assert result.returncode == 0
    assert f"removed {a}" in result.stdout
    assert f"removed {b}" in result.stdout
    assert sorted(os.listdir(cache_dir)) == []


def test_rm_refuses_a_cache_in_use_and_names_the_pid(cache_dir: Path, hold: object) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holder = hold(path)  # type: ignore[operator]
    result = run("rm", str(path))
    assert result.returncode == 1
    assert result.stderr.startswith("CacheInUseError: ")
    assert str(holder.pid) in result.stderr
    assert "--force" in result.stderr
    assert path.exists()


def test_rm_force(cache_dir: Path, hold: object) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holder = hold(path)  # type: ignore[operator]
    result = run("rm", "--force", str(path))
    assert result.returncode == 0
    assert f"removed {path}" in result.stdout
    assert str(holder.pid) in result.stderr  # the library's warning says whom it left with a nameless copy
    assert not path.exists()


def test_rm_after_the_holder_was_killed(cache_dir: Path, hold: object) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holder = hold(path)  # type: ignore[operator]
    assert run("rm", str(path)).returncode == 1
    holder.kill()
    result = run("rm", str(path))
    assert result.returncode == 0, result.stderr
    assert not path.exists()


def test_rm_keeps_going_and_fails_at_the_end(cache_dir: Path) -> None:
    good = make_cache(cache_dir / "good.mmc")
    foreign = cache_dir / "notes.mmc"
    foreign.write_text("my precious notes")
    result = run("rm", str(cache_dir / "missing.mmc"), str(foreign), str(good))
    assert result.returncode == 1
    errors = result.stderr.splitlines()
    assert errors[0].startswith("FileNotFoundError: ")
    assert errors[1].startswith("CacheFormatError: ")
    assert "refusing to delete it" in errors[1]
    assert f"removed {good}" in result.stdout
    assert foreign.read_text() == "my precious notes"


def test_rm_removes_the_lock_file_a_cache_deleted_by_hand_left(cache_dir: Path, tmp_path: Path) -> None:
    for name, argument in (("a.mmc", str(cache_dir / "a.mmc")), ("b.mmc", "b"), ("c.mmc", "c.mmc.lock")):
        os.unlink(make_cache(cache_dir / name))  # plain `rm`: the lock file stays
        result = run("rm", argument, env_dir=cache_dir, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"removed {cache_dir / name}.lock (the lock file of a cache that does not exist)\n"
    assert os.listdir(cache_dir) == []
    result = run("rm", str(cache_dir / "a.mmc"))  # nothing left at all
    assert result.returncode == 1
    assert result.stderr.startswith("FileNotFoundError: ")


def test_rm_refuses_the_lock_file_of_a_cache_that_exists(cache_dir: Path) -> None:
    make_cache(cache_dir / "a.mmc")
    result = run("rm", str(cache_dir / "a.mmc.lock"))
    assert result.returncode == 1
    assert result.stderr.startswith("FileExistsError: ")
    assert "`mmapcache rm`" in result.stderr
    assert sorted(os.listdir(cache_dir)) == ["a.mmc", "a.mmc.lock"]


@pytest.mark.timeout(60)
def test_info_ls_rm_refuse_sockets_fifos_and_directories(cache_dir: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(cache_dir / "socket.mmc"))
    os.mkfifo(cache_dir / "fifo.mmc")
    (cache_dir / "dir.mmc").mkdir()
    try:
        before = {name: os.lstat(cache_dir / name) for name in os.listdir(cache_dir)}
        for name in before:
            for command in ("info", "rm"):
                result = run(command, str(cache_dir / name))
                assert result.returncode == 1, (command, name)
                assert result.stderr.startswith("UnsafeCacheFileError: "), (command, name, result.stderr)
                assert "not a regular file" in result.stderr
        result = run("ls", str(cache_dir))
        assert result.returncode == 0
        assert re.search(r"^socket\.mmc .* UNSAFE ", result.stdout, re.M)
        assert re.search(r"^fifo\.mmc .* UNSAFE ", result.stdout, re.M)
        assert run("gc", str(cache_dir), "--older-than", "0").returncode == 0
        after = {name: os.lstat(cache_dir / name) for name in os.listdir(cache_dir)}
        assert before.keys() == after.keys()
        assert all(os.path.samestat(before[name], after[name]) for name in before)
    finally:
        server.close()


# -- gc -------------------------------------------------------------------------------------


def test_gc_old_and_new(cache_dir: Path) -> None:
    old, new = make_cache(cache_dir / "old.mmc"), make_cache(cache_dir / "new.mmc")
    age(old, 8 * DAY)
    age(new, 6 * DAY)
    result = run("gc", str(cache_dir), "--dry-run")
    assert result.returncode == 0
    assert "would remove old.mmc" in result.stdout
    assert "new.mmc" not in result.stdout
    assert old.exists()
    result = run("gc", str(cache_dir))
    assert result.returncode == 0
    assert re.search(r"^removed old\.mmc .* last used 1w ago$", result.stdout, re.M)
    assert "freed " in result.stdout
    assert not old.exists()
    assert new.exists()
    result = run("gc", str(cache_dir), "--older-than", "5d")
    assert "removed new.mmc" in result.stdout
    assert not new.exists()


def test_gc_nothing_to_do(cache_dir: Path) -> None:
    make_cache(cache_dir / "a.mmc")
    result = run("gc", env_dir=cache_dir)
    assert result.returncode == 0
    assert "nothing to remove" in result.stdout


def test_gc_refuses_a_cache_in_use(cache_dir: Path, hold: object) -> None:
    path = make_cache(cache_dir / "a.mmc")
    holder = hold(path)  # type: ignore[operator]
    age(path, 30 * DAY)
    result = run("gc", str(cache_dir))
    assert result.returncode == 0  # keeping a cache in use is not a failure (nightly cron)
    assert f"kept a.mmc: in use by pid {holder.pid}" in result.stdout
    assert path.exists()
    holder.kill()
    result = run("gc", str(cache_dir))
    assert result.returncode == 0
    assert "removed a.mmc" in result.stdout
    assert not path.exists()


def test_gc_lists_and_removes_orphan_lock_files(cache_dir: Path) -> None:
    os.unlink(make_cache(cache_dir / "gone.mmc"))
    age(cache_dir / "gone.mmc.lock", 8 * DAY)
    result = run("gc", str(cache_dir), "--dry-run")
    assert result.returncode == 0
    assert re.search(
        r"^would remove gone\.mmc\.lock  0 B  lock file of a cache that no longer exists", result.stdout, re.M
    )
    assert (cache_dir / "gone.mmc.lock").exists()
    data = json.loads(run("gc", str(cache_dir), "--json").stdout)
    assert [(item["path"], item["kind"]) for item in data["removed"]] == [(str(cache_dir / "gone.mmc.lock"), "lock")]
    assert os.listdir(cache_dir) == []


def test_gc_json(cache_dir: Path) -> None:
    age(make_cache(cache_dir / "a.mmc"), 2 * DAY)
    data = json.loads(run("gc", str(cache_dir), "--older-than", "1d", "--json").stdout)
    assert [item["path"] for item in data["removed"]] == [str(cache_dir / "a.mmc")]
    assert data["freed"] > 0
    assert data["kept"] == []


# -- df -------------------------------------------------------------------------------------


def test_df(cache_dir: Path) -> None:
    make_cache(cache_dir / "a.mmc")
    result = run("df", env_dir=cache_dir)
    assert result.returncode == 0
    assert f"location     {cache_dir}" in result.stdout
    assert "file system  tmpfs" in result.stdout
    assert "caches       1 file, " in result.stdout
    data = json.loads(run("df", str(cache_dir), "--json").stdout)
    assert data["caches"] == 1
    assert data["filesystem"] == "tmpfs"
    assert data["free"] <= data["total"]


def test_df_warns_about_leftovers(cache_dir: Path) -> None:
    (cache_dir / "a.mmc.tmp-1-00").write_bytes(b"x" * 4096)
    result = run("df", str(cache_dir))
    assert "leftovers    1 temporary file(s)" in result.stdout
    assert "warning: 1 temporary file(s)" in result.stdout


# -- budget ---------------------------------------------------------------------------------


def test_budget_sets_shows_and_unsets_the_budget_of_a_directory(cache_dir: Path) -> None:
    result = run("budget", str(cache_dir), "--set", "8MiB", "--reclaim-unused-after", "7d")
    assert result.returncode == 0, result.stderr
    assert (cache_dir / ".mmapcache-budget").is_file()
    make_cache(cache_dir / "a.mmc")
    shown = run("budget", env_dir=cache_dir)
    assert shown.returncode == 0
    assert f"directory  {cache_dir}" in shown.stdout
    assert "budget     8.0 MiB (set in " in shown.stdout
    assert "caches nobody has open and unused for 7d are removed" in shown.stdout
    header, row = shown.stdout.splitlines()[-2:]
    assert header.split() == ["NAME", "BYTES", "SHARE", "IN", "USE", "LAST", "USED"]
    assert row.startswith("a.mmc ")
    data = json.loads(run("budget", str(cache_dir), "--json").stdout)
    assert data["limit"] == 8 * 2**20
    assert data["reclaim_unused_after"] == 7 * 86400
    assert [entry["path"] for entry in data["caches"]] == [str(cache_dir / "a.mmc")]
    assert data["used"] == data["limit"] - data["free"] - data["reserved"]
    assert {"bytes", "in_use", "last_used"} <= set(data["caches"][0])
    assert run("budget", str(cache_dir), "--unset").returncode == 0
    assert not (cache_dir / ".mmapcache-budget").exists()


def test_budget_refuses_a_size_it_cannot_read(cache_dir: Path) -> None:
    result = run("budget", str(cache_dir), "--set", "lots")
    assert result.returncode == mmapcache.cli.EXIT_USAGE
    assert "cannot read SIZE 'lots' as a byte size" in result.stderr


def test_ls_and_df_show_each_cache_s_share_of_the_budget(cache_dir: Path) -> None:
    mmapcache.set_budget(cache_dir, "4MiB")
    make_cache(cache_dir / "a.mmc")
    share = f"{100 * (os.stat(cache_dir / 'a.mmc').st_blocks * 512) / 2**22:.0f}%"
    listed = run("ls", str(cache_dir)).stdout.splitlines()
    assert "BUDGET" in listed[0].split()
    assert f"  {share}  " in listed[1]
    assert "; budget 4.0 MiB (set in " in listed[-1]
    df = run("df", str(cache_dir)).stdout
    assert "budget       4.0 MiB (set in " in df
    assert f"{share} of the budget" in df
    assert json.loads(run("df", str(cache_dir), "--json").stdout)["budget"]["limit"] == 2**22


# -- the operating guide: its examples run --------------------------------------------------

GUIDE = ROOT / "docs" / "operating.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def guide_blocks() -> list[tuple[str, str]]:
    return [(match.group(1), match.group(2)) for match in FENCE.finditer(GUIDE.read_text())]


def test_guide_examples_run(cache_dir: Path, tmp_path: Path) -> None:
    """Every ``console`` command and ``python`` block of docs/operating.md runs, in order, and succeeds."""
    env = {**os.environ, "MMAPCACHE_DIR": str(cache_dir)}
    ran = 0
    for language, body in guide_blocks():
        if language == "python":
            commands = [[sys.executable, "-c", body]]
        elif language == "console":
            lines = [line[2:] for line in body.splitlines() if line.startswith("$ ")]
            commands = [["bash", "-c", line] for line in lines]
        elif language == "bash":
            commands = [["bash", "-n", "-c", body]]  # docker and job scripts: syntax only
        elif language == "crontab":
            entries = [line.split(None, 5)[5] for line in body.splitlines() if not line.startswith("#")]
            commands = [["bash", "-n", "-c", entry] for entry in entries]
        else:
            assert language == "yaml", f"a {language!r} block in the guide is neither run nor checked"
            try:
                import yaml  # type: ignore[import-untyped]  # optional: checked when installed
            except ImportError:
                continue
            assert isinstance(yaml.safe_load(body), dict)
            continue
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
            assert result.returncode == 0, f"{command[-1]}\n{result.stdout}\n{result.stderr}"
            assert "Traceback" not in result.stderr
            ran += 1
    assert ran >= 10
    assert os.listdir(cache_dir) == []  # the guide cleans up after itself


def test_info_shows_reads_across_processes(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, {"x": Field((4,), "u1")}, length=8) as cache:
        cache.put(0, {"x": [1] * 4})
        cache.get(0), cache.get(3)
        shown = run("info", str(path))
    assert shown.returncode == 0, shown.stderr
    assert "1 hits, 1 misses (50.0% hits), 1 slots written, by all processes" in shown.stdout
    assert f"pid {os.getpid()}: 1 hits, 1 misses, 1 written" in shown.stdout


def test_info_and_ls_show_how_full_the_variable_region_is(cache_dir: Path) -> None:
    path = cache_dir / "tokens.mmc"
    with Cache.open(path, {"tokens": Field((None,), "int32")}, length=64, max_bytes="1MiB") as cache:
        for i in range(10):
            cache.put(i, {"tokens": np.arange(100 + i, dtype=np.int32)})
        region = cache.variable_region
        assert region is not None
        shown = run("info", str(path))
        listed = run("ls", str(cache_dir))
        as_json = json.loads(run("info", "--json", str(path)).stdout)
    assert shown.returncode == 0, shown.stderr
    assert "variable region" in shown.stdout
    assert "tokens  *      int32  variable" in shown.stdout
    assert f"claimed ({100 * region.claimed / region.size:.1f}%)" in shown.stdout
    assert "% claimed" in listed.stdout
    used = 4 * sum(range(100, 110))
    assert as_json["variable"] == {
        "size": region.size,
        "claimed": region.claimed,
        "used": used,
        "free": region.free,
        "refused": 0,
    }


def test_info_says_which_processes_it_cannot_show_the_reads_of(cache_dir: Path, hold: Any) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, {"x": Field((4,), "u1")}, length=8) as cache:
        cache.get(3)
        reader = hold(path)  # a readonly handle counts only in its own process
        shown = run("info", str(path))
        as_json = json.loads(run("info", "--json", str(path)).stdout)
    assert shown.returncode == 0, shown.stderr
    assert "by all processes" not in shown.stdout
    assert f"1 more process has it open and counts only in itself (pid {reader.pid}: readonly" in shown.stdout
    assert as_json["uncounted_pids"] == [reader.pid]


def test_ls_and_info_show_a_refuted_cache(cache_dir: Path) -> None:
    path = cache_dir / "c.mmc"
    with Cache.open(path, {"x": Field((4,), "u1")}, length=8) as cache:
        cache.refute()
    shown, listed = run("info", str(path)), run("ls", str(cache_dir))
    assert shown.returncode == 0, shown.stderr
    assert listed.returncode == 0, listed.stderr
    assert "refuted" in shown.stdout
    assert "do not fit" in shown.stdout
    assert "refuted" in listed.stdout
    assert json.loads(run("info", "--json", str(path)).stdout)["refuted"] is True
    assert mmapcache.info(path).refuted
    other = cache_dir / "d.mmc"
    Cache.open(other, {"x": Field((4,), "u1")}, length=8).close()
    assert "refuted" not in run("info", str(other)).stdout
    assert not mmapcache.info(other).refuted


def test_info_shows_how_many_stores_the_variable_budget_refused(cache_dir: Path) -> None:
    path = cache_dir / "full.mmc"
    with Cache.open(path, {"tokens": Field((None,), "uint8")}, length=64, max_bytes=64 * 16 + 8192) as cache:
        stored = [cache.put(i, {"tokens": np.zeros(3000, np.uint8)}) for i in range(6)]
        region = cache.variable_region
        assert region is not None
        assert stored.count(False) == region.refused > 0
    with Cache.open(path) as other:  # the count is in the file: every process sees it
        again = other.variable_region
        assert again is not None
        assert again.refused == region.refused
    shown = run("info", str(path))
    assert shown.returncode == 0, shown.stderr
    assert f"{region.refused} stores refused for lack of room" in shown.stdout
    assert json.loads(run("info", "--json", str(path)).stdout)["variable"]["refused"] == region.refused
