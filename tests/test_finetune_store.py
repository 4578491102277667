"""StateStore: round trips, pagination, reopen, crash safety (SIGKILL), threads, filenames."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading

import pytest

from flexserve.finetune import store as store_module
from flexserve.finetune.records import CheckpointRecord, EventRecord, FileRecord, JobRecord
from flexserve.finetune.store import StateStore, new_id, sanitize_filename
from flexserve.finetune.store_schema import SCHEMA_VERSION

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def store(tmp_path):
    with StateStore(str(tmp_path / "state")) as s:
        yield s


@pytest.fixture
def same_second(monkeypatch):
    """Every record gets the same created_at, so only the sequence can order them."""
    monkeypatch.setattr(store_module, "_now", lambda: 1_700_000_000)


def make_job(tenant: str = "t0", **overrides) -> JobRecord:
    fields = dict(id=new_id("ftjob"), model="SmolLM2-135M-Instruct", training_file=new_id("file"),
                  validation_file=None, hyperparameters={"batch_size": 2, "n_epochs": 1},
                  suffix=None, seed=7, tenant=tenant, status="queued", created_at=1_700_000_000)
    fields.update(overrides)
    return JobRecord(**fields)


def all_files_in(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_layout_and_checkpoint_dir(tmp_path):
    s = StateStore(str(tmp_path / "state"))
    root = str(tmp_path / "state" / "finetune")
    assert s.root == root
    assert s.files_dir == os.path.join(root, "files") and os.path.isdir(s.files_dir)
    assert s.checkpoints_dir == os.path.join(root, "checkpoints")
    assert os.path.isdir(s.checkpoints_dir)
    assert os.path.isfile(os.path.join(root, "state.sqlite3"))
    job_id = "ftjob-" + "ab" * 12
    assert s.checkpoint_dir(job_id, 42) == os.path.join(s.checkpoints_dir, job_id, "step-000042")
    assert not os.path.exists(os.path.dirname(s.checkpoint_dir(job_id, 42)))
    with pytest.raises(ValueError):
        s.checkpoint_dir("../../etc", 1)
    journal_mode = s._conn.execute("PRAGMA journal_mode").fetchone()[0]
    synchronous = s._conn.execute("PRAGMA synchronous").fetchone()[0]
    assert (journal_mode, synchronous) == ("wal", 2)  # 2 is FULL
    assert s._conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    s.close()


def test_ids_have_the_openai_shape():
    ids = {new_id("ftjob") for _ in range(100)}
    assert len(ids) == 100
    for job_id in ids:
        prefix, hex_part = job_id.split("-")
        assert prefix == "ftjob" and len(hex_part) == 24 and int(hex_part, 16) >= 0


def test_file_round_trip(store):
    content = b'{"prompt": "a", "completion": "b"}\n' * 3
    record = store.add_file("train.jsonl", "fine-tune", content)
    assert record.id.startswith("file-") and len(record.id) == len("file-") + 24
    assert (record.filename, record.purpose, record.bytes, record.status) == (
        "train.jsonl", "fine-tune", len(content), "processed")
    assert record.path == os.path.join(store.files_dir, f"{record.id}.jsonl")
    assert store.get_file(record.id) == record
    assert store.read_file(record.id) == content
    assert all_files_in(store.files_dir) == [f"{record.id}.jsonl"]  # no temp file left
    assert store.list_files() == [record]
    assert store.delete_file(record.id) is True
    assert store.get_file(record.id) is None
    assert not os.path.exists(record.path)
    assert store.delete_file(record.id) is False
    with pytest.raises(KeyError):
        store.read_file(record.id)
    with pytest.raises(ValueError):
        store.add_file("x.jsonl", "fine-tune", "text, not bytes")


def test_list_files_purpose_order_after_limit(store, same_second):
    records = [store.add_file(f"f{i}.jsonl", "fine-tune" if i % 3 else "batch", b"x" * i)
               for i in range(12)]
    newest_first = records[::-1]
    assert store.list_files() == newest_first
    assert store.list_files(order="asc") == records
    assert store.list_files(purpose="batch") == [r for r in newest_first if r.purpose == "batch"]
    assert store.list_files(limit=5) == newest_first[:5]
    assert store.list_files(after=newest_first[4].id, limit=5) == newest_first[5:10]
    assert store.list_files(after=records[3].id, order="asc") == records[4:]
    with pytest.raises(ValueError, match="after"):
        store.list_files(after="file-" + "0" * 24)
    with pytest.raises(ValueError):
        store.list_files(order="sideways")
    with pytest.raises(ValueError):
        store.list_files(limit=0)


@pytest.mark.parametrize("uploaded, shown", [
    ("../../etc/passwd", "passwd"),
    ("C:\\Users\\me\\train.jsonl", "train.jsonl"),
    ("/abs/path/data.jsonl", "data.jsonl"),
    ("bad\x00na\nme\x1b[31m.jsonl", "badname[31m.jsonl"),
    ("\u202egnp.jsonl", "gnp.jsonl"),  # a right-to-left override would disguise the name
    ("..", "file"),
    ("dir/", "file"),
    ("  spaced.jsonl  ", "spaced.jsonl"),
    ("résumé-数据.jsonl", "résumé-数据.jsonl"),
])
def test_filename_is_display_only(tmp_path, uploaded, shown):
    state_dir = tmp_path / "state"
    with StateStore(str(state_dir)) as s:
        record = s.add_file(uploaded, "fine-tune", b"{}\n")
        assert record.filename == shown
        assert os.path.dirname(record.path) == s.files_dir
        assert os.path.basename(record.path) == f"{record.id}.jsonl"
        assert s.get_file(record.id).filename == shown
        assert all_files_in(s.files_dir) == [f"{record.id}.jsonl"]
    assert sorted(os.listdir(tmp_path)) == ["state"]  # nothing written outside the state dir


def test_long_filename_is_truncated_keeping_its_extension():
    name = sanitize_filename("a" * 1000 + ".jsonl")
    assert len(name) == store_module.MAX_FILENAME_CHARS and name.endswith("a.jsonl")


def test_job_round_trip_and_update(store):
    job = make_job(validation_file="file-" + "1" * 24, suffix="mine", lora={"r": 8, "alpha": 16},
                   integrations=[{"type": "wandb", "wandb": {"project": "p"}}],
                   metadata={"team": "search"}, num_steps=10)
    store.add_job(job)
    assert store.get_job(job.id) == job
    with pytest.raises(ValueError, match="cannot add job"):
        store.add_job(job)

    updated = store.update_job(job.id, status="running", step=3,
                               adapter_path="/ckpt/step-000003")
    assert (updated.status, updated.step, updated.adapter_path) == (
        "running", 3, "/ckpt/step-000003")
    assert store.get_job(job.id) == updated
    error = {"code": "invalid_training_file", "message": "line 3 is not JSON", "param": None}
    final = store.update_job(job.id, status="failed", finished_at=1_700_000_100, error=error,
                             trained_tokens=1234)
    assert store.get_job(job.id) == final
    assert (final.error, final.trained_tokens, final.step, final.lora) == (
        error, 1234, 3, {"r": 8, "alpha": 16})

    with pytest.raises(ValueError, match="stauts"):
        store.update_job(job.id, stauts="running")
    with pytest.raises(ValueError, match="id"):
        store.update_job(job.id, id="ftjob-" + "0" * 24)
    with pytest.raises(ValueError, match="status"):
        store.update_job(job.id, status="exploded")
    with pytest.raises(ValueError, match="JSON"):
        store.update_job(job.id, metadata={"x": object()})
    assert store.get_job(job.id) == final  # failed updates changed nothing
    with pytest.raises(KeyError):
        store.update_job("ftjob-" + "0" * 24, status="running")
    assert store.get_job("ftjob-" + "0" * 24) is None
    with pytest.raises(ValueError):
        store.add_job(make_job(status="sleeping"))


def test_list_jobs_pages_newest_first(store, same_second):
    jobs = [make_job(tenant="a" if i % 2 else "b") for i in range(25)]
    for job in jobs:
        store.add_job(job)
    newest_first = jobs[::-1]
    page1, more1 = store.list_jobs(limit=10)
    page2, more2 = store.list_jobs(after=page1[-1].id, limit=10)
    page3, more3 = store.list_jobs(after=page2[-1].id, limit=10)
    assert (more1, more2, more3) == (True, True, False)
    assert page1 + page2 + page3 == newest_first
    assert store.list_jobs(limit=25) == (newest_first, False)
    assert store.list_jobs(limit=24) == (newest_first[:24], True)

    tenant_a = [j for j in newest_first if j.tenant == "a"]
    page, more = store.list_jobs(limit=5, tenant="a")
    assert (page, more) == (tenant_a[:5], True)
    assert store.list_jobs(after=page[-1].id, limit=50, tenant="a") == (tenant_a[5:], False)
    other_tenant_job = next(j for j in jobs if j.tenant == "b")
    with pytest.raises(ValueError, match="after"):  # another tenant's id is not visible
        store.list_jobs(after=other_tenant_job.id, tenant="a")
    with pytest.raises(ValueError, match="after"):
        store.list_jobs(after="ftjob-" + "0" * 24)
    with pytest.raises(ValueError):
        store.list_jobs(limit=0)
    assert store.list_jobs(tenant="nobody") == ([], False)


def test_jobs_with_status_oldest_first(store, same_second):
    jobs = [make_job(status=status) for status in
            ("queued", "running", "succeeded", "queued", "validating_files", "running")]
    for job in jobs:
        store.add_job(job)
    assert store.jobs_with_status("queued", "running", "validating_files") == [
        jobs[0], jobs[1], jobs[3], jobs[4], jobs[5]]
    assert store.jobs_with_status("succeeded") == [jobs[2]]
    assert store.jobs_with_status("cancelled") == []
    assert store.jobs_with_status() == []


def test_events_round_trip_and_pages(store, same_second):
    job, other = make_job(), make_job()
    store.add_job(job)
    store.add_job(other)
    first = store.add_event(job.id, "Created fine-tuning job")
    assert isinstance(first, EventRecord) and first.id.startswith("ftevent-")
    assert (first.level, first.type, first.data, first.created_at) == (
        "info", "message", None, 1_700_000_000)
    events = [first] + [
        store.add_event(job.id, f"Step {i}/40", type="metrics",
                        data={"step": i, "train_loss": 1.0 / i, "total_steps": 40})
        for i in range(1, 41)]
    events.append(store.add_event(job.id, "Job failed", level="error"))
    store.add_event(other.id, "someone else's event")
    newest_first = events[::-1]
    collected, after, pages = [], None, 0
    while True:
        page, more = store.list_events(job.id, after=after, limit=20)
        collected += page
        pages += 1
        if not more:
            break
        after = page[-1].id
    assert (collected, pages) == (newest_first, 3)
    assert collected[-2].data == {"step": 1, "train_loss": 1.0, "total_steps": 40}
    with pytest.raises(ValueError, match="after"):  # an event of another job
        store.list_events(job.id, after=store.list_events(other.id)[0][0].id)
    with pytest.raises(ValueError):
        store.add_event(job.id, "x", level="debug")
    with pytest.raises(ValueError):
        store.add_event(job.id, "x", type="trace")
    with pytest.raises(KeyError):
        store.add_event("ftjob-" + "0" * 24, "orphan")
    assert store.list_events("ftjob-" + "0" * 24) == ([], False)


def test_checkpoints_round_trip_and_pages(store, same_second):
    job = make_job()
    store.add_job(job)
    assert store.latest_checkpoint(job.id) is None
    checkpoints = []
    for step in (5, 10, 15, 20):
        path = store.checkpoint_dir(job.id, step)
        checkpoints.append(store.add_checkpoint(
            job.id, step, {"step": step, "train_loss": 2.0 / step},
            f"ft:SmolLM2:org:mine:{job.id}:ckpt-step-{step}", path))
    assert all(isinstance(c, CheckpointRecord) and c.id.startswith("ftckpt-")
               for c in checkpoints)
    assert store.latest_checkpoint(job.id) == checkpoints[-1]
    assert store.list_checkpoints(job.id) == (checkpoints[::-1], False)
    page, more = store.list_checkpoints(job.id, limit=3)
    assert (page, more) == (checkpoints[:0:-1], True)
    assert store.list_checkpoints(job.id, after=page[-1].id) == ([checkpoints[0]], False)
    with pytest.raises(KeyError):
        store.add_checkpoint("ftjob-" + "0" * 24, 1, {}, "x", "/tmp/x")
    with pytest.raises(ValueError):
        store.add_checkpoint(job.id, 1, None, "x", "/tmp/x")
    with pytest.raises(ValueError, match="after"):
        store.list_checkpoints(job.id, after="ftckpt-" + "0" * 24)


def test_reopen_keeps_everything(tmp_path):
    state_dir = str(tmp_path / "state")
    s = StateStore(state_dir)
    file = s.add_file("t.jsonl", "fine-tune", b'{"a": 1}\n')
    job = make_job(training_file=file.id)
    s.add_job(job)
    job = s.update_job(job.id, status="running", step=2)
    event = s.add_event(job.id, "Step 2", type="metrics", data={"step": 2})
    checkpoint = s.add_checkpoint(job.id, 2, {"step": 2}, "ft:m:ckpt-2",
                                  s.checkpoint_dir(job.id, 2))
    s.close()
    with pytest.raises(sqlite3.ProgrammingError):
        s.get_job(job.id)

    with StateStore(state_dir) as reopened:
        assert reopened.get_file(file.id) == file
        assert reopened.read_file(file.id) == b'{"a": 1}\n'
        assert reopened.get_job(job.id) == job
        assert reopened.list_events(job.id) == ([event], False)
        assert reopened.latest_checkpoint(job.id) == checkpoint
        newer = reopened.add_event(job.id, "after restart")
        assert reopened.list_events(job.id)[0] == [newer, event]  # sequence continues

    conn = sqlite3.connect(os.path.join(state_dir, "finetune", "state.sqlite3"))
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer"):
        StateStore(state_dir)


def test_open_sweeps_what_a_crash_leaves(tmp_path):
    state_dir = str(tmp_path / "state")
    with StateStore(state_dir) as s:
        kept = s.add_file("kept.jsonl", "fine-tune", b"{}\n")
        files_dir = s.files_dir
    temp = os.path.join(files_dir, ".upload-abc123.tmp")  # crash while writing content
    orphan = os.path.join(files_dir, f"file-{'c' * 24}.jsonl")  # crash before the row commit
    unrelated = os.path.join(files_dir, "notes.txt")
    for path in (temp, orphan, unrelated):
        with open(path, "wb") as f:
            f.write(b"partial")
    with StateStore(state_dir) as s:
        assert all_files_in(files_dir) == sorted([f"{kept.id}.jsonl", "notes.txt"])
        assert s.read_file(kept.id) == b"{}\n"


_CRASH_CHILD = textwrap.dedent("""
    import sys
    from flexserve.finetune.records import JobRecord
    from flexserve.finetune.store import StateStore, new_id
    assert "torch" not in sys.modules
    store = StateStore(sys.argv[1])
    i = 0
    while True:
        content = (b'{"prompt": "%d", "completion": "ok"}\\n' % i) * 4000
        f = store.add_file(f"train-{i}.jsonl", "fine-tune", content)
        print("file", f.id, i, flush=True)
        job = JobRecord(id=new_id("ftjob"), model="m", training_file=f.id, validation_file=None,
                        hyperparameters={"i": i}, suffix=None, seed=i, tenant="t",
                        status="queued", created_at=0)
        store.add_job(job)
        print("job", job.id, i, flush=True)
        print("event", store.add_event(job.id, f"event {i}").id, i, flush=True)
        store.update_job(job.id, status="running", step=i)
        print("update", job.id, i, flush=True)
        i += 1
