"""Prefix-cache snapshots on disk, so a conversation survives a restart.

One file per snapshot: an 8-byte little-endian header length, a JSON header (format, model identity,
the snapshot's tokens, a tensor table, the payload's SHA-256) and the raw tensor bytes. A file whose
identity differs (another model, dtype, context size or chat template), whose checksum fails or that
is truncated or unreadable is skipped with a warning and removed: never served, never a crash.

A snapshot built on another (kv.KVSnapshot's base) whose base is on disk holds only its own
positions, its header names the base's file ("base": name and token count) and its format is
BASED_FORMAT, which servers from before bases do not read: an agent's turn
writes the few dozen tokens it added, not the whole conversation again (two 460 MB files a turn at
20K tokens). Reading it reads its base first; a file whose base is gone is skipped like a damaged
one, and the trim removes a file's dependents with it. Chains are at most KVSnapshot.MAX_CHAIN long.

Writes happen off the request path: the engine thread only queues the snapshot's tensors (copies
already, shared with the memory prefix cache), and a writer thread checksums them and puts them on
disk atomically (temporary file + rename) straight from the tensors' memory, then trims the folder to
its byte budget, oldest first. Encoding on the engine thread (three copies of the payload and its
SHA-256) held the engine 2.2-2.5 s per 20K-token snapshot, several a turn (bench/snapshot_store.py).
The writer runs at background priority (`run_in_background`), so it does not slow the engine either. A folder
that cannot be written is reported once; serving goes on from memory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import attrs
import structlog
import torch
from torch import Tensor

from dflash.engine.kv import KVSnapshot

FORMAT = "dflash-kv-1"
# A file written on a base holds fewer positions than tokens: a server from before bases would take it
# for a whole snapshot (one position broadcast over all of them), so it says another format, which
# that server skips and removes.
BASED_FORMAT = "dflash-kv-2"
SUFFIX = ".dkv"
TEMPORARY_SUFFIX = ".tmp"
# A temporary file of another machine sharing the folder is taken as abandoned after this long.
FOREIGN_WRITE_S = 3600.0
log = structlog.get_logger("dflash.disk_cache")


@attrs.frozen
class DiskEntry:
    tokens: tuple[int, ...]
    path: Path
    nbytes: int  # the file's size
    base: str | None = None  # the name of the file holding its first positions, if not itself


@attrs.frozen
class LoadedSnapshot:
    tokens: tuple[int, ...]
    snapshot: KVSnapshot
    draft_rows: tuple[Tensor, ...] | None  # one piece


def tokens_name(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).hexdigest()[:32]


def flat_bytes(t: Tensor) -> memoryview:
    """The tensor's bytes, without a copy where it is contiguous on the CPU."""
    return memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy().reshape(-1))


