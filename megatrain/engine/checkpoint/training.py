"""A run's whole training state in and out of sharded checkpoints, across tp, pp, dp and the
distributed optimizer, and the asynchronous checkpointer the training loop calls.

Saving: every rank describes its own shards as boxes of the single-device tensors (shards.py) and
writes only those (nothing is gathered); replicas are written once. Resuming: every rank reads the
parts of the saved boxes that overlap what it holds now, whatever layout wrote them, so a checkpoint
written by one layout resumes under any other. The fp32 main weights are the truth: a resumed rank
rebuilds its model weights from them, exactly as after an optimizer step.

Async saves (`training.async_checkpoint`): the loop stalls only while the state is copied into a
reusable staging buffer (pinned host memory on GPU); a background thread writes the copy through its
own process group while training goes on. A save first waits for the one before it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatrain.engine.build import RankModel, Trainable
from megatrain.engine.checkpoint.dcp import CorruptCheckpoint
from megatrain.engine.checkpoint.folder import (
    SET_ASIDE_MANIFEST,
    SavedCheckpoint,
    UnsupportedCheckpoint,
    apply_retention,
    complete_steps,
    find_latest,
    iter_dir,
    set_aside,
)
from megatrain.engine.checkpoint.sharded import Folder, load_state, open_folder, save_state
from megatrain.engine.checkpoint.shards import (
    OPTIM_KEYS,
    Box,
    Entry,
    State,
    global_shape,
    param_boxes,
    restore_rng,
    rng_entries,
    slice_boxes,
)
from megatrain.engine.config import TrainConfig, TransformerConfig
from megatrain.engine.lora import is_lora_name
from megatrain.engine.sink import RunLog
from megatrain.spec import JobSpec
from megatrain.storage import open_store


@dataclass(frozen=True)
class Progress:
    """Where training stands: optimizer steps taken and samples consumed (the data position)."""

    step: int = 0
    consumed_samples: int = 0


def model_state(model: RankModel, *, trainable_only: bool = False) -> State:
    """This rank's weights as boxes of model/{name} (a pipeline stage's copy of the tied embedding is
    read on load but written by the stage that owns it); only the trained ones (a LoRA run's
    adapters: its frozen base is rebuilt from where it came from) with trainable_only."""
    out: State = {}
    for p, name in model.parameter_names().items():
        if trainable_only and not p.requires_grad:
            continue
        shared = bool(getattr(p, "shared", False))
        entry = out.setdefault(f"model/{name}", Entry(global_shape(p, model.state), write=not shared))
        entry.boxes += param_boxes(p, p.detach(), model.state)
    return out


def optimizer_state(
    train: Trainable, *, mains_from_model: bool = False
) -> tuple[State, list[dict[str, torch.Tensor]]]:
    """This rank's optimizer shards as boxes of optim/{param,exp_avg,exp_avg_sq}/{name}, and the flat
    moment tensors they view (in the optimizer's slice order). In fp32 the main weights are the model
    weights: they are saved once, as model/*, and `mains_from_model` reads them from there."""
    out: State = {}
    moments = []
    st = train.model.state
    keys = OPTIM_KEYS[1:] if train.optimizer.mains_alias_model and not mains_from_model else OPTIM_KEYS
    for sl, main, mom in train.optimizer.main_shards():
        name = train.names[sl.param]
        tensors = {"param": main, **mom}
        for key in keys:
            fqn = f"model/{name}" if key == "param" and mains_from_model else f"optim/{key}/{name}"
            shared = bool(getattr(sl.param, "shared", False))
            entry = out.setdefault(fqn, Entry(global_shape(sl.param, st), write=not shared))
            entry.boxes += slice_boxes(sl.param, sl.start, tensors[key], st)
        moments.append(mom)
    return out, moments


def trainer_state(
    train: Trainable,
    progress: Progress,
    mcfg: TransformerConfig,
    cfg: TrainConfig,
    base_init_from: str | None = None,
) -> dict[str, Any]:
    """The plain data beside the tensors (trainer_state.json): data position, optimizer counters, the
    loss scaler, and what the model and layout were. A LoRA run's checkpoint holds its adapters only
    (`adapters_only`) and names where its frozen base comes from (`base_init_from`: the spec's
    init_from; None: the seeded initial weights)."""
    opt = train.optimizer
    adapters = {"adapters_only": True, "base_init_from": base_init_from} if cfg.lora is not None else {}
    return {
        **adapters,
        "consumed_samples": progress.consumed_samples,
        "train_iters": cfg.train_iters,
        "optimizer_steps": opt.steps,
        "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "model_config": mcfg.to_dict(),
        "layout": train.model.state.layout.as_dict(),
        "world_size": train.model.state.layout.world_size,
    }


class Staging:
    """Host copies of the boxes a rank writes, in buffers reused from save to save (pinned on GPU
    machines, so the device-to-host copies run at full speed): the one extra copy an async save needs."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def stage(self, state: State) -> State:
        pin = torch.cuda.is_available()
        staged: State = {}
        for fqn, entry in state.items():
            if not entry.write:
                continue
            boxes = []
            for box in entry.boxes:
                key = (fqn, box.offsets)
                buf = self._buffers.get(key)
                if buf is None or buf.shape != box.data.shape or buf.dtype != box.data.dtype:
                    buf = torch.empty(box.data.shape, dtype=box.data.dtype, pin_memory=pin)
                    self._buffers[key] = buf
                buf.copy_(box.data, non_blocking=pin)
                boxes.append(Box(box.offsets, buf))
            staged[fqn] = Entry(entry.shape, boxes)
        if pin:
            torch.cuda.synchronize()
        return staged


class Checkpointer:
    """Saves at the loop's request (async or not), reports saves on rank 0's event log, applies the
    retention policy, and resumes from the newest usable checkpoint."""

    def __init__(
        self,
        root_url: str,
        train: Trainable,
        spec: JobSpec,
        mcfg: TransformerConfig,
        cfg: TrainConfig,
        log: RunLog,
        *,
        async_save: bool = False,
        keep_last: int = 0,
        keep_every: int = 0,
    ):
        self.root_url, self.train, self.spec, self.mcfg, self.cfg, self.log = (
            root_url,
            train,
            spec,
            mcfg,
            cfg,
            log,
        )
        self.async_save, self.keep_last, self.keep_every = async_save, keep_last, keep_every
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # Checkpoint collectives run on their own gloo group: a background save must never
        # interleave with the training's collectives on the same communicator.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0
        self._pending: tuple[int, float, Future[Any]] | None = None
        self._staging = Staging()

    # --- saving --------------------------------------------------------------------------------------

    def save(self, progress: Progress) -> None:
        self.wait()
        began = time.perf_counter()
        state = model_state(self.train.model, trainable_only=self.cfg.lora is not None)
        optim, _ = optimizer_state(self.train)
        state.update(optim)
        state.update(rng_entries(self.rank, self._tracker_state()))
        plain = trainer_state(self.train, progress, self.mcfg, self.cfg, self.spec.model.init_from)
        if not self.async_save:
            result = self._write(state, progress.step, plain)
            self._report(progress.step, time.perf_counter() - began, result)
            return
        staged = self._staging.stage(state)
        stall = time.perf_counter() - began
        self._pending = (progress.step, stall, _in_background(self._write, staged, progress.step, plain))

    def _tracker_state(self) -> dict[str, Any] | None:
        tracker = self.train.model.tracker
        return tracker.state_dict() if tracker is not None else None

    def _write(
        self, state: State, step: int, plain: dict[str, Any]
    ) -> tuple[SavedCheckpoint | None, list[int], float]:
        began = time.perf_counter()
        saved = save_state(
            self.root_url,
            step,
            state,
            plain,
            self.spec,
            manifest_extra={"layout": plain["layout"], "world_size": plain["world_size"]},
            group=self.group,
            distributed=self.distributed,
        )
        deleted: list[int] = []
        if saved is not None and self.keep_last > 0:
            deleted = apply_retention(self.root_url, self.keep_last, self.keep_every)
        return saved, deleted, time.perf_counter() - began

    def _report(
        self, step: int, stall: float, result: tuple[SavedCheckpoint | None, list[int], float]
    ) -> None:
        saved, deleted, write_s = result
        if saved is None:
            return
        self.log.events.write(
            {
                "event": "checkpoint_saved",
                "step": step,
                "uri": saved.uri,
                "size_bytes": saved.size_bytes,
                "stall_s": round(stall, 6),
                "write_s": round(write_s, 6),
                "async": self.async_save,
            }
        )
        self.log.say(
            f"checkpoint {step} saved to {saved.uri} ({saved.size_bytes} bytes; training paused "
            f"{stall:.3f} s, written in {write_s:.3f} s{' in the background' if self.async_save else ''})"
        )
        if deleted:
            self.log.events.write({"event": "checkpoints_deleted", "steps": deleted})
            self.log.say(f"retention deleted checkpoints {deleted}")

    def poll(self) -> None:
        """Report a background save that has finished (cheap; the loop calls it every step)."""
        if self._pending is not None and self._pending[2].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is stored; its error, if any, is raised here."""
        if self._pending is None:
            return
        step, stall, future = self._pending
        self._pending = None
        self._report(step, stall, future.result())

    def close(self) -> None:
        """Wait for the last save: a run is finished only once its final checkpoint is stored."""
        self.wait()

    # --- resuming ------------------------------------------------------------------------------------

    def resume(self) -> Progress | None:
        """Load the newest usable checkpoint (the newest complete one; a corrupt one is reported and
        the one before it tried). None when there is none. When every complete checkpoint is
        corrupt, they are set aside (folder.set_aside: kept, no longer complete) and CorruptCheckpoint
        ends this attempt, so that the next one starts over from step 0 in a fresh process (a
        half-read checkpoint may already have filled some of this one's state). The progress is lost
        either way; retrying into the same corrupt bytes would only lose the job too."""
        latest = find_latest(self.root_url)
        if latest is None:
            return None
        steps = [s for s in complete_steps(self.root_url) if s <= latest][::-1]
        root = open_store(self.root_url)
        reasons = []
        for step in steps:
            try:
                folder = open_folder(root.child(iter_dir(step)).url)
                if names := folder.unverified:
                    self.log.say(
                        f"checkpoint {step}: its manifest gives no sha256 for {', '.join(names)}; "
                        "checked by size only"
                    )
                return self.load(folder)
            except CorruptCheckpoint as exc:
                self.log.say(f"checkpoint {step} is unusable: {exc}; trying the one before it")
                self.log.events.write({"event": "checkpoint_corrupt", "step": step, "reason": str(exc)})
                reasons.append(f"step {step}: {exc}")
        for step in steps:
            set_aside(self.root_url, step)
        self.log.events.write({"event": "checkpoints_set_aside", "steps": steps})
        # What to do first: a failure's reason keeps only its first few hundred characters.
        raise CorruptCheckpoint(
            f"no usable checkpoint under {self.root_url}: every one is corrupt, set aside (manifest.json "
            f"renamed {SET_ASIDE_MANIFEST}); the next attempt starts over from step 0: {'; '.join(reasons)}"
        )

    def load(self, folder: Folder) -> Progress:
        return load_training_state(folder, self.train, group=self.group, distributed=self.distributed)


def _in_background(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """fn(*args) on a daemon thread: a run that crashes or is cancelled exits without waiting for a
    save whose peers may be gone (its manifest is then never written, so it never looks complete)."""
    future: Future[Any] = Future()

    def target() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever waits on the save
            future.set_exception(exc)

    threading.Thread(target=target, name="checkpoint-save", daemon=True).start()
    return future


def load_training_state(
    folder: Folder,
    train: Trainable,
    *,
    group: dist.ProcessGroup | None = None,
    distributed: bool | None = None,
) -> Progress:
    """Fill this rank's weights, optimizer shards, loss scaler and (for the same world size) random
    streams from `folder`; a weights-only checkpoint gives fresh optimizer moments."""
    saved = folder.metadata().state_dict_metadata
    st = train.model.state
    if not any(k.startswith("optim/") for k in saved):
        adapters_only = bool(folder.trainer_state.get("adapters_only"))
        state = model_state(train.model, trainable_only=adapters_only)
        load_state(folder, state, group=group, distributed=distributed)
        train.optimizer.reload_mains_from_model()
        return Progress(folder.step, int(folder.trainer_state.get("consumed_samples", 0)))
    # fp32 checkpoints hold the main weights once, as the model weights.
    optim, moments = optimizer_state(
        train, mains_from_model=not any(k.startswith("optim/param/") for k in saved)
    )
    rng = rng_entries(st.rank, train.model.tracker.state_dict() if train.model.tracker else None)
    same_world = folder.trainer_state.get("world_size") == st.layout.world_size
    load_state(
        folder,
        {**optim, **(rng if same_world else {})},
        optional=lambda fqn: fqn.startswith("rng/"),
        group=group,
        distributed=distributed,
    )
    ts = folder.trainer_state
    train.optimizer.load_main_shards(moments, int(ts.get("optimizer_steps", 0)))
    if train.optimizer.scaler is not None and ts.get("loss_scaler"):
        train.optimizer.scaler.load_state_dict(ts["loss_scaler"])
    # Random streams are per rank: they carry over only when the world has the same size.
    if same_world and all(k in saved for k in rng):
        tracker = restore_rng({k.split("/", 2)[2]: e.boxes[0].data for k, e in rng.items()})
        if tracker is not None and train.model.tracker is not None:
            train.model.tracker.load_state_dict(tracker)
    return Progress(folder.step, int(ts["consumed_samples"]))


def load_model_weights(url: str, model: RankModel) -> int:
    """A checkpoint's weights into this rank's shards (a fine-tune's start): reads only this rank's
    boxes of model/*; rows of a differently padded vocabulary are matched. LoRA adapters keep their
    initial values (a base checkpoint has none). Returns the source step."""
    folder = open_folder(url)
    load_state(folder, {k: v for k, v in model_state(model).items() if not is_lora_name(k)})
    return folder.step


__all__ = ["Checkpointer", "Progress", "UnsupportedCheckpoint", "load_model_weights", "load_training_state"]
