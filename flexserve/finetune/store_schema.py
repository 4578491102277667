"""The SQLite schema of the fine-tuning state store and its in-place migrations.

A store records its schema version in `PRAGMA user_version`. A new store gets the current schema
at once; an older one is brought up to date step by step in the transaction that opens it, so a
server reading it never sees a half-migrated database. Pure standard library.

Versions: 1, the first; 2, files belong to a tenant (`files.tenant`, rows of version 1 go to
"default", the tenant of requests without a tenant key); 3, result files of jobs
(`jobs.result_files`), checkpoints deleted by retention (`checkpoints.deleted_at`) and the job
models their owner unloaded (`unloaded_models`, so a restart does not serve them again).
"""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 3
DEFAULT_TENANT = "default"  # owner of what requests without a tenant key create

_SCHEMA = f"""
CREATE TABLE files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, filename TEXT NOT NULL,
    purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    status TEXT NOT NULL, tenant TEXT NOT NULL DEFAULT '{DEFAULT_TENANT}');
CREATE INDEX files_by_tenant ON files (tenant, seq);
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, model TEXT NOT NULL,
    training_file TEXT NOT NULL, validation_file TEXT, hyperparameters TEXT NOT NULL,
    suffix TEXT, seed INTEGER NOT NULL, tenant TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, finished_at INTEGER, fine_tuned_model TEXT,
    trained_tokens INTEGER, error TEXT, adapter_path TEXT, num_steps INTEGER,
    step INTEGER NOT NULL, lora TEXT, integrations TEXT, metadata TEXT, result_files TEXT);
CREATE INDEX jobs_by_tenant ON jobs (tenant, seq);
CREATE INDEX jobs_by_status ON jobs (status, seq);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL, level TEXT NOT NULL, message TEXT NOT NULL, type TEXT NOT NULL,
    data TEXT);
CREATE INDEX events_by_job ON events (job_id, seq);
CREATE TABLE checkpoints (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, job_id TEXT NOT NULL,
    created_at INTEGER NOT NULL, step_number INTEGER NOT NULL, metrics TEXT NOT NULL,
    fine_tuned_model_checkpoint TEXT NOT NULL, path TEXT NOT NULL, deleted_at INTEGER);
CREATE INDEX checkpoints_by_job ON checkpoints (job_id, seq);
CREATE TABLE unloaded_models (name TEXT PRIMARY KEY, job_id TEXT NOT NULL);
"""

# version -> the statements that take a store of that version to the next one
_MIGRATIONS: dict[int, str] = {
    1: f"""
ALTER TABLE files ADD COLUMN tenant TEXT NOT NULL DEFAULT '{DEFAULT_TENANT}';
CREATE INDEX files_by_tenant ON files (tenant, seq);
""",
    2: """
ALTER TABLE jobs ADD COLUMN result_files TEXT;
ALTER TABLE checkpoints ADD COLUMN deleted_at INTEGER;
CREATE TABLE unloaded_models (name TEXT PRIMARY KEY, job_id TEXT NOT NULL);
""",
}


def _run_script(conn: sqlite3.Connection, script: str) -> None:
    # One statement at a time: executescript() would commit the caller's transaction.
    for statement in script.split(";"):
        if statement.strip():
            conn.execute(statement)


def migrate(conn: sqlite3.Connection, where: str) -> int:
    """Bring the database of `conn` (inside the caller's write transaction) to SCHEMA_VERSION;
    returns the version it had. RuntimeError for a store of a newer flexserve (`where` names
    it in the message)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"{where} was written by a newer flexserve (schema {version}, this "
                           f"one reads {SCHEMA_VERSION})")
    if version == 0:
        _run_script(conn, _SCHEMA)
    else:
        for step in range(version, SCHEMA_VERSION):
            _run_script(conn, _MIGRATIONS[step])
    if version != SCHEMA_VERSION:
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return version