def as_pieces(value: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """A tensor, or one in pieces (a list), as a list of pieces."""
    return [value] if isinstance(value, Tensor) else list(value)


def joined_bytes(pieces: Sequence[Tensor], dim: int) -> tuple[list[int], list[memoryview]]:
    """The shape and bytes of `pieces` joined along `dim`, 0 (draft rows) or 2 (a KVSnapshot
    chain's positions: [layers, KV, positions, ...]), in the joined tensor's memory order, without
    making the joined tensor."""
    shape = list(pieces[0].shape)
    shape[dim] = sum(piece.shape[dim] for piece in pieces)
    if len(pieces) == 1 or dim == 0:
        return shape, [flat_bytes(piece) for piece in pieces]
    pieces = [piece.contiguous() for piece in pieces if piece.shape[2]]
    return shape, [flat_bytes(piece[layer, head]) for layer in range(shape[0]) for head in range(shape[1]) for piece in pieces]


def write_snapshot(out: BinaryIO, identity: dict[str, Any], tokens: Sequence[int],
                   tensors: dict[str, Tensor | Sequence[Tensor]], model: str = "", base: dict[str, Any] | None = None) -> int:
    """Write one snapshot file's bytes to `out` from the tensors' memory; returns how many. A list
    is a tensor in pieces (`joined_bytes`: draft rows along dim 0, the rest along dim 2), written
    as the joined tensor.
    `model`: the served model's name, for `dflash cache ls` (not part of the identity). `base`:
    {"name", "tokens"} of the file holding the first positions, the tensors holding the rest."""
    table, chunks, offset = [], [], 0
    digest = hashlib.sha256()
    for name, t in tensors.items():
        pieces = as_pieces(t)
        shape, data = joined_bytes(pieces, 0 if name == "draft_rows" else 2)
        nbytes = 0
        for chunk in data:
            digest.update(chunk)
            nbytes += chunk.nbytes
        table.append({"name": name, "dtype": str(pieces[0].dtype).removeprefix("torch."), "shape": shape,
                      "offset": offset, "nbytes": nbytes})
        chunks += data
        offset += nbytes
    fields = {"format": FORMAT if base is None else BASED_FORMAT, "model": model, "identity": identity, "tokens": list(tokens), "tensors": table,
              "sha256": digest.hexdigest()}
    header = json.dumps(fields if base is None else fields | {"base": base}).encode()
    out.write(struct.pack("<Q", len(header)))
    out.write(header)
    for data in chunks:
        out.write(data)
    return 8 + len(header) + offset


def encode(identity: dict[str, Any], tokens: Sequence[int], tensors: dict[str, Tensor | Sequence[Tensor]], model: str = "") -> bytes:
    """A snapshot file's bytes (write_snapshot into memory)."""
    out = io.BytesIO()
    write_snapshot(out, identity, tokens, tensors, model)
    return out.getvalue()


class CorruptSnapshot(ValueError):
    pass


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptSnapshot("truncated before the header")
        (length,) = struct.unpack("<Q", raw)
        if length > 64 << 20:
            raise CorruptSnapshot(f"header length {length} is implausible")
        data = f.read(length)
    if len(data) != length:
        raise CorruptSnapshot("truncated inside the header")
    try:
        header = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptSnapshot(f"unreadable header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") not in (FORMAT, BASED_FORMAT):
        raise CorruptSnapshot(f"not a {FORMAT} or {BASED_FORMAT} file")
    if (header["format"] == BASED_FORMAT) != ("base" in header):
        raise CorruptSnapshot(f"a {header['format']} file {'without' if 'base' not in header else 'with'} a base")
    return header, 8 + length


READ_CHUNK = 64 << 20


def read_checked(path: Path, start: int, sha256: Any) -> bytearray:
    """The file's bytes from `start`, read straight into the buffer the tensors will view, its
    SHA-256 checked against `sha256`. Each chunk is hashed on a second thread while the next is read
    (hashlib lets go of the GIL): at 20K tokens a 577 MB payload took ~2 s to read, hash and copy
    per tensor, the most of a restarted server's first turn (bench/first_turn.py)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, ThreadPoolExecutor(1) as hasher:
        size = os.fstat(f.fileno()).st_size - start
        payload = bytearray(max(size, 0))
        view = memoryview(payload)
        f.seek(start)
        hashed = []
        for at in range(0, len(payload), READ_CHUNK):
            chunk = view[at : at + READ_CHUNK]
            if f.readinto(chunk) != len(chunk):
                raise CorruptSnapshot("truncated payload")
            hashed.append(hasher.submit(digest.update, chunk))
        for done in hashed:
            done.result()
    if digest.hexdigest() != sha256:
        raise CorruptSnapshot("checksum mismatch (truncated or damaged payload)")
    return payload


def base_of(header: dict[str, Any]) -> tuple[str, int] | None:
    """(file name, token count) of the base a header names, or None."""
    base = header.get("base")
    if base is None:
        return None
    if not isinstance(base, dict) or not isinstance(base.get("name"), str) or not isinstance(base.get("tokens"), int):
        raise CorruptSnapshot(f"unreadable base {base!r}")
    return base["name"], base["tokens"]


def decode(path: Path, identity: dict[str, Any], used: list[Path] | None = None, depth: int = 1) -> LoadedSnapshot:
    """The snapshot of a file, its base's first (`used`: every file read is appended; `depth`:
    this file's place in the chain, from the file asked for)."""
    header, start = read_header(path)
    if header.get("identity") != identity:
        raise CorruptSnapshot("made by another model, dtype, context size or chat template")
    tokens = tuple(header["tokens"])
    base, base_rows = None, None
    if (named := base_of(header)) is not None:
        name, count = named
        if depth >= KVSnapshot.MAX_CHAIN or not 0 < count < len(tokens) or Path(name).name != name:
            raise CorruptSnapshot(f"base {name!r} of {count} tokens is not a shorter snapshot in the folder")
        try:
            loaded = decode(path.with_name(f"{name}{SUFFIX}"), identity, used, depth + 1)
        except FileNotFoundError:
            raise CorruptSnapshot(f"its base {name} is gone") from None
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(f"its base {name}: {exc}") from None
        if loaded.tokens != tokens[:count]:
            raise CorruptSnapshot(f"its base {name} holds other tokens")
        base, base_rows = loaded.snapshot, loaded.draft_rows
    payload = read_checked(path, start, header.get("sha256"))
    tensors: dict[str, Tensor] = {}
    for entry in header["tensors"]:
        offset, nbytes, dtype = entry["offset"], entry["nbytes"], getattr(torch, entry["dtype"])
        if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset and offset + nbytes <= len(payload)):
            raise CorruptSnapshot(f"tensor {entry['name']!r} lies outside the payload")
        data = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)
        if offset % dtype.itemsize:
            data = data.clone()  # a view of another dtype must start at a multiple of its size
        tensors[entry["name"]] = data.view(dtype).reshape(entry["shape"])
    snapshot = KVSnapshot(tensors["keys"], tensors["values"], len(tokens), tensors.get("key_scales"), tensors.get("value_scales"),
                          base)
    if snapshot.keys.shape[2] != len(tokens) - snapshot.start:
        raise CorruptSnapshot(f"holds {snapshot.keys.shape[2]} positions of {len(tokens) - snapshot.start}")
    rows = tensors.get("draft_rows")
    if used is not None:
        used.append(path)
    if rows is None or (base is not None and base_rows is None):
        return LoadedSnapshot(tokens, snapshot, None)
    return LoadedSnapshot(tokens, snapshot, (*(base_rows or ()), rows))


