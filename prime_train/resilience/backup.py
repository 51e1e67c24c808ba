"""Checkpoint backup: every new whole checkpoint goes to the bucket in the background.

`BackupWatcher` is one of the supervisor's slow watchers (polled on resilience/background.py's thread). Its
`poll()` never waits on the network: an upload and a heartbeat copy each run in a thread of their
own, at most one of each at a time, and what they did comes back as events on a later poll.
Training never waits for a backup, and a backup that fails never stops training: its observations never
carry a verdict.

Only the newest whole checkpoint is uploaded: when several appear during one upload the older ones
are skipped (the bucket wants the newest; disk retention may be deleting the older ones anyway).

Before the first attempt, `restore_before_start` fills an empty checkpoint directory from the bucket,
so a run on a fresh spot instance resumes where the last one stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_train.contract import Event
from prime_train.integrations.storage import CheckpointStore, EventSink, StorageError, remove_stale_staging
from prime_train.kit.observe import Note, Observation, Watcher, note
from prime_train.rundir import RunDir, newest_checkpoint

if TYPE_CHECKING:
    from prime_train.config.schema import CkptConfig

logger = logging.getLogger("prime_train.backup")

_UNKNOWN = object()  # the bucket's newest step before it has been listed


class BackupWatcher(Watcher):
    """Uploads each new whole step-N in the background, prunes the bucket, copies the heartbeat."""

    blocking = True

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        store: CheckpointStore,
        *,
        keep_last: int | None,
        keep_every: int | None,
        heartbeat_path: str | os.PathLike[str] | None,
        heartbeat_interval_s: float,
        retry_initial_s: float = 60.0,
        retry_max_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ckpt_dir = Path(ckpt_dir)
        self.store = store
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.heartbeat_path = Path(heartbeat_path) if heartbeat_path is not None else None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.clock = clock

        self._lock = threading.Lock()
        self._pending: list[Note] = []  # events produced by the worker threads
        self._upload: threading.Thread | None = None
        self._uploading: int | None = None
        self._remote_newest: Any = _UNKNOWN
        self._retry_step: int | None = None
        self._retry_at = 0.0
        self._retry_delay = retry_initial_s
        self._heartbeat: threading.Thread | None = None
        self._next_heartbeat = clock()
        self._heartbeat_failing = False
        for text in store.notes:
            self._pending.append(note(Event.CHECKPOINT_BACKUP_NOTE, note=text))
        removed = remove_stale_staging(self.ckpt_dir)
        if removed:
            logger.info("removed temp archives of an interrupted upload: %s", ", ".join(p.name for p in removed))

    # ------------------------------------------------------------ state for status and tests

    @property
    def uploading_step(self) -> int | None:
        """The step being uploaded now, or None (the disk watcher may want to spare it)."""
        with self._lock:
            return self._uploading

    @property
    def uploaded_step(self) -> int | None:
        """The newest step known to be whole in the bucket (None before the bucket was listed or when empty)."""
        with self._lock:
            return None if self._remote_newest is _UNKNOWN else self._remote_newest

    # ------------------------------------------------------------ the watcher interface

    def poll(self, now: float | None = None) -> Observation:
        """Start what is due (an upload, a heartbeat copy) and return what finished since the last poll."""
        events = self._maybe_start_upload(force=False)
        self._maybe_start_heartbeat(force=False)
        return Observation(self._drain() + events)

    def flush(self, timeout_s: float) -> Observation:
        """At shutdown: finish the upload in flight, upload a newer checkpoint if one appeared (the save
        a SIGTERM made), copy the heartbeat once more; never longer than timeout_s in all.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        events: list[Note] = []
        self._join(self._upload, deadline)
        if self._upload is None or not self._upload.is_alive():
            events += self._maybe_start_upload(force=True)
            self._join(self._upload, deadline)
        self._maybe_start_heartbeat(force=True)
        self._join(self._heartbeat, deadline)
        events = self._drain() + events
        with self._lock:
            still = self._uploading
        if still is not None:
            events.append(
                note(
                    Event.CHECKPOINT_UPLOAD_UNFINISHED,
                    step=still,
                    reason=f"still uploading after {timeout_s:.0f}s at shutdown; the bucket keeps the previous one",
                )
            )
        return Observation(events)

    # ------------------------------------------------------------ uploads

    def _maybe_start_upload(self, *, force: bool) -> list[Note]:
        with self._lock:
            if self._upload is not None and self._upload.is_alive():
                return []
            newest = newest_checkpoint(self.ckpt_dir)
            if newest is None:
                return []
            known = self._remote_newest
            if known is not _UNKNOWN and known is not None and newest.step <= known:
                return []
            if not force and newest.step == self._retry_step and self.clock() < self._retry_at:
                return []
            self._uploading = newest.step
            thread = threading.Thread(
                target=self._upload_one, args=(newest.step, newest.path), name=f"upload-step-{newest.step}", daemon=True
            )
            self._upload = thread
        thread.start()
        return [note(Event.CHECKPOINT_UPLOAD_STARTED, step=newest.step, path=str(newest.path))]

    def _upload_one(self, step: int, path: Path) -> None:
        _lower_priority()
        started = time.monotonic()
        events: list[Note] = []
        try:
            if self._remote_newest is _UNKNOWN:
                remote = self.store.list_remote()
                with self._lock:
                    self._remote_newest = remote[-1].step if remote else None
            known = self._remote_newest
            if known is not None and step <= known:
                events.append(note(Event.CHECKPOINT_ALREADY_UPLOADED, step=step, remote_step=known))
                self._succeeded()
                return
            result = self.store.upload(path, step)
        except Exception as exc:
            events.append(self._failed_event(step, path, exc))
            return
        finally:
            with self._lock:
                self._uploading = None
                self._pending.extend(events)
                events = []
        with self._lock:
            self._remote_newest = step
        self._succeeded()
        done: list[Note] = [
            note(
                Event.CHECKPOINT_UPLOADED,
                step=step,
                bytes=result["bytes"],
                raw_bytes=result["raw_bytes"],
                files=result["files"],
                seconds=round(time.monotonic() - started, 2),
                compression=result["compression"],
                key=result["archive_key"],
            )
        ]
        with self._lock:  # reported now; pruning the bucket may take a while longer
            self._pending.extend(done)
        done = []
        try:
            deleted = self.store.apply_retention(self.keep_last, self.keep_every)
            if deleted:
                done.append(note(Event.REMOTE_CHECKPOINTS_DELETED, steps=deleted, reason="retention"))
        except Exception as exc:
            done.append(note(Event.REMOTE_RETENTION_FAILED, reason=self._reason(exc)))
        with self._lock:
            self._pending.extend(done)

    def _failed_event(self, step: int, path: Path, exc: BaseException) -> Note:
        if not path.is_dir():
            # disk retention (or a person) removed it mid-upload: nothing to retry, a newer one exists
            with self._lock:
                self._retry_step = None
            return note(
                Event.CHECKPOINT_UPLOAD_SKIPPED,
                step=step,
                reason=f"{path.name} was deleted locally while it was being uploaded",
            )
        with self._lock:
            self._retry_step = step
            self._retry_at = self.clock() + self._retry_delay
            retry_in = self._retry_delay
            self._retry_delay = min(self._retry_delay * 2, self.retry_max_s)
        return note(Event.CHECKPOINT_UPLOAD_FAILED, step=step, reason=self._reason(exc), retry_in_s=round(retry_in, 1))

    def _succeeded(self) -> None:
        with self._lock:
            self._retry_step = None
            self._retry_delay = self.retry_initial_s

    def _reason(self, exc: BaseException) -> str:
        # StorageError messages are built without credentials; anything else is scrubbed here
        text = str(exc) if isinstance(exc, StorageError) else f"{type(exc).__name__}: {exc}"
        return self.store.scrub(text)

    # ------------------------------------------------------------ heartbeat

    def _maybe_start_heartbeat(self, *, force: bool) -> None:
        if self.heartbeat_path is None:
            return
        with self._lock:
            if self._heartbeat is not None and self._heartbeat.is_alive():
                return
            now = self.clock()
            if not force and now < self._next_heartbeat:
                return
            self._next_heartbeat = now + self.heartbeat_interval_s
            thread = threading.Thread(target=self._copy_heartbeat, name="heartbeat-upload", daemon=True)
            self._heartbeat = thread
        thread.start()

    def _copy_heartbeat(self) -> None:
        try:
            self.store.put_heartbeat(self.heartbeat_path)  # type: ignore[arg-type]
        except Exception as exc:
            with self._lock:
                first = not self._heartbeat_failing
                self._heartbeat_failing = True
                if first:  # once per outage, not every interval
                    self._pending.append(note(Event.HEARTBEAT_UPLOAD_FAILED, reason=self._reason(exc)))
            return
        with self._lock:
            if self._heartbeat_failing:
                self._pending.append(note(Event.HEARTBEAT_UPLOAD_RECOVERED))
            self._heartbeat_failing = False

    # ------------------------------------------------------------ helpers

    def _drain(self) -> list[Note]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    @staticmethod
    def _join(thread: threading.Thread | None, deadline: float) -> None:
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


