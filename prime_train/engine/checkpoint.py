"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, reshardable, never half-visible.

A save writes <run>/checkpoints/step-N.tmp (ckpt.dir/step-N.tmp when set) from every rank (each rank its own shards,
rank 0 the DCP `.metadata`, meta.json and hf/), and only when every rank reports its part written does rank 0
rename it to step-N. So a directory named step-N is always whole, and a crash at any moment leaves
at worst a step-N.tmp, which the next start deletes.

Async saves copy the state to CPU before returning (DCP's stager) and write in a background
thread; at most one is in flight. The trainer calls `poll()` every step and `wait()` at exit;
both finalize (agree across ranks, rename, apply retention) on the training thread, so the
checkpoint directory only changes at points every rank reaches together.

SIGTERM (preemption) design, which the trainer follows:
  1. the signal handler only sets a flag; the step in progress finishes (a half-applied optimizer
     step must never be saved);
  2. ranks agree on the flag (any rank's signal stops every rank at the same step);
  3. `wait()` finalizes the async save in flight, so the previous checkpoint is whole on disk
     before any new write starts, and an early SIGKILL still finds a resumable step-N;
  4. `save(final=True)` writes synchronously (an async save would race process exit) and
     returns only after step-N is renamed on every rank;
  5. the process exits 75, which the supervisor reads as "checkpointed, resume me".
The rename is the commit point: SIGKILL before it loses only the .tmp, after it nothing.

A whole checkpoint can still be damaged later (a disk that filled, a copy cut short, bit rot), and a
damaged newest checkpoint must not become a crash loop. So each save also writes manifest.json: every
file with its size and CRC-32, each rank checksumming its own shards (in the background thread for an
async save). Before resuming, rank 0 verifies the newest checkpoint (the DCP .metadata loads, every
file it points into is there and long enough, every file matches the manifest); one that fails, or that
verifies but does not load (safe_dcp: nothing in a checkpoint is unpickled but plain data), is renamed
step-N.corrupt with quarantine.json saying why (never deleted; the supervisor reports it), and the next is tried.

Every method here except `saving`, `latest_step`, `due`, `holds` and `set_hf_assets` is a collective when
torch.distributed is initialized: every rank calls it at the same point of the program, as the
trainer does. A checkpoint directory must be on a filesystem every rank sees (DCP's contract).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from prime_train.config.schema import CkptConfig
from prime_train.contract import fsync_dir, read_json, write_json_atomic
from prime_train.engine import safe_dcp
from prime_train.engine.lora import check_resume_compatible
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.train_state import TrainState
from prime_train.engine.verify import (  # re-exported: the checkpoint's files and checks
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    digest_files,
    is_whole_checkpoint,
    verify_checkpoint,
)
from prime_train.engine.versions import torch_minor
from prime_train.retention import (
    TMP_OWNER_FILE,
    apply_retention,
    claim_tmp,
    clean_stale_tmp,
    quarantine_checkpoint,
    safe_remove_checkpoint,
    tmp_writer,
)
from prime_train.rundir import STEP_RE, RunDir, list_checkpoints, newest_checkpoint

logger = logging.getLogger("prime_train.engine.checkpoint")

# A one-process run saves with no_dist=True on purpose; DCP warns about it on every save and load.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

META_FILE = "meta.json"
HF_ASSETS_DIR = "hf"


@dataclass
class _PendingSave:
    step: int
    tokens_seen: int
    tmp: Path
    dest: Path
    future: Future | None  # None for a synchronous save; else DCP's write, then this rank's checksums
    started: float
    wall_time: float
    final: bool
    hf_config: Any = None
    tokenizer: Any = None
    stager: Any = None  # a stager used for this save only (torch 2.11/2.12), closed at finalize


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file gone mid-walk only makes the logged size approximate
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# torch 2.11 and 2.12 close a DefaultStager at the end of each save (its copier forgets how to copy), so a
# second save through the same stager fails with `KeyError: <class 'type'>` (seen on an H100 with 2.11).
# 2.10 and 2.13+ keep it open: one stager for the run reuses its pinned buffers across saves.
STAGER_REUSABLE = not (2, 11) <= torch_minor() < (2, 13)


def _make_stager(shared: bool):
    """A stager for async saves: it copies the state to host memory before async_save returns, so the
    optimizer may change the parameters right after. On GPU the buffers are pinned and every copy is queued
    before one synchronize (on the H200 the blocking part of a 124M model's save was 0.32-1.07 s with a copy and a
    wait per tensor); on CPU neither means anything and both are off, but the same stager path runs, so tests cover
    it. `shared`: the buffers live in shared memory, for ckpt.async_writer = 'process' (DCP's checkpoint process
    maps them instead of receiving a copy)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=shared,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


def _one_rank_group() -> None:
    """The default process group DCP's checkpoint process needs (it joins one of its own, with the same ranks), for
    a run of one process that no launcher gave one: one rank over gloo, its store in this process. The checkpoint
    process's store listens on MASTER_ADDR (unset: this host by its name, which a sandbox may not resolve)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    logger.info("ckpt.async_writer = 'process': a one-rank gloo process group for DCP's checkpoint process")


def _stop_checkpoint_process() -> None:
    """End DCP's checkpoint process (ckpt.async_writer = 'process'), if a save started one, by asking it to: left to
    the interpreter's exit it reads a closed pipe and prints an EOFError traceback into the trainer's log, which reads
    as the trainer's own crash. DCP keeps it in a private module global (torch 2.11 to 2.14 alike); gone, nothing."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if process is not None:
        executor._CHECKPOINT_PROCESS = None
        process.__del__()  # TERMINATE, a join of up to 5 s, then SIGTERM; a second call (at collection) does nothing


def _set_aside_param_groups(state_dict: dict[str, Any], saved_keys: set[str]) -> dict[str, Any] | None:
    """Take out of `state_dict` the param groups the checkpoint has in the other layout (TrainState.flat_optim: saved
    at another pp_size) and return them, to go back unread: they hold what the config sets and the lr, which the
    scheduler restores; the optimizer's tensors have the same keys in both layouts and load as usual."""
    if not isinstance(optim := state_dict.get("optim"), dict):
        return None
    if "param_groups" in optim:  # nested layout: saved as optim.param_groups.<index>.<field>
        names = ["param_groups"] if not any(k.startswith("optim.param_groups.0.") for k in saved_keys) else []
    else:  # flat layout: optim.param_groups.<parameter name>.<field>
        names = [k for k in optim if k.startswith("param_groups.") and f"optim.{k}" not in saved_keys]
    return {name: optim.pop(name) for name in names} if names else None


class StartOver(RuntimeError):
    """This start cannot go on but the next one can: the checkpoint it half loaded is set aside (a crash, retried)."""


class Checkpointer:
    """Saves and loads TrainState as step-N DCP checkpoints in the run directory, with retention."""

    def __init__(
        self,
        run_dir: RunDir,
        cfg: CkptConfig,
        *,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
    ):
        """`process_group`: a gloo (CPU-capable) group that nothing else uses while a save is in
        flight; unset, the checkpointer creates its own over the whole world."""
        self.run_dir = run_dir
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        # the run layout's (Config.layout): ckpt.dir, a place every node sees when the run directories are node-local
        # disks (several nodes), else checkpoints/; the supervisor watches the same directory
        self.ckpt_dir = run_dir.checkpoints_dir
        if cfg.async_save and cfg.async_writer == "process" and not dist.is_initialized():
            _one_rank_group()
        self._distributed = dist.is_available() and dist.is_initialized()
        self._save_pg: dist.ProcessGroup | None = None
        self._sync_pg: dist.ProcessGroup | None = None
        if self._distributed:
            # An async save runs DCP's collectives in a background thread. Sharing a communicator
            # with the training thread would interleave the two streams of collectives across
            # ranks, so saves get a gloo group of their own (gloo: async_save needs a CPU backend),
            # and our finalize agreement, which runs on the training thread while a save may be
            # in flight, gets a second one.
            if process_group is None:
                self._save_pg = dist.new_group(backend="gloo")
                self._sync_pg = dist.new_group(backend="gloo")
            else:
                ranks = dist.get_process_group_ranks(process_group)
                self._save_pg = process_group
                self._sync_pg = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        self._pending: _PendingSave | None = None
        self._stager = None  # kept across saves only where torch allows it (STAGER_REUSABLE)
        self.keep_steps: frozenset[int] = frozenset()  # kept out of retention (ckpt.keep_best's step)
        # DCP names each rank's shards __<rank in the save group>_<n>.distcp: this rank checksums its own
        self._shard_prefix = f"__{dist.get_group_rank(self._save_pg, rank) if self._distributed else 0}_"
        self._digester: ThreadPoolExecutor | None = None  # checksums an async save's shards off the training thread
        self.quarantined: list[tuple[str, str]] = []  # (checkpoint, what was wrong) set aside by resolve_resume
        # a LoRA run's adapter_identity: written into meta.json, and a checkpoint made with others is not resumed
        self.lora_identity: dict[str, Any] | None = None
        # what the job adds to meta.json (DPO: the digest of the pairs its saved reference log-probs belong to)
        self.meta_fields: dict[str, Any] = {}
        # called before a checkpoint loads, on every rank, with its path (None: none to resume), its meta.json (or
        # None) and whether an earlier load of this start failed part way (the model no longer the starting weights)
        self.before_load: Callable[[Path | None, dict[str, Any] | None, bool], None] | None = None
        self._hf_config = None
        self._tokenizer = None

        newest = None
        probe = None
        if rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            clean_stale_tmp(self.ckpt_dir)
            found = newest_checkpoint(self.ckpt_dir)
            newest = found.step if found else None
            if self._distributed:
                probe = self._write_probe()
        # the broadcast also keeps other ranks from writing before the stale .tmp dirs are gone
        self._latest_step, probe = self.from_rank0((newest, probe))
        if probe is not None:
            self._check_shared(*probe)

    def _write_probe(self) -> tuple[str, str]:
        """A file only this start writes, for every rank to find in its own view of the checkpoint directory."""
        token = os.urandom(8).hex()
        name = f".shared-probe-{token}"
        (self.ckpt_dir / name).write_text(token)
        return name, token

    def _check_shared(self, name: str, token: str) -> None:
        """EngineConfigError (exit 78) on every rank unless every rank reads rank 0's probe file in the checkpoint
        directory. DCP writes each rank's shards into its own view of that directory and rank 0 the metadata: with
        several nodes and node-local directories no checkpoint would ever be whole, and a week-long run would find
        out at its first resume. A few milliseconds at start-up instead."""
        path = self.ckpt_dir / name
        try:
            seen = path.read_text() == token
        except OSError:
            seen = False
        blind = [r for r, ok in enumerate(self._gather(seen)) if not ok]
        if self.rank == 0:
            path.unlink(missing_ok=True)
        if blind:
            raise EngineConfigError(
                f"the checkpoint directory {self.ckpt_dir} is not one directory for every rank: rank(s) "
                f"{', '.join(map(str, blind))} do not see the file rank 0 wrote there, so no checkpoint would ever "
                "be whole; with several nodes set ckpt.dir to a directory every node mounts (NFS, a shared volume, "
                "a bucket mount)"
            )

    # ------------------------------------------------------------------ collectives

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank."""
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._sync_pg, group_src=0)
        return box[0]

    def _gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self._sync_pg)
        dist.all_gather_object(out, obj, group=self._sync_pg)
        return out

    def _all_true(self, flag: bool) -> bool:
        if not self._distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._sync_pg)
        return bool(t.item())

    # ------------------------------------------------------------------ public API

    @property
    def saving(self) -> bool:
        """True while a save is started but not yet finalized."""
        return self._pending is not None

    def latest_step(self) -> int | None:
        """Step of the newest whole checkpoint this run knows of (found at start or written since)."""
        return self._latest_step

    def due(self, step: int, *, last: bool) -> bool:
        """Whether the loop saves after `step`: every ckpt.interval steps, but not at the last (the run's end saves)."""
        return step % self.cfg.interval == 0 and not last

    def holds(self, step: int) -> bool:
        """Whether the newest whole checkpoint on disk is step-`step` (the end of a run or a stop need not save)."""
        newest = newest_checkpoint(self.ckpt_dir)
        return newest is not None and newest.step == step

    def set_hf_assets(self, model_config, tokenizer) -> None:
        """Config and tokenizer saved into each checkpoint's hf/ so `dcp_to_hf` can rebuild the model offline."""
        self._hf_config = model_config
        self._tokenizer = tokenizer

    def save(self, state: TrainState, step: int, *, final: bool = False) -> None:
        """Write checkpoint step-N; async (returns at once) when ckpt.async_save and not final."""
        self.wait()
        dest = self.ckpt_dir / f"step-{step}"
        tmp = self.ckpt_dir / f"step-{step}.tmp"
        decision = None
        if self.rank == 0:
            try:
                decision = self._prepare_tmp(dest, tmp)
            except Exception as e:  # every rank must hear of it, or the others wait in DCP forever
                decision = f"cannot prepare {tmp}: {type(e).__name__}: {e}"
        # rank 0 decides for all; the broadcast is also the barrier before anyone writes into tmp
        decision = self.from_rank0(decision)
        if decision == "exists":
            logger.info("checkpoint step-%d already exists; not saving it again", step)
            return
        if decision != "go":
            raise RuntimeError(f"checkpoint step-{step} was not saved: {decision}")

        started = time.monotonic()
        pending = _PendingSave(
            step, state.tokens_seen, tmp, dest, None, started, time.time(), final, self._hf_config, self._tokenizer
        )
        state_dict = state.state_dict()
        no_dist = not self._distributed
        if self.cfg.async_save and not final:
            process = self.cfg.async_writer == "process"
            stager = self._stager or _make_stager(shared=process)
            if STAGER_REUSABLE:
                self._stager = stager
            else:
                pending.stager = stager  # closed when this save is finalized
            response = dcp.async_save(
                state_dict,
                checkpoint_id=tmp,
                process_group=self._save_pg,
                no_dist=no_dist,
                async_stager=stager,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD,
            )
            written = getattr(response, "upload_completion", response)
            if self._digester is None:
                self._digester = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-digest")
            pending.future = self._digester.submit(self._digest_when_written, written, tmp)
            self._pending = pending
            logger.info(
                "checkpoint step %d: async save started, training blocked %.2fs", step, time.monotonic() - started
            )
            return
        self._pending = pending
        error: BaseException | None = None
        digest: dict[str, Any] = {}
        try:
            dcp.save(state_dict, checkpoint_id=tmp, process_group=self._save_pg, no_dist=no_dist)
            digest = self._own_digest(tmp)
        except Exception as e:  # finalize reports it on every rank
            error = e
        self._finalize(error, digest)

    def _own_digest(self, tmp: Path) -> dict[str, Any]:
        return digest_files(tmp, sorted(tmp.glob(f"{self._shard_prefix}*")))

    def _digest_when_written(self, written: Future, tmp: Path) -> dict[str, Any]:
        written.result()
        return self._own_digest(tmp)

    def _prepare_tmp(self, dest: Path, tmp: Path) -> str:
        if dest.is_dir():
            return "exists"
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.is_symlink() or tmp.exists():
            writer = None if tmp.is_symlink() else tmp_writer(tmp)
            if writer is not None:  # two writers of one run directory: the run lock should make this impossible
                return f"{tmp} is being written by {writer}"
            safe_remove_checkpoint(tmp, self.ckpt_dir)
        claim_tmp(tmp)  # step-N.tmp appears with this process named inside: cleanup leaves it while we live
        return "go"

    def poll(self) -> None:
        """Finalize the async save if every rank has finished writing; never blocks on I/O."""
        if self._pending is None:
            return
        assert self._pending.future is not None
        if self._all_true(self._pending.future.done()):
            self._finalize()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and finalized."""
        if self._pending is not None:
            self._finalize()

    def close(self) -> None:
        """Finalize the save in flight and free the pinned staging buffers (GPU)."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._digester is not None:
            self._digester.shutdown()
            self._digester = None
        if self.cfg.async_writer == "process":
            _stop_checkpoint_process()

    def resolve_resume(self) -> Path | None:
        """The checkpoint to resume from per ckpt.resume ('never', 'auto' or a step-N path), or None."""
        result: tuple[str | None, str | None, list] = (None, None, [])
        if self.rank == 0 or not self._distributed:
            result = self._resolve_resume_local()
        path, error, self.quarantined = self.from_rank0(result)
        if error is not None:
            raise EngineConfigError(error)
        if self.quarantined:
            newest = path and STEP_RE.match(Path(path).name)
            self._latest_step = int(newest.group(1)) if newest else None
        return Path(path) if path is not None else None

    def _newest_verified(self) -> tuple[str | None, list[tuple[str, str]]]:
        """The newest checkpoint that verifies, after setting aside every newer one that does not."""
        quarantined: list[tuple[str, str]] = []
        for found in reversed(list_checkpoints(self.ckpt_dir)):
            problem = verify_checkpoint(found.path)
            if problem is None:
                return str(found.path), quarantined
            quarantined.append((found.path.name, problem))
            try:
                quarantine_checkpoint(found.path, self.ckpt_dir, problem)
            except (OSError, ValueError) as e:  # it is skipped all the same; a later start tries again
                logger.warning("could not set %s aside: %s", found.path.name, e)
        return None, quarantined

    def _resolve_resume_local(self) -> tuple[str | None, str | None, list]:
        value = self.cfg.resume
        if value == "never":
            return None, None, []
        if value == "auto":
            path, quarantined = self._newest_verified()
            if quarantined:
                logger.warning(
                    "resuming from %s instead: %s",
                    Path(path).name if path else "nothing (no checkpoint verifies; starting from step 0)",
                    "; ".join(f"{name} {why}" for name, why in quarantined),
                )
            return path, None, quarantined
        path = Path(value).expanduser()
        if not path.is_absolute() and not path.exists() and (self.ckpt_dir / value).exists():
            path = self.ckpt_dir / value  # a bare "step-N" names one of this run's checkpoints
        problem = verify_checkpoint(path)
        if problem is not None:
            return (
                None,
                (
                    f"ckpt.resume = {value!r}: {path} is not a whole checkpoint: {problem}. "
                    f"Point ckpt.resume at a step-N directory holding a {DCP_METADATA_FILE} file, "
                    "or set it to 'auto' (newest whole checkpoint) or 'never'."
                ),
                [],
            )
        return str(path), None, []

    def problem_with(self, path: Path) -> str | None:
        """Why `path` is not a whole checkpoint (rank 0's verdict, on every rank), or None."""
        problem = verify_checkpoint(path) if self.rank == 0 or not self._distributed else None
        return self.from_rank0(problem)

    def resume(self, state: TrainState) -> Path | None:
        """Resolve ckpt.resume and load it into `state`: the path loaded, or None (start at step 0).

        One that verifies but does not load (an item the safe loader refuses, bytes that do not decode) is set
        aside as step-N.corrupt like a damaged one and the one before it is loaded: never a crash loop. One that
        does not fit this config's model is a configuration error and stays; memory or I/O errors are raised.
        With no earlier checkpoint the model is half loaded: this raises, and the next start trains from step 0.
        """
        set_aside: list[tuple[str, str]] = []
        touched = False  # a load failed part way: the model holds some of a checkpoint's weights
        while True:
            path = self.resolve_resume()
            self.quarantined = set_aside = set_aside + self.quarantined
            if path is None:
                if self.before_load is not None and not touched:
                    self.before_load(None, None, False)
                if any(why.startswith(safe_dcp.DOES_NOT_LOAD) for _, why in set_aside):
                    raise StartOver(
                        f"{'; '.join(f'{name} {why}' for name, why in set_aside)}. It is set aside as .corrupt and "
                        "no earlier checkpoint is whole; the model is half loaded, so this start stops here and the "
                        "next one trains from step 0"
                    )
                return None
            meta = self._check_adapter(path)  # before anything loads: a refusal is exit 78, the checkpoint stays whole
            if self.before_load is not None:
                self.before_load(path, meta, touched)
            failure: BaseException | None = None
            try:
                self.load(state, path)
            except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
                failure = e
            worst = safe_dcp.worst_failure(self._gather(None if failure is None else safe_dcp.load_failure(failure)))
            if worst is None:
                if set_aside and (m := STEP_RE.match(path.name)):
                    self._latest_step = int(m.group(1))  # the newer ones are set aside
                return path
            rank, kind, why = worst
            where = f" on rank {rank}" if self._distributed else ""
            if kind == "other":
                raise failure or RuntimeError(f"checkpoint {path.name} could not be loaded{where}: {why}")
            if kind == "config":
                raise EngineConfigError(
                    f"checkpoint {path} does not fit the model this config builds{where} ({why}); it is left as it "
                    "is: resume with the config it was saved with, or start over with --fresh"
                )
            problem = f"{safe_dcp.DOES_NOT_LOAD}{where} ({why})"
            if self.cfg.resume != "auto":
                raise EngineConfigError(
                    f"ckpt.resume = {self.cfg.resume!r}: {path} {problem}. Point ckpt.resume at another "
                    "checkpoint, or set it to 'auto' (newest whole checkpoint) or 'never'."
                )
            error = None
            if self.rank == 0:
                try:
                    quarantine_checkpoint(path, self.ckpt_dir, problem)
                except (OSError, ValueError) as e:
                    error = f"{path.name} {problem}, and it could not be set aside ({e}); move it away by hand"
            if (error := self.from_rank0(error)) is not None:  # resolving again would pick the same checkpoint
                raise RuntimeError(error)
            set_aside.append((path.name, problem))
            touched = True
            logger.warning("%s %s; set aside, trying the checkpoint before it", path.name, problem)

    def _check_adapter(self, path: Path) -> dict[str, Any] | None:
        """Refuse (EngineConfigError, exit 78, nothing loaded or set aside) a checkpoint whose LoRA settings, in its
        meta.json, are not this run's: a LoRA checkpoint without LoRA, a full one with it, another rank or alpha or
        other targets. A meta.json that cannot be read says nothing here; loading decides. Returns the meta.json
        (rank 0's read, on every rank), or None."""
        meta = read_json(path / META_FILE) if self.rank == 0 or not self._distributed else None
        if not isinstance(meta := self.from_rank0(meta), dict):
            return None
        saved = meta.get("lora")
        if saved is not None and not (isinstance(saved, dict) and {"rank", "alpha", "target_modules"} <= set(saved)):
            return meta  # not what a save writes: loading decides
        try:
            check_resume_compatible(saved, self.lora_identity, checkpoint=f"checkpoint {path}")
        except EngineConfigError:
            raise
        except (TypeError, ValueError):  # a hand-edited identity that does not compare: loading decides
            pass
        return meta

    def load(self, state: TrainState, path: Path) -> None:
        """Load checkpoint `path` into `state` (any saving world size), this rank's RNG included."""
        self.wait()
        path = Path(path)
        started = time.monotonic()
        saved = safe_dcp.read_metadata(path).state_dict_metadata
        saved_keys = set(saved)
        state_dict = state.state_dict()
        for key in list(state_dict):
            if key in ("model", "optim"):
                continue  # DCP names the missing tensors itself
            value, size = state_dict[key], getattr(saved.get(key), "size", None)
            if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
                # a self-paced curriculum's scores of other data (rows added or removed since): not these rows'
                shapes = tuple(size), tuple(value.shape)
                logger.warning("%s has %s of shape %s, not %s; starting it fresh", path.name, key, *shapes)
                del state_dict[key]
                continue
            if key not in saved_keys and not any(k.startswith(key + ".") for k in saved_keys):
                if key.startswith(("dataloader/", "rng/")):
                    logger.warning(
                        "%s has no %s (saved by a different number of ranks?); this rank starts it fresh",
                        path.name,
                        key,
                    )
                else:
                    logger.warning("%s has no %r; keeping the current value", path.name, key)
                del state_dict[key]
        kept = _set_aside_param_groups(state_dict, saved_keys)
        # never torch's default reader and planner: they unpickle .metadata and every non-tensor item unrestricted
        safe_dcp.load(state_dict, path, process_group=self._save_pg, no_dist=not self._distributed)
        if kept is not None:
            state_dict["optim"].update(kept)
        state.load_state_dict(state_dict)
        logger.info("loaded checkpoint %s (step %d) in %.2fs", path, state.step, time.monotonic() - started)

    # ------------------------------------------------------------------ finalize

    def _write_extras(self, p: _PendingSave) -> None:
        """Rank 0's small files: meta.json and the hf/ config + tokenizer."""
        meta = {
            "step": p.step,
            "tokens_seen": p.tokens_seen,
            "time": p.wall_time,
            "world_size": self.world_size,
            "final": p.final,
        }
        if self.lora_identity is not None:
            meta["lora"] = self.lora_identity  # what a resume must agree on (engine/lora.py check_resume_compatible)
        meta.update(self.meta_fields)
        write_json_atomic(p.tmp / META_FILE, meta)
        if p.hf_config is not None or p.tokenizer is not None:
            hf_dir = p.tmp / HF_ASSETS_DIR
            hf_dir.mkdir(exist_ok=True)
            if p.hf_config is not None:
                p.hf_config.save_pretrained(hf_dir)
            if p.tokenizer is not None:
                p.tokenizer.save_pretrained(hf_dir)

    def _finalize(self, error: BaseException | None = None, digest: dict[str, Any] | None = None) -> None:
        """Agree that every rank wrote its part, then rank 0 writes the manifest, renames step-N.tmp -> step-N
        and prunes."""
        p = self._pending
        assert p is not None
        self._pending = None
        if p.future is not None:
            try:
                digest = p.future.result()
            except Exception as e:
                error = e
        if p.stager is not None:
            p.stager.close()
        if error is None and self.rank == 0:
            try:
                self._write_extras(p)
            except Exception as e:
                error = e
        reports = self._gather((None if error is None else f"{type(error).__name__}: {error}", digest or {}))
        failed = [f"rank {r}: {msg}" for r, (msg, _) in enumerate(reports) if msg is not None]

        committed_error = None
        if not failed and self.rank == 0:
            try:
                if not (p.tmp / DCP_METADATA_FILE).is_file():
                    raise RuntimeError(f"{p.tmp} has no {DCP_METADATA_FILE} after the save reported success")
                self._write_manifest(p, [d for _, d in reports])
                with contextlib.suppress(FileNotFoundError):
                    (p.tmp / TMP_OWNER_FILE).unlink()
                os.rename(p.tmp, p.dest)  # the commit point
                fsync_dir(self.ckpt_dir)
            except Exception as e:
                committed_error = f"rank 0: {type(e).__name__}: {e}"
            else:
                self._log_saved(p)
                self._apply_retention(p.step)
        if failed:
            committed_error = "; ".join(failed)
        elif self._distributed:
            # the broadcast is the barrier after which step-N exists for every rank
            committed_error = self.from_rank0(committed_error)

        if committed_error is None:
            self._latest_step = p.step if self._latest_step is None else max(self._latest_step, p.step)
            return
        if self.rank == 0 and (p.tmp.exists() or p.tmp.is_symlink()):
            try:
                safe_remove_checkpoint(p.tmp, self.ckpt_dir)
            except OSError as e:
                logger.warning("could not remove the failed save %s: %s", p.tmp, e)
        previous = self._previous_checkpoint()
        raise RuntimeError(
            f"checkpoint step-{p.step} was not saved ({committed_error}); {previous}. "
            f"Check free space and permissions of {self.ckpt_dir}."
        ) from error

    def _previous_checkpoint(self) -> str:
        """What is true now of the newest checkpoint before a failed save, as checked here (not as remembered)."""
        if self._latest_step is None:
            return "no earlier one exists"
        name = f"step-{self._latest_step}"
        if (problem := is_whole_checkpoint(self.ckpt_dir / name)) is None:
            return f"{name} is intact"
        if not (self.ckpt_dir / name).exists():
            return f"{name}, the one before, is gone"
        return f"{name}, the one before, is not whole any more: {problem}"

    def _write_manifest(self, p: _PendingSave, digests: list[dict[str, Any]]) -> None:
        """manifest.json: the ranks' checksums of their shards, and rank 0's of every other file."""
        files: dict[str, Any] = {}
        for d in digests:
            files.update(d)
        skip = {MANIFEST_FILE, TMP_OWNER_FILE}
        rest = [f for f in sorted(p.tmp.rglob("*")) if f.is_file() and f.name not in skip]
        files.update(digest_files(p.tmp, [f for f in rest if f.relative_to(p.tmp).as_posix() not in files]))
        write_json_atomic(p.tmp / MANIFEST_FILE, {"step": p.step, "files": files})

    def _apply_retention(self, newest: int) -> None:
        # a checkpoint that could not be pruned is a disk-space problem (the supervisor watches
        # that), not a reason to stop training; raising here would also leave the other ranks
        # waiting in the broadcast that follows
        try:
            protect = frozenset({newest}) | self.keep_steps
            apply_retention(self.ckpt_dir, self.cfg.keep_last, self.cfg.keep_every, protect=protect)
        except Exception as e:
            logger.warning("retention after step-%d failed: %s", newest, e)

    def _log_saved(self, p: _PendingSave) -> None:
        size = _dir_bytes(p.dest)  # rank 0's view: all shards on a shared filesystem
        logger.info(
            "saved checkpoint step %d to %s in %.2fs (%.1f MB%s)",
            p.step,
            p.dest,
            time.monotonic() - p.started,
            size / 1e6,
            ", async" if p.future is not None else "",
        )