def _abandoned(temporary: Path) -> bool:
    """A write's temporary file whose writer is gone: `.NAME.HOST.PID.tmp` of a process that no
    longer runs on this host (killed mid-write), or an old one of another host. Called before
    this process writes anything, so a file with its own pid is a dead predecessor's."""
    _, _, writer = temporary.name.removeprefix(".").removesuffix(TEMPORARY_SUFFIX).partition(".")
    host, _, pid = writer.rpartition(".")
    if host == socket.gethostname() and pid.isdigit():
        return int(pid) == os.getpid() or not _running(int(pid))
    try:
        return time.time() - temporary.stat().st_mtime > FOREIGN_WRITE_S
    except OSError:
        return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


@attrs.frozen
class StoredSnapshot:
    """One file of a disk cache folder as `dflash cache ls` shows it."""

    path: Path
    model: str  # the served model's name ("" for files written before names were recorded)
    dtype: str
    tokens: int
    nbytes: int
    last_used: float  # the file's mtime: written, or last restored
    problem: str | None = None  # why the file cannot be served, if it cannot


def stored_snapshots(folder: Path) -> list[StoredSnapshot]:
    """The snapshot files of `folder`, most recently used first; a missing folder has none."""
    found = []
    for path in folder.glob(f"*{SUFFIX}") if folder.is_dir() else ():
        try:
            stat = path.stat()
        except OSError:
            continue  # removed meanwhile
        try:
            header, _ = read_header(path)
            identity = header.get("identity") or {}
            found.append(StoredSnapshot(path, str(header.get("model") or ""), str(identity.get("dtype", "")),
                                        len(header["tokens"]), stat.st_size, stat.st_mtime))
        except (CorruptSnapshot, OSError, KeyError, TypeError, AttributeError) as exc:
            found.append(StoredSnapshot(path, "", "", 0, stat.st_size, stat.st_mtime, problem=str(exc)))
    return sorted(found, key=lambda snapshot: snapshot.last_used, reverse=True)


