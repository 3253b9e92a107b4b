"""kill -9 while the disk cache is writing: after a restart on the same folder no damaged entry
is served (every reply restored from disk equals a cold one), the interrupted writes' leftovers
are gone, and the folder is within its budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from dflash.engine.disk_cache import SUFFIX, TEMPORARY_SUFFIX, DiskCache, decode
from dflash.engine.generate import Engine
from dflash.engine.sampling import SamplingParams
from tests.model.disk_cache_writer import IDENTITY, MAX_TOKENS, engine_over, prompt
from tests.model.tiny import ours_from_hf, tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 4 << 20  # a few dozen snapshots: the writer trims as it goes
KILLS = 2
SERVED_BEFORE_KILL = 10


def run_and_kill(folder: Path, served_before: int) -> list[int]:
    """A writer process, killed with SIGKILL once it has served `served_before` more prompts."""
    child = subprocess.Popen([sys.executable, "-m", "tests.model.disk_cache_writer", str(folder), str(BUDGET)],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    served = []
    try:
        for line in child.stdout:
            if not line.strip().isdigit():
                continue  # the writer's log lines
            served.append(int(line))
            if len(served) >= served_before:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)  # reaped: a zombie would still look alive
    return served


def test_kill_9_while_writing_never_serves_a_damaged_entry(tmp_path):
    served = []
    for kill in range(KILLS):
        served = run_and_kill(tmp_path, SERVED_BEFORE_KILL * (kill + 1))
        # What a writer killed mid-write leaves: its temporary file, cut short.
        (tmp_path / f".{'0' * 32}.{os.uname().nodename}.999999{TEMPORARY_SUFFIX}").write_bytes(b"\0" * 100)
    assert served, "the writer served nothing"
    model = ours_from_hf(tiny_hf_model("llama"))
    engine, disk = engine_over(tmp_path, BUDGET, model)
    assert not list(tmp_path.glob(f".*{TEMPORARY_SUFFIX}"))
    files = list(tmp_path.glob(f"*{SUFFIX}"))
    assert files and sum(path.stat().st_size for path in files) <= BUDGET
    for path in files:
        decode(path, IDENTITY)  # every indexed file is whole
    cold = Engine(model, max_ctx=256)
    restored = 0
    for index in reversed(served):  # newest first: the oldest were trimmed away
        reply = engine.start(prompt(index), SamplingParams(), MAX_TOKENS)  # no new snapshots written
        tokens = reply.run()
        restored += reply.stats.cached_tokens > 0
        assert tokens == cold.start(prompt(index), SamplingParams(), MAX_TOKENS).run()
    assert restored, "no prompt was restored from disk"
    disk.close()


def test_a_live_writers_temporary_file_is_kept(tmp_path):
    mine = tmp_path / f".{'1' * 32}.{os.uname().nodename}.{os.getppid()}{TEMPORARY_SUFFIX}"
    mine.write_bytes(b"\0" * 10)
    DiskCache(tmp_path, max_bytes=1 << 20, identity=IDENTITY).close()
    assert mine.exists()