def _lower_priority() -> None:
    """Compressing a checkpoint must not take CPU from the trainer: nice this thread (Linux)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def restore_before_start(
    ckpt_dir: str | os.PathLike[str], store: CheckpointStore, events: EventSink | None = None
) -> int | None:
    """With no whole checkpoint on disk, fetch the newest whole one from the bucket; return its step.

    A local checkpoint always wins (it is at least as new as anything this machine uploaded). Raises
    StorageError when the bucket cannot be read: the caller should stop rather than train from scratch.
    """
    ckpt_dir = Path(ckpt_dir)
    local = newest_checkpoint(ckpt_dir)
    if local is not None:
        if events is not None:
            events.emit(
                Event.REMOTE_RESTORE_SKIPPED, reason=f"local checkpoint {local.path.name} present", step=local.step
            )
        return None
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = store.restore_newest(ckpt_dir, events)
    if step is None and events is not None:
        events.emit(Event.REMOTE_RESTORE_SKIPPED, reason=f"no whole checkpoint in {store.url}", step=None)
    return step


def start_backup(
    ck: CkptConfig, run_dir: RunDir, events: EventSink, say: Callable[[str], None]
) -> tuple[BackupWatcher | None, str | None]:
    """With ckpt.remote: pull the newest whole checkpoint when there is none here, then a watcher that backs up
    each new one. Returns (watcher, None), or (None, why) when the bucket cannot be read: a run must not silently
    start from scratch."""
    try:
        store = CheckpointStore(ck.remote, endpoint_url=ck.remote_endpoint_url, compression=ck.remote_compression)
        if ck.resume == "auto":
            step = restore_before_start(run_dir.checkpoints_dir, store, events)
            if step is not None:
                say(f"restored checkpoint step-{step} from {ck.remote}")
    except (StorageError, ImportError) as exc:
        message = f"cannot read checkpoints from ckpt.remote = {ck.remote!r}: {exc}"
        events.emit(Event.REMOTE_RESTORE_FAILED, reason=message)
        say(message)
        return None, message
    watcher = BackupWatcher(
        run_dir.checkpoints_dir,
        store,
        keep_last=ck.remote_keep_last,
        keep_every=ck.keep_every,
        heartbeat_path=run_dir.progress_path,
        heartbeat_interval_s=ck.heartbeat_interval_s,
    )
    return watcher, None