def remove_snapshots(folder: Path) -> tuple[int, int]:
    """Remove every snapshot file of `folder` and the leftovers of killed writers (not the
    temporary files of writes still running); returns (files, bytes) removed."""
    removed = removed_bytes = 0
    if not folder.is_dir():
        return 0, 0
    leftovers = [path for path in folder.glob(f".*{TEMPORARY_SUFFIX}") if _abandoned(path)]
    for path in [*folder.glob(f"*{SUFFIX}"), *leftovers]:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        removed += path.suffix == SUFFIX
        removed_bytes += size
    return removed, removed_bytes


def run_in_background() -> None:
    """Give the calling thread only the CPU time the engine leaves (Linux: SCHED_IDLE; elsewhere the
    lowest nice it can get, where the system has one).

    Why: the engine's kernels run on every core (2 here) and wait for each other at the end of
    each matmul, so a writer checksumming and writing a snapshot at normal priority took one of
    them and stalled the others. While turn 1's snapshots were written, the second turn of a
    9K-token Codex conversation decoded 16 tokens in 2.1 s (0.4 s at SCHED_IDLE) and that of a
    20K-token Claude Code conversation spent 3.9 s prefilling 19 tokens (0.8 s): bench/first_turn.py,
    AMX VM. Between requests the engine is idle and the writer gets whole cores.
    """
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        pass


def rows_from(pieces: Sequence[Tensor], start: int) -> list[Tensor]:
    """Rows start.. of rows in pieces one after another (along dim 0)."""
    out, offset = [], 0
    for piece in pieces:
        if offset + piece.shape[0] > start:
            out.append(piece[max(start - offset, 0) :])
        offset += piece.shape[0]
    return out


