"""`dflash cache ls` and `dflash cache clear`: the disk cache's snapshots listed (model, dtype,
tokens, size, last use) and removed without a server, the folder named by --disk-dir or by a
config's [cache] disk_dir."""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash.cli import main
from dflash.engine.disk_cache import SUFFIX, encode

IDENTITY = {"weights": "w", "dtype": "bfloat16", "max_ctx": 128, "template": "t"}
ROOT = Path(__file__).parents[2]


def write_snapshot(folder: Path, name: str, tokens: int, model: str = "smollm2-135m-instruct",
                   age_s: float = 0.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    keys = torch.zeros(2, 1, tokens, 4)
    path = folder / f"{name}{SUFFIX}"
    path.write_bytes(encode(IDENTITY, list(range(tokens)), {"keys": keys, "values": keys}, model))
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def test_ls_lists_model_tokens_size_and_age_newest_first(tmp_path, capsys):
    old = write_snapshot(tmp_path, "a" * 32, tokens=12, age_s=7200)
    new = write_snapshot(tmp_path, "b" * 32, tokens=30, model="")
    truncated = tmp_path / f"{'c' * 32}{SUFFIX}"
    truncated.write_bytes(b"\x05\x00")
    os.utime(truncated, (time.time() - 60, time.time() - 60))
    assert main(["cache", "ls", "--disk-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    total = old.stat().st_size + new.stat().st_size + 2
    assert out[0] == f"{tmp_path}: 3 snapshots, {total / 1024:.1f} KiB"
    assert out[1].split() == ["MODEL", "DTYPE", "TOKENS", "SIZE", "LAST", "USED", "FILE"]
    newest, oldest_readable = out[2].split(), next(line for line in out if old.name in line).split()
    assert newest[:3] == ["-", "bfloat16", "30"] and newest[-1] == new.name
    assert oldest_readable[:3] == ["smollm2-135m-instruct", "bfloat16", "12"]
    assert "2h ago" in " ".join(oldest_readable)
    assert any("unreadable: truncated before the header" in line for line in out)


def test_clear_removes_the_snapshots_and_abandoned_writes(tmp_path, capsys):
    first = write_snapshot(tmp_path, "a" * 32, tokens=8)
    write_snapshot(tmp_path, "b" * 32, tokens=8)
    leftover = tmp_path / f".{'d' * 32}.{os.uname().nodename}.999999999.tmp"  # no such process
    leftover.write_bytes(b"partial")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("kept")
    removed_bytes = 2 * first.stat().st_size + len(b"partial")
    assert main(["cache", "clear", "--disk-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{tmp_path}: removed 2 snapshots, {removed_bytes / 1024:.1f} KiB\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]
    assert main(["cache", "ls", "--disk-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path}: 0 snapshots")


def test_the_folder_comes_from_a_config_file(tmp_path, capsys):
    folder = tmp_path / "kv"
    write_snapshot(folder, "a" * 32, tokens=5)
    config = tmp_path / "server.toml"
    config.write_text(f'[cache]\ndisk_dir = "{folder}"\n')
    assert main(["cache", "ls", str(config)]) == 0
    assert capsys.readouterr().out.startswith(f"{folder}: 1 snapshots")
    assert main(["cache", "ls", str(config), "--disk-dir", str(tmp_path / "elsewhere")]) == 0
    assert "does not exist" in capsys.readouterr().out


def test_errors_name_the_bad_value(tmp_path, capsys):
    memory_only = tmp_path / "memory.toml"
    memory_only.write_text("[cache]\nprefix_cache_slots = 4\n")
    assert main(["cache", "ls", str(memory_only)]) == 2
    assert f"{memory_only} sets no [cache] disk_dir" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache]\ndisk_dir = 5\n")
    assert main(["cache", "clear", str(bad)]) == 2
    assert "cache.disk_dir: expected a string, got 5" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["cache", "ls", "--disk-dir", str(a_file)]) == 2
    assert f"{str(a_file)!r} is not a folder" in capsys.readouterr().err
    assert main(["cache", "ls"]) == 2
    assert "--disk-dir DIR" in capsys.readouterr().err


def test_the_command_runs_as_a_program(tmp_path):
    write_snapshot(tmp_path, "a" * 32, tokens=3)
    done = subprocess.run([sys.executable, "-m", "dflash.cli", "cache", "ls", "--disk-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "smollm2-135m-instruct" in done.stdout and f"{'a' * 32}{SUFFIX}" in done.stdout


def test_an_engine_whose_snapshots_were_cleared_computes_the_prefix_and_keeps_writing(tmp_path):
    from dflash.engine.disk_cache import DiskCache, remove_snapshots
    from dflash.engine.generate import Engine
    from dflash.engine.prefix_cache import PrefixCache
    from dflash.engine.sampling import SamplingParams
    from tests.model.tiny import ours_from_hf, tiny_hf_model

    disk = DiskCache(tmp_path, max_bytes=1 << 30, identity=IDENTITY)
    engine = Engine(ours_from_hf(tiny_hf_model("llama")), max_ctx=128, prefix_cache=PrefixCache(4, 1 << 30),
                    disk_cache=disk, reuse_live_state=False)
    conversation = [5, 9, 33, 2, 7, 100, 4, 61, 12, 90, 3, 8]
    engine.start(conversation, SamplingParams(), max_tokens=2, snapshot_at=(8,)).run()
    disk.flush()
    assert remove_snapshots(tmp_path)[0] == 1
    engine.prefix_cache.clear()  # as after a restart: only the disk tier could serve the prefix
    generation = engine.start(conversation[:8] + [44, 45], SamplingParams(), max_tokens=2, snapshot_at=(8,))
    generation.run()
    disk.flush()
    disk.close()
    assert generation.stats.cached_tokens == 0
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1  # written again: the cache still works
