"""The fine-tuning service's durable state: files, jobs, events and checkpoints under one directory.

Layout: `<state_dir>/finetune/state.sqlite3` holds the metadata (WAL journal, `synchronous=FULL`,
one transaction per write, so a row whose write returned survives kill -9 and power loss);
`<state_dir>/finetune/files/<file_id>.jsonl` holds uploaded content; checkpoint directories go
under `<state_dir>/finetune/checkpoints/<job_id>/step-NNNNNN`. Content is made durable before its
row is committed, so a row never points to missing content; what a crash can leave behind (a temp
file, content whose row was never committed or already deleted) is swept when the store opens.
One state directory serves one server process. Pure standard library: the engine may import it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sqlite3
import tempfile
import threading
import time
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, fields
from typing import Any

from flexserve.finetune.records import (
    EVENT_LEVELS,
    EVENT_TYPES,
    JOB_STATUSES,
    CheckpointRecord,
    EventRecord,
    FileRecord,
    JobRecord,
)
from flexserve.finetune.store_schema import DEFAULT_TENANT, migrate

MAX_FILENAME_CHARS = 255
_TEMP_PREFIX, _TEMP_SUFFIX = ".upload-", ".tmp"
_CONTENT_NAME = re.compile(r"^(file-[0-9a-f]{24})\.jsonl$")


_JOB_FIELDS = tuple(f.name for f in fields(JobRecord))
_JOB_JSON_FIELDS = frozenset({"hyperparameters", "error", "lora", "integrations", "metadata",
                              "result_files"})


def new_id(prefix: str) -> str:
    """A fresh id: `prefix` + "-" + 24 random hex chars (e.g. new_id("ftjob"))."""
    return f"{prefix}-{secrets.token_hex(12)}"


def _now() -> int:
    return int(time.time())


def sanitize_filename(filename: str) -> str:
    """The display name of an upload: last path component, no control chars, bounded length."""
    name = re.split(r"[/\\]", str(filename))[-1]
    # Drop categories C* (control, format such as bidi overrides, private, surrogate,
    # unassigned) and line/paragraph separators: they can disguise a name in logs and UIs.
    name = "".join(c for c in name if unicodedata.category(c)[0] != "C"
                   and unicodedata.category(c) not in ("Zl", "Zp")).strip()
    if name in ("", ".", ".."):
        return "file"
    if len(name) > MAX_FILENAME_CHARS:
        stem, ext = os.path.splitext(name)
        ext = ext if len(ext) <= 16 else ""
        name = stem[:MAX_FILENAME_CHARS - len(ext)] + ext
    return name


def _to_json(name: str, value: Any) -> str | None:
    if value is None:
        return None
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be JSON-serializable: {e}") from None


def _from_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")


def _scoped(where: str, params: tuple, tenant: str | None) -> tuple[str, tuple]:
    """`where` narrowed to one tenant's rows (all rows when `tenant` is None)."""
    if tenant is None:
        return where, params
    return f"{where} AND tenant = ?", (*params, tenant)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateStore:
    """Files, jobs, events and checkpoints of the fine-tuning service under one state directory.

    Thread-safe: one SQLite connection behind a lock, shared by HTTP handler threads and the
    engine thread. Lists are newest first (highest insertion sequence first, stable when many
    records share a `created_at` second); `after` is the id of the last record of the previous
    page and must name a record in the same listing, else `ValueError`. Files and jobs belong
    to a tenant: given `tenant`, a lookup or listing sees that tenant's records only (another
    tenant's id reads as unknown); without it, every record (the service's own view).
    """

    def __init__(self, state_dir: str) -> None:
        self._root = os.path.join(os.path.abspath(state_dir), "finetune")
        self._files_dir = os.path.join(self._root, "files")
        self._checkpoints_dir = os.path.join(self._root, "checkpoints")
        for path in (self._files_dir, self._checkpoints_dir):
            if not os.path.isdir(path):
                os.makedirs(path)
                # Make the new directory entries durable before anything is stored in them.
                _fsync_dir(self._root)
                _fsync_dir(os.path.dirname(self._root))
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(os.path.join(self._root, "state.sqlite3"),
                                     check_same_thread=False, isolation_level=None, timeout=30.0)
        self._conn.row_factory = sqlite3.Row
        try:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RuntimeError(f"SQLite refused WAL journaling (got {mode!r}) in {self._root}")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._migrate()
            self._sweep_files()
        except BaseException:
            self._conn.close()
            raise

    # -- paths ---------------------------------------------------------------------------------

    @property
    def root(self) -> str:
        return self._root

    @property
    def files_dir(self) -> str:
        return self._files_dir

    @property
    def checkpoints_dir(self) -> str:
        return self._checkpoints_dir

    def checkpoint_dir(self, job_id: str, step: int) -> str:
        """Where a job's checkpoint at optimizer step `step` goes (not created)."""
        if not re.fullmatch(r"ftjob-[0-9a-f]+", job_id):
            raise ValueError(f"invalid job id {job_id!r}")
        return os.path.join(self._checkpoints_dir, job_id, f"step-{int(step):06d}")

    # -- plumbing ------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock; IMMEDIATE takes the write lock up front."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:  # a failed COMMIT can leave it open
                    self._conn.execute("ROLLBACK")
                raise

    def _read(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def _migrate(self) -> None:
        with self._write() as conn:
            migrate(conn, self._root)

    def _sweep_files(self) -> None:
        """Remove what a crash can leave in files_dir: temp files and content with no row."""
        known = {row["id"] for row in self._read("SELECT id FROM files")}
        for name in os.listdir(self._files_dir):
            match = _CONTENT_NAME.match(name)
            orphan = match is not None and match.group(1) not in known
            if orphan or (name.startswith(_TEMP_PREFIX) and name.endswith(_TEMP_SUFFIX)):
                os.remove(os.path.join(self._files_dir, name))

    def _page(self, table: str, scope: str, params: tuple, after: str | None, limit: int,
              descending: bool = True) -> tuple[list[sqlite3.Row], bool]:
        """Rows of `table` matching `scope` (SQL), by insertion sequence, one past `after`."""
        _check_limit(limit)
        where = scope
        if after is not None:
            rows = self._read(f"SELECT seq FROM {table} WHERE id = ? AND {scope}",
                              (after, *params))
            if not rows:
                raise ValueError(f"after: no such id {after!r}")
            where += " AND seq < ?" if descending else " AND seq > ?"
            params = (*params, rows[0]["seq"])
        order = "DESC" if descending else "ASC"
        rows = self._read(f"SELECT * FROM {table} WHERE {where} ORDER BY seq {order} LIMIT ?",
                          (*params, limit + 1))
        return rows[:limit], len(rows) > limit

    # -- files ---------------------------------------------------------------------------------

    def _content_path(self, file_id: str) -> str:
        return os.path.join(self._files_dir, f"{file_id}.jsonl")

    def _file(self, row: sqlite3.Row) -> FileRecord:
        return FileRecord(id=row["id"], filename=row["filename"], purpose=row["purpose"],
                          bytes=row["bytes"], created_at=row["created_at"],
                          path=self._content_path(row["id"]), status=row["status"],
                          tenant=row["tenant"])

    def add_file(self, filename: str, purpose: str, content: bytes,
                 tenant: str = DEFAULT_TENANT) -> FileRecord:
        """Store an upload of `tenant`: content durable on disk first, then its row."""
        if not isinstance(content, (bytes, bytearray, memoryview)):
            raise ValueError(f"file content must be bytes, got {type(content).__name__}")
        file_id = new_id("file")
        record = FileRecord(id=file_id, filename=sanitize_filename(filename), purpose=purpose,
                            bytes=len(content), created_at=_now(),
                            path=self._content_path(file_id), tenant=tenant)
        fd, temp_path = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX,
                                         dir=self._files_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp_path, record.path)
        except BaseException:
            if os.path.exists(temp_path):
                os.remove(temp_path)
            raise
        _fsync_dir(self._files_dir)  # the rename is durable before any row names it
        try:
            with self._write() as conn:
                conn.execute(
                    "INSERT INTO files (id, filename, purpose, bytes, created_at, status, "
                    "tenant) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (record.id, record.filename, record.purpose, record.bytes,
                     record.created_at, record.status, record.tenant))
        except BaseException:
            os.remove(record.path)
            raise
        return record

    def get_file(self, file_id: str, tenant: str | None = None) -> FileRecord | None:
        """The file with this id; None if unknown, or (`tenant` given) another tenant's."""
        where, params = _scoped("id = ?", (file_id,), tenant)
        rows = self._read(f"SELECT * FROM files WHERE {where}", params)
        return self._file(rows[0]) if rows else None

    def read_file(self, file_id: str, tenant: str | None = None) -> bytes:
        """The content of a file; KeyError if the id is unknown (or another tenant's)."""
        record = self.get_file(file_id, tenant)
        if record is None:
            raise KeyError(file_id)
        with open(record.path, "rb") as f:
            return f.read()

    def list_files(self, purpose: str | None = None, after: str | None = None,
                   limit: int = 10000, order: str = "desc",
                   tenant: str | None = None) -> list[FileRecord]:
        """Files, newest first (`order="asc"`: oldest first), optionally of one purpose and of
        one tenant."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
        where, params = ("purpose = ?", (purpose,)) if purpose is not None else ("1 = 1", ())
        where, params = _scoped(where, params, tenant)
        rows, _ = self._page("files", where, params, after, limit, descending=order == "desc")
        return [self._file(row) for row in rows]

    def delete_file(self, file_id: str, tenant: str | None = None) -> bool:
        """Delete a file: the row first (a crash then leaves only swept content); False if
        unknown (or another tenant's)."""
        where, params = _scoped("id = ?", (file_id,), tenant)
        with self._write() as conn:
            deleted = conn.execute(f"DELETE FROM files WHERE {where}", params).rowcount
        if not deleted:
            return False
        try:
            os.remove(self._content_path(file_id))
        except FileNotFoundError:
            pass
        return True

    # -- jobs ----------------------------------------------------------------------------------

    @staticmethod
    def _job(row: sqlite3.Row) -> JobRecord:
        return JobRecord(**{name: _from_json(row[name]) if name in _JOB_JSON_FIELDS else row[name]
                            for name in _JOB_FIELDS})

    @staticmethod
    def _job_values(job: JobRecord) -> tuple:
        if job.status not in JOB_STATUSES:
            raise ValueError(f"job status must be one of {', '.join(JOB_STATUSES)}, "
                             f"got {job.status!r}")
        if not isinstance(job.hyperparameters, dict):
            raise ValueError("hyperparameters must be a dict")
        return tuple(_to_json(name, getattr(job, name)) if name in _JOB_JSON_FIELDS
                     else getattr(job, name) for name in _JOB_FIELDS)

    def add_job(self, job: JobRecord) -> None:
        """Insert a new job; ValueError if its id exists or a field is invalid."""
        values = self._job_values(job)
        columns = ", ".join(_JOB_FIELDS)
        try:
            with self._write() as conn:
                conn.execute(f"INSERT INTO jobs ({columns}) VALUES "
                             f"({', '.join('?' * len(_JOB_FIELDS))})", values)
        except sqlite3.IntegrityError as e:
            raise ValueError(f"cannot add job {job.id!r}: {e}") from None

    def update_job(self, job_id: str, **fields: Any) -> JobRecord:
        """Set fields of a job in one transaction and return it; KeyError if unknown."""
        unknown = sorted(name for name in fields if name == "id" or name not in _JOB_FIELDS)
        if unknown:
            raise ValueError(f"cannot update job field(s): {', '.join(unknown)}")
        with self._write() as conn:
            rows = conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchall()
            if not rows:
                raise KeyError(job_id)
            job = self._job(rows[0])
            for name, value in fields.items():
                setattr(job, name, value)
            values = self._job_values(job)
            conn.execute(f"UPDATE jobs SET {', '.join(f'{n} = ?' for n in _JOB_FIELDS)} "
                         "WHERE id = ?", (*values, job_id))
        return job

    def get_job(self, job_id: str, tenant: str | None = None) -> JobRecord | None:
        """The job with this id; None if unknown, or (`tenant` given) another tenant's."""
        where, params = _scoped("id = ?", (job_id,), tenant)
        rows = self._read(f"SELECT * FROM jobs WHERE {where}", params)
        return self._job(rows[0]) if rows else None

    def list_jobs(self, after: str | None = None, limit: int = 20,
                  tenant: str | None = None) -> tuple[list[JobRecord], bool]:
        """A page of jobs, newest first, optionally of one tenant; returns (page, has_more)."""
        where, params = _scoped("1 = 1", (), tenant)
        rows, has_more = self._page("jobs", where, params, after, limit)
        return [self._job(row) for row in rows], has_more

    def jobs_with_status(self, *statuses: str) -> list[JobRecord]:
        """Jobs in any of `statuses`, oldest first (the order to resume them after a restart)."""
        if not statuses:
            return []
        rows = self._read(f"SELECT * FROM jobs WHERE status IN ({', '.join('?' * len(statuses))})"
                          " ORDER BY seq ASC", statuses)
        return [self._job(row) for row in rows]

    def _require_job(self, conn: sqlite3.Connection, job_id: str) -> None:
        if conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is None:
            raise KeyError(job_id)

    # -- events --------------------------------------------------------------------------------

    def add_event(self, job_id: str, message: str, level: str = "info", type: str = "message",
                  data: dict | None = None) -> EventRecord:
        """Append an event to a job's log; KeyError if the job is unknown."""
        if level not in EVENT_LEVELS:
            raise ValueError(f"event level must be one of {', '.join(EVENT_LEVELS)}, got {level!r}")
        if type not in EVENT_TYPES:
            raise ValueError(f"event type must be one of {', '.join(EVENT_TYPES)}, got {type!r}")
        event = EventRecord(id=new_id("ftevent"), job_id=job_id, created_at=_now(), level=level,
                            message=message, type=type, data=data)
        with self._write() as conn:
            self._require_job(conn, job_id)
            conn.execute("INSERT INTO events (id, job_id, created_at, level, message, type, data) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (event.id, job_id, event.created_at, level, message, type,
                          _to_json("data", data)))
        return event

    def list_events(self, job_id: str, after: str | None = None,
                    limit: int = 20) -> tuple[list[EventRecord], bool]:
        """A page of a job's events, newest first; returns (page, has_more)."""
        rows, has_more = self._page("events", "job_id = ?", (job_id,), after, limit)
        return [EventRecord(id=r["id"], job_id=r["job_id"], created_at=r["created_at"],
                            level=r["level"], message=r["message"], type=r["type"],
                            data=_from_json(r["data"])) for r in rows], has_more

    # -- checkpoints ---------------------------------------------------------------------------

    @staticmethod
    def _checkpoint(row: sqlite3.Row) -> CheckpointRecord:
        return CheckpointRecord(id=row["id"], job_id=row["job_id"], created_at=row["created_at"],
                                step_number=row["step_number"],
                                metrics=_from_json(row["metrics"]),
                                fine_tuned_model_checkpoint=row["fine_tuned_model_checkpoint"],
                                path=row["path"], deleted_at=row["deleted_at"])

    def add_checkpoint(self, job_id: str, step_number: int, metrics: dict,
                       fine_tuned_model_checkpoint: str, path: str) -> CheckpointRecord:
        """Record a saved checkpoint of a job; KeyError if the job is unknown."""
        checkpoint = CheckpointRecord(id=new_id("ftckpt"), job_id=job_id, created_at=_now(),
                                      step_number=step_number, metrics=metrics,
                                      fine_tuned_model_checkpoint=fine_tuned_model_checkpoint,
                                      path=path)
        if not isinstance(metrics, dict):
            raise ValueError(f"checkpoint metrics must be a dict, got {type(metrics).__name__}")
        values = asdict(checkpoint)
        values["metrics"] = _to_json("metrics", metrics)
        with self._write() as conn:
            self._require_job(conn, job_id)
            conn.execute(f"INSERT INTO checkpoints ({', '.join(values)}) VALUES "
                         f"({', '.join('?' * len(values))})", tuple(values.values()))
        return checkpoint

    def list_checkpoints(self, job_id: str, after: str | None = None,
                         limit: int = 10) -> tuple[list[CheckpointRecord], bool]:
        """A page of a job's checkpoints, newest first; returns (page, has_more)."""
        rows, has_more = self._page("checkpoints", "job_id = ?", (job_id,), after, limit)
        return [self._checkpoint(row) for row in rows], has_more

    def latest_checkpoint(self, job_id: str) -> CheckpointRecord | None:
        rows = self._read("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY seq DESC LIMIT 1",
                          (job_id,))
        return self._checkpoint(rows[0]) if rows else None

    def kept_checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        """A job's checkpoints still on disk, newest first."""
        rows = self._read("SELECT * FROM checkpoints WHERE job_id = ? AND deleted_at IS NULL "
                          "ORDER BY seq DESC", (job_id,))
        return [self._checkpoint(row) for row in rows]

    def mark_checkpoint_deleted(self, checkpoint_id: str) -> None:
        """Record that a checkpoint's directory was deleted (its record stays)."""
        with self._write() as conn:
            conn.execute("UPDATE checkpoints SET deleted_at = ? WHERE id = ?",
                         (_now(), checkpoint_id))

    # -- job models a client unloaded ------------------------------------------------------------

    def set_model_unloaded(self, name: str, job_id: str, unloaded: bool) -> None:
        """Remember (or forget) that the owner of job `job_id` unloaded its model `name`, so a
        restart serves it again only once it is loaded again."""
        with self._write() as conn:
            if unloaded:
                conn.execute("INSERT OR REPLACE INTO unloaded_models (name, job_id) VALUES (?, ?)",
                             (name, job_id))
            else:
                conn.execute("DELETE FROM unloaded_models WHERE name = ?", (name,))

    def unloaded_models(self) -> set[str]:
        return {row["name"] for row in self._read("SELECT name FROM unloaded_models")}

    def close(self) -> None:
        """Close the database; the store is unusable afterwards."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