class DiskCache:
    def __init__(self, folder: str | os.PathLike | None, max_bytes: int, identity: dict[str, Any], model: str = ""):
        self.folder = Path(folder).expanduser() if folder else None
        self.max_bytes = max_bytes
        self.identity = identity
        self.model = model
        self._entries: dict[str, DiskEntry] = {}
        self.hits = 0  # snapshots restored from here (counted by the caller that restores them)
        self._write_failed = False
        self._writes: queue.Queue[tuple[str, tuple[int, ...], KVSnapshot, tuple[Tensor, ...] | None] | None] = queue.Queue(maxsize=8)
        self._writer: threading.Thread | None = None
        if self.folder is not None:
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="dflash-disk-cache", daemon=True)
            self._writer.start()

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in list(self._entries.values()))  # a copy: the writer may trim

    def _scan(self) -> None:
        """Index the files of this model; drop those that cannot be read or belong elsewhere, and
        the temporary files of writes that a killed process left behind."""
        if not self.folder.is_dir():
            return
        for path in self.folder.glob(f".*{TEMPORARY_SUFFIX}"):
            if _abandoned(path):
                log.warning("disk_cache_leftover_removed", path=str(path))
                path.unlink(missing_ok=True)
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            self._index(path)
        # A process killed between a write's rename and its trim leaves the folder over budget.
        self._trim()

    def _index(self, path: Path) -> None:
        try:
            header, _ = read_header(path)
            if header.get("identity") != self.identity:
                raise CorruptSnapshot("made by another model, dtype, context size or chat template")
            tokens = tuple(header["tokens"])
            base = base_of(header)
            size = path.stat().st_size
        except FileNotFoundError:
            return  # trimmed by another process between the listing and the read
        except (CorruptSnapshot, OSError, KeyError, TypeError) as exc:
            self._discard(path, exc)
            return
        self._entries[path.stem] = DiskEntry(tokens, path, size, None if base is None else base[0])

    def _index_new_files(self) -> None:
        """Index the snapshots other processes wrote to the folder since: the replicas of a
        cluster share one disk_dir, so a conversation that moves to another replica restores
        from the snapshot its old replica wrote. Only names not yet known cost a header read."""
        try:
            names = [entry.name for entry in os.scandir(self.folder) if entry.name.endswith(SUFFIX)]
        except OSError:
            return
        for name in names:
            if name[: -len(SUFFIX)] not in self._entries:
                self._index(self.folder / name)

    def _discard(self, path: Path, reason: Exception) -> None:
        log.warning("disk_cache_file_skipped", path=str(path), reason=str(reason))
        try:
            path.unlink()
        except OSError:
            pass

    def lookup(self, prompt: Sequence[int], deeper_than: int) -> LoadedSnapshot | None:
        """The deepest readable snapshot that is a proper prefix of `prompt` and longer than
        `deeper_than` tokens; unreadable candidates are removed on the way."""
        if self.folder is not None:
            self._index_new_files()
        candidates = sorted(
            # (a copy: the writer thread may trim entries meanwhile)
            (e for e in list(self._entries.values()) if deeper_than < len(e.tokens) < len(prompt)),
            key=lambda e: len(e.tokens), reverse=True,
        )
        for entry in candidates:
            if tuple(prompt[: len(entry.tokens)]) != entry.tokens:
                continue
            used: list[Path] = []
            try:
                loaded = decode(entry.path, self.identity, used)
            except (CorruptSnapshot, OSError, KeyError, TypeError, ValueError, RuntimeError) as exc:
                self._entries.pop(entry.path.stem, None)
                self._discard(entry.path, exc)
                continue
            for path in used:  # last use, for the oldest-first trim: the bases as recent as the file
                try:
                    os.utime(path)
                except OSError:
                    pass
            return loaded
        return None

    def store(self, tokens: Sequence[int], snapshot: KVSnapshot, draft_rows: Sequence[Tensor] | None) -> None:
        """Queue the snapshot for the writer thread (engine thread: no copy, no checksum). Its
        tensors are copies no one changes (kv.snapshot, the drafter's context_rows)."""
        if not self.enabled or self._write_failed:
            return
        name = tokens_name(tokens)
        if name in self._entries:
            return
        base = self._base_name(tokens, snapshot)
        payload = sum(t.numel() * t.element_size() for value in self._tensors(snapshot, draft_rows, base is not None).values()
                      for t in as_pieces(value))
        if payload > self.max_bytes:
            return
        try:
            self._writes.put_nowait((name, tuple(tokens), snapshot, tuple(draft_rows) if draft_rows is not None else None))
        except queue.Full:
            return  # the disk is behind; this snapshot stays in memory only
        # Indexed now (its size without the header until written), so the next prompt looks here.
        self._entries[name] = DiskEntry(tuple(tokens), self.folder / f"{name}{SUFFIX}", payload, base)

    def _base_name(self, tokens: Sequence[int], snapshot: KVSnapshot) -> str | None:
        """The file to write `snapshot` on: its base's, where that is indexed (written or queued)
        and its chain on disk leaves room for one more; else None (the whole snapshot is written)."""
        if snapshot.base is None:
            return None
        name, depth = tokens_name(tokens[: snapshot.start]), 1
        entry = self._entries.get(name)
        while entry is not None and entry.base is not None and depth < KVSnapshot.MAX_CHAIN:
            entry, depth = self._entries.get(entry.base), depth + 1
        return name if entry is not None and depth < KVSnapshot.MAX_CHAIN else None

    @staticmethod
    def _tensors(snapshot: KVSnapshot, draft_rows: Sequence[Tensor] | None, delta: bool) -> dict[str, Tensor | list[Tensor]]:
        """What a file holds: the snapshot's own positions (`delta`) or all of them, in pieces
        where the snapshot is built on others (the file holds them joined)."""
        links = [snapshot] if delta else snapshot.chain()
        tensors: dict[str, Tensor | list[Tensor]] = {"keys": [link.keys for link in links],
                                                      "values": [link.values for link in links]}
        if snapshot.key_scales is not None:  # an Int8KVCache's
            tensors |= {"key_scales": [link.key_scales for link in links],
                        "value_scales": [link.value_scales for link in links]}
        if draft_rows is not None:
            tensors["draft_rows"] = rows_from(draft_rows, snapshot.start if delta else 0)
        return tensors

    def _write_loop(self) -> None:
        run_in_background()
        while (item := self._writes.get()) is not None:
            name, tokens, snapshot, draft_rows = item
            try:
                size, base = self._write(name, tokens, snapshot, draft_rows)
                if name in self._entries:
                    self._entries[name] = DiskEntry(tokens, self.folder / f"{name}{SUFFIX}", size, base)
                self._trim()
            except OSError as exc:
                self._entries.pop(name, None)
                if not self._write_failed:
                    self._write_failed = True
                    log.warning("disk_cache_unwritable", folder=str(self.folder), error=str(exc),
                                note="snapshots stay in memory only")
            finally:
                del item, snapshot, draft_rows  # the snapshot's memory, once written
                self._writes.task_done()

    def _write(self, name: str, tokens: tuple[int, ...], snapshot: KVSnapshot,
               draft_rows: tuple[Tensor, ...] | None) -> tuple[int, str | None]:
        """Write one file; returns its size and the base file it is written on, if any (the base
        named when it was queued, if its file is there now: a failed or trimmed write is not)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"{name}{SUFFIX}"
        temporary = self.folder / f".{name}.{socket.gethostname()}.{os.getpid()}{TEMPORARY_SUFFIX}"
        entry = self._entries.get(name)
        base = entry.base if entry is not None and entry.base is not None and (self.folder / f"{entry.base}{SUFFIX}").exists() else None
        on = None if base is None else {"name": base, "tokens": snapshot.start}
        with open(temporary, "wb") as f:
            size = write_snapshot(f, self.identity, tokens, self._tensors(snapshot, draft_rows, base is not None), self.model, on)
            # On disk before the rename: after a power cut the name never points at missing bytes.
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
        return size, base

    def _trim(self) -> None:
        files = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # removed meanwhile (`dflash cache clear`): not a write failure
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        sizes = {path.stem: size for _, size, path in files}
        for _, _, path in sorted(files):
            if total <= self.max_bytes:
                break
            for name in [path.stem, *self._dependents(path.stem)]:  # a file's dependents cannot be read without it
                if name in sizes:
                    total -= sizes.pop(name)
                    (self.folder / f"{name}{SUFFIX}").unlink(missing_ok=True)
                self._entries.pop(name, None)

    def _dependents(self, name: str) -> list[str]:
        """The files written on `name`, directly or through others."""
        children: dict[str, list[str]] = {}
        for child, entry in list(self._entries.items()):  # a copy: the engine thread may index meanwhile
            if entry.base is not None:
                children.setdefault(entry.base, []).append(child)
        found, pending = [], [name]
        while pending:
            for child in children.get(pending.pop(), ()):
                if child not in found:
                    found.append(child)
                    pending.append(child)
        return found

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for queued writes (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self, timeout_s: float = 120.0) -> None:
        """Write what is queued, then stop the writer (shutdown). Each 20K-token snapshot takes
        ~5-7 s to write and fsync here and 8 may be queued, so the former 30 s bound lost the last
        ones of a long first turn (a restarted server prefilled 20K tokens again); what still cannot
        be written in `timeout_s` is named in the log."""
        if self._writer is None:
            return
        queued = self._writes.unfinished_tasks
        if queued:
            log.info("disk_cache_writing_before_exit", snapshots=queued)
        self._writes.put(None)
        self._writer.join(timeout=timeout_s)
        if self._writer.is_alive():
            log.warning("disk_cache_unwritten_at_exit", snapshots=self._writes.unfinished_tasks - 1, waited_s=timeout_s)  # less the stop mark
        self._writer = None