""")


def test_sigkill_loses_nothing_that_was_acknowledged(tmp_path):
    state_dir = str(tmp_path / "state")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, state_dir],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
    lines = []
    while len(lines) < 50:
        line = child.stdout.readline()
        assert line, child.stderr.read().decode()
        lines.append(line)
    os.kill(child.pid, signal.SIGKILL)
    lines += child.stdout.readlines()  # acknowledged before the kill but not yet read
    assert child.wait() == -signal.SIGKILL
    child.stdout.close()
    child.stderr.close()
    acked = [line.decode().split() for line in lines if line.endswith(b"\n")]
    assert len(acked) >= 50

    with StateStore(state_dir) as s:
        for kind, record_id, i in acked:
            i = int(i)
            if kind == "file":
                assert s.read_file(record_id) == (
                    b'{"prompt": "%d", "completion": "ok"}\n' % i) * 4000
            elif kind == "job":
                assert s.get_job(record_id).hyperparameters == {"i": i}
            elif kind == "event":
                events = s.list_events(s.jobs_with_status("queued", "running")[i].id)[0]
                assert [e.id for e in events] == [record_id]
            else:
                job = s.get_job(record_id)
                assert (job.status, job.step) == ("running", i)
        files = s.list_files()
        assert len(files) >= sum(kind == "file" for kind, _, _ in acked)
        for record in files:  # no row points to missing or partial content
            assert os.path.getsize(record.path) == record.bytes
        assert all_files_in(s.files_dir) == sorted(f"{r.id}.jsonl" for r in files)


def test_concurrent_writers_lose_nothing(store):
    shared_job = make_job()
    store.add_job(shared_job)
    num_threads, num_events = 4, 25
    own_jobs = [make_job(tenant=f"t{k}") for k in range(num_threads)]
    for job in own_jobs:
        store.add_job(job)
    file_ids: list[list[str]] = [[] for _ in range(num_threads)]
    event_ids: list[list[str]] = [[] for _ in range(num_threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def writer(k: int) -> None:
        try:
            barrier.wait()
            for i in range(num_events):
                event_ids[k].append(store.add_event(shared_job.id, f"thread {k} event {i}").id)
                store.update_job(own_jobs[k].id, step=i + 1)
                if i % 5 == 0:
                    file_ids[k].append(store.add_file(f"{k}-{i}.jsonl", "fine-tune",
                                                      b"%d %d\n" % (k, i)).id)
                store.list_jobs(limit=3)
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    events, more = store.list_events(shared_job.id, limit=1000)
    assert (len(events), more) == (num_threads * num_events, False)
    listed = [e.id for e in events]
    for k in range(num_threads):  # each thread's events, newest first, in its own order
        assert [i for i in listed if i in set(event_ids[k])] == event_ids[k][::-1]
        assert store.get_job(own_jobs[k].id).step == num_events
    assert sorted(f.id for f in store.list_files()) == sorted(sum(file_ids, []))
    for record in store.list_files():
        assert store.read_file(record.id) == f"{record.filename[:-6].replace('-', ' ')}\n".encode()
    assert isinstance(store.list_files()[0], FileRecord)


# ------------------------------------------------------------------------------------- tenants
def test_files_and_jobs_are_scoped_to_their_tenant(store, same_second):
    alice = [store.add_file(f"a{i}.jsonl", "fine-tune", b"a\n", tenant="alice") for i in range(3)]
    bob = store.add_file("b.jsonl", "fine-tune", b"b\n", tenant="bob")
    anonymous = store.add_file("d.jsonl", "fine-tune", b"d\n")
    assert (bob.tenant, anonymous.tenant) == ("bob", "default")
    assert store.list_files(tenant="alice") == alice[::-1]
    assert store.list_files(tenant="bob") == [bob]
    assert store.list_files(tenant="default") == [anonymous]
    assert store.list_files(tenant="carol") == []
    assert store.list_files() == [anonymous, bob, *alice[::-1]]  # the service's own view
    assert store.list_files(tenant="alice", after=alice[2].id, limit=1) == [alice[1]]
    with pytest.raises(ValueError, match="after"):  # another tenant's id pages like no id
        store.list_files(tenant="alice", after=bob.id)
    assert store.get_file(bob.id, tenant="bob") == bob == store.get_file(bob.id)
    assert store.get_file(bob.id, tenant="alice") is None
    with pytest.raises(KeyError):
        store.read_file(bob.id, tenant="alice")
    assert store.read_file(bob.id, tenant="bob") == b"b\n"
    assert store.delete_file(bob.id, tenant="alice") is False
    assert os.path.exists(bob.path) and store.get_file(bob.id) == bob  # untouched
    assert store.delete_file(bob.id, tenant="bob") is True

    job = make_job(tenant="alice")
    store.add_job(job)
    assert store.get_job(job.id, tenant="alice") == job == store.get_job(job.id)
    assert store.get_job(job.id, tenant="bob") is None


def old_store(state_dir: str) -> tuple[str, str]:
    """A state directory as schema version 1 wrote it (files without a tenant), with one file
    and one job; returns their ids."""
    root = os.path.join(state_dir, "finetune")
    os.makedirs(os.path.join(root, "files"))
    os.makedirs(os.path.join(root, "checkpoints"))
    file_id, job_id = new_id("file"), new_id("ftjob")
    with open(os.path.join(root, "files", f"{file_id}.jsonl"), "wb") as f:
        f.write(b'{"text": "old"}\n')
    conn = sqlite3.connect(os.path.join(root, "state.sqlite3"))
    conn.executescript("""
        CREATE TABLE files (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, filename TEXT NOT NULL,
            purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
            status TEXT NOT NULL);
        CREATE TABLE jobs (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, model TEXT NOT NULL,
            training_file TEXT NOT NULL, validation_file TEXT, hyperparameters TEXT NOT NULL,
            suffix TEXT, seed INTEGER NOT NULL, tenant TEXT NOT NULL, status TEXT NOT NULL,
            created_at INTEGER NOT NULL, finished_at INTEGER, fine_tuned_model TEXT,
            trained_tokens INTEGER, error TEXT, adapter_path TEXT, num_steps INTEGER,
            step INTEGER NOT NULL, lora TEXT, integrations TEXT, metadata TEXT);
        CREATE INDEX jobs_by_tenant ON jobs (tenant, seq);
        CREATE INDEX jobs_by_status ON jobs (status, seq);
        CREATE TABLE events (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, job_id TEXT NOT NULL,
            created_at INTEGER NOT NULL, level TEXT NOT NULL, message TEXT NOT NULL,
            type TEXT NOT NULL, data TEXT);
        CREATE INDEX events_by_job ON events (job_id, seq);
        CREATE TABLE checkpoints (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, job_id TEXT NOT NULL,
            created_at INTEGER NOT NULL, step_number INTEGER NOT NULL, metrics TEXT NOT NULL,
            fine_tuned_model_checkpoint TEXT NOT NULL, path TEXT NOT NULL);
        CREATE INDEX checkpoints_by_job ON checkpoints (job_id, seq);
        PRAGMA user_version=1;
    """)
    conn.execute("INSERT INTO files (id, filename, purpose, bytes, created_at, status) "
                 "VALUES (?, 'old.jsonl', 'fine-tune', 16, 1700000000, 'processed')", (file_id,))
    conn.execute("INSERT INTO jobs (id, model, training_file, hyperparameters, seed, tenant, "
                 "status, created_at, step) VALUES (?, 'm', ?, '{}', 1, 'alice', 'succeeded', "
                 "1700000000, 0)", (job_id, file_id))
    conn.commit()
    conn.close()
    return file_id, job_id


def test_a_version_1_store_is_migrated_in_place(tmp_path):
    state_dir = str(tmp_path / "state")
    file_id, job_id = old_store(state_dir)
    with StateStore(state_dir) as s:
        version = s._conn.execute("PRAGMA user_version").fetchone()[0]
        assert version == SCHEMA_VERSION == 3
        old = s.get_file(file_id)
        assert (old.filename, old.bytes, old.tenant) == ("old.jsonl", 16, "default")
        assert s.read_file(file_id, tenant="default") == b'{"text": "old"}\n'  # content kept
        assert s.get_file(file_id, tenant="alice") is None
        assert s.get_job(job_id, tenant="alice").training_file == file_id  # jobs had tenants
        new = s.add_file("new.jsonl", "fine-tune", b"n\n", tenant="alice")
        assert s.list_files(tenant="alice") == [new]
        assert s.list_files(tenant="default") == [old]
        indexes = {row[1] for row in s._conn.execute("PRAGMA index_list(files)")}
        assert "files_by_tenant" in indexes
    with StateStore(state_dir) as reopened:  # opening again migrates nothing more
        assert reopened.list_files() == [new, old]
