"""The training loop: steps over micro-batches (or through the pipeline schedule), gradient sync, the
optimizer, interval metrics, validation and checkpoints at their intervals."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatrain.engine.build import Trainable, lm_loss
from megatrain.engine.checkpoint.training import Progress
from megatrain.engine.config import TrainConfig
from megatrain.engine.data import Loader, SampleDataset, microbatch_sample_ids
from megatrain.engine.device_stats import device_monitor
from megatrain.engine.dpo import PreferenceLoss, prepare_reference, sequence_logps
from megatrain.engine.interval import Window, pipeline_metrics
from megatrain.engine.memory_stats import memory_row
from megatrain.engine.metrics import throughput
from megatrain.engine.microbatch import (
    MicroBatch,
    context_parallel_batch,
    loss_denominator,
    mean_loss_tokens,
    set_binary_scales,
    token_share,
)
from megatrain.engine.models.moe import moe_layers
from megatrain.engine.moe_metrics import moe_metrics, set_microbatch_aux_scale
from megatrain.engine.optimizer import lr_at
from megatrain.engine.parallel import lanes
from megatrain.engine.parallel.bert_loss import counting_binary
from megatrain.engine.parallel.mappings import allreduce_sequence_parallel_grads
from megatrain.engine.parallel.state import ParallelState
from megatrain.engine.profiling import StepProfiler
from megatrain.engine.reductions import (  # noqa: F401  (total_hits re-exported: tests read it here)
    binary_metrics,
    reduce_mean,
    token_accuracy,
    total_hits,
)
from megatrain.engine.sink import RunLog
from megatrain.engine.stragglers import StragglerWatch, report_stragglers
from megatrain.engine.timers import StepTimers
from megatrain.failures import Activity
from megatrain.faults import RankFaults
from megatrain.hostinfo import HostLoad, job_root_pid
from megatrain.kernels.linear_cross_entropy import counting_token_hits

if TYPE_CHECKING:  # lm-eval is imported only by a run that scores tasks
    from megatrain.engine.evaluation.during import TaskScoring

FULL_VALID_MAX_BATCHES = 1000
"""The end-of-run validation over the whole split (full_valid_*) reads at most this many global
batches: a pretraining corpus's held-out split can be far larger than a fine-tuning file's."""


@dataclass(frozen=True)
class Rates:
    """What turns an iteration time into throughput figures."""

    flops_per_iteration: float
    tokens_per_iteration: int
    peak_tflops: float | None
    """Per device, for MFU; None where the device's peak is unknown."""


def batch_of(
    dataset: SampleDataset | Loader, ids: list[int], device: str, state: ParallelState | None = None
) -> MicroBatch:
    """The micro-batch of samples `ids` on `device`: (B, T) tensors, or with context parallelism
    this cp rank's (B, T/cp) part of every row (microbatch.context_parallel_batch)."""
    batch = dataset.batch(ids)
    if state is not None:
        batch = context_parallel_batch(batch, state.cp_rank, state.cp_size)
    return MicroBatch.from_batch(batch, device)


class TrainLoop:
    """Runs `train` from a Progress to cfg.train_iters; `save(progress)` writes a checkpoint."""

    def __init__(
        self,
        train: Trainable,
        cfg: TrainConfig,
        data: dict[str, Loader | None],
        log: RunLog,
        rates: Rates,
        save: Callable[[Progress], None],
        poll: Callable[[], None] = lambda: None,
        activity: Activity | None = None,
        stop: Callable[[], bool] = lambda: False,
        faults: RankFaults | None = None,
        tasks: TaskScoring | None = None,
        profiler: StepProfiler | None = None,
    ):
        """`save(progress)` writes a checkpoint (perhaps in the background); `poll()` is called after
        every step to report background saves that have finished. `activity` is told the step in
        progress (a failure's record names it). `stop()` is asked at every step boundary whether the
        run was preempted: if so it checkpoints there (unless it just did) and returns early. `tasks`
        (training.eval_tasks) are scored with validation, every eval_interval and at the end.
        `profiler` (training.profile_steps) records some of the loop's iterations."""
        self.train, self.cfg, self.log, self.rates, self.save = train, cfg, log, rates, save
        self.poll, self.stop = poll, stop
        self.activity = activity or Activity()
        self.faults = faults or RankFaults([], 0)
        """Operator-injected faults (megatrain.faults): a slowed rank's steps are stretched here."""
        self.stragglers = StragglerWatch()
        self.tasks = tasks
        self.profiler = profiler
        train_ds = data["train"]
        assert train_ds is not None
        self.train_ds, self.valid_ds, self.test_ds = train_ds, data.get("valid"), data.get("test")
        self.state = train.model.state
        self.device = str(self.state.device)
        # Per-phase times; on a GPU only the log steps synchronise (and are the ones averaged).
        self.timers = StepTimers(self.device)
        self.monitor = device_monitor(self.device)  # gpu_util (NVML) or cpu_util, and device memory
        # Other processes' load beside the job: a step time measured under it is not this layout's.
        self.host_load = HostLoad(job_root_pid())
        model = train.model
        self.moe = (model.chunks[0] if model.chunks else model.module).config.moe
        self.encoder = (model.chunks[0] if model.chunks else model.module).config.is_encoder
        self.binary_window = torch.zeros(3, device=self.device)
        """An encoder's Σ (binary-head loss · rows, correct, rows) since the last log row."""
        head_cfg = (model.chunks[0] if model.chunks else model.module).config
        self.binary_name = "sop" if getattr(head_cfg, "masked_lm", True) else "classification"
        self.eval_binary: dict[str, float] = {}
        self.moe_layers = list(moe_layers(model.module))  # their aux-loss scale is set per micro-batch
        # kind dpo: the loss over pairs of rows instead of the per-token LM loss (engine.dpo).
        self.preference = None
        if cfg.dpo:
            self.preference = PreferenceLoss(cfg.dpo, cfg.samples_per_rank // 2, self.device, self.state)

    def _micro_ids(self, start: int) -> list[list[int]]:
        c, s = self.cfg, self.state
        return microbatch_sample_ids(start, c.global_batch_size, c.micro_batch_size, s.dp_rank, s.dp_size)

    def _region(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A labelled range in the profile while one records (else nothing)."""
        return torch.profiler.record_function(name) if self.timers.annotate else contextlib.nullcontext()

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def step(self, consumed: int) -> tuple[torch.Tensor, Any]:
        """One optimizer step on the global batch starting at sample `consumed`: (loss, StepResult).

        The loss is the global batch's per-token loss: every micro-batch's loss-token sum over the
        loss tokens of all micro-batches on all data-parallel ranks (microbatch.token_share)."""
        train, timers = self.train, self.timers
        ddp, optimizer = train.ddp, train.optimizer
        optimizer.zero_grad()
        micro_ids = self._micro_ids(consumed)
        loss_sum = torch.zeros((), device=self.device)
        with timers("data"):
            batches = [batch_of(self.train_ds, ids, self.device, self.state) for ids in micro_ids]
            denominator = loss_denominator(batches, self.state)
            set_binary_scales(batches, denominator)
        with counting_token_hits() as hits, counting_binary() as binary:
            self._forward_backward(batches, denominator, loss_sum)
        self.binary_window = self.binary_window + binary.as_tensor(self.device)
        correct = hits.correct if hits.correct is not None else loss_sum.new_zeros(())
        # (correct, calls) on this rank, and every dp·cp rank's loss tokens: for token_accuracy.
        counts = torch.stack([correct, correct.new_tensor(float(hits.calls))])
        self.last_hits: tuple[torch.Tensor, float] = (counts, denominator * self.state.dp_cp_size)
        with timers("grad_sync"):
            ddp.finish_grad_sync()
            train.allreduce_shared_grads()  # a pipeline's tied / shared weights
            allreduce_sequence_parallel_grads(train.model.module, self.state)
        with timers("optimizer"):
            result = optimizer.step()
        return loss_sum, result

    def _forward_backward(
        self, batches: list[MicroBatch], denominator: float, loss_sum: torch.Tensor
    ) -> None:
        """Every micro-batch's forward and backward (through the pipeline's schedule when there is
        one), their loss shares added into loss_sum."""
        train, timers, pipeline = self.train, self.timers, self.train.pipeline
        ddp, optimizer = train.ddp, train.optimizer
        if pipeline is not None:
            fwd0, bwd0 = pipeline.times.forward_s, pipeline.times.backward_s
            loss_sum += pipeline.forward_backward(
                batches,
                lambda out, mb: self._pipeline_share(out, mb, denominator),
                scale_loss=optimizer.scale_loss,
                # Gradient buckets are reduced only during this stage's last backward.
                before_backward=lambda last: setattr(ddp, "is_last_microbatch", last),
                before_forward=lambda mb: set_microbatch_aux_scale(
                    self.moe_layers, mb, denominator, optimizer.loss_scale
                ),
            )
            timers.add("forward", pipeline.times.forward_s - fwd0)
            timers.add("backward", pipeline.times.backward_s - bwd0)
        else:

            def forward(mb: MicroBatch) -> torch.Tensor:
                set_microbatch_aux_scale(self.moe_layers, mb, denominator, optimizer.loss_scale)
                return self._share(mb, denominator)

            def backward(loss: torch.Tensor, last: bool) -> None:
                # Gradient buckets are reduced only during the last micro-batch's backward.
                with contextlib.nullcontext() if last else ddp.no_sync():
                    optimizer.scale_loss(loss).backward()

            if train.microbatch_lanes:  # micro-batch m's forward beside m-1's backward
                seconds = [0.0, 0.0]
                losses = lanes.overlapped(batches, forward, backward, seconds)
                timers.add("forward", seconds[0])
                timers.add("backward", seconds[1])
            else:
                losses = []
                for m, mb in enumerate(batches):
                    with timers("forward"):
                        losses.append(forward(mb))
                    with timers("backward"):
                        backward(losses[-1], m == len(batches) - 1)
            for loss in losses:
                loss_sum += loss.detach()

    def _share(self, mb: MicroBatch, denominator: float) -> torch.Tensor:
        """A micro-batch's share of the step loss, without a pipeline."""
        if self.preference is not None:
            return self.preference.share(sequence_logps(self.train.ddp, mb, self.state), mb)
        return token_share(lm_loss(self.train.ddp, mb, self.state), mb.num_loss_tokens, denominator)

    def _pipeline_share(self, out: torch.Tensor, mb: MicroBatch, denominator: float) -> torch.Tensor:
        """A micro-batch's share of the step loss from the pipeline's last stage output."""
        if self.preference is not None:
            assert self.train.logps is not None
            return self.preference.share(self.train.logps(out, mb), mb)
        assert self.train.loss is not None
        return token_share(self.train.loss(out, mb), mb.num_loss_tokens, denominator)

    def row_logps(self, batches: list[MicroBatch]) -> list[torch.Tensor | None]:
        """Each micro-batch's (B,) row log-probs under the model as it is, forward only (None on
        pipeline stages other than the last)."""
        ddp, pipeline = self.train.ddp, self.train.pipeline
        if pipeline is None:
            return [sequence_logps(ddp, mb, self.state) for mb in batches]
        logps, found = self.train.logps, {}
        assert logps is not None

        def keep(out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            found[id(mb)] = logps(out, mb)
            return out.new_zeros(())

        pipeline.forward_only(batches, keep)
        pipeline.times.reset()
        return [found.get(id(mb)) for mb in batches]

    @torch.no_grad()
    def prepare_reference(self, key: str) -> None:
        """kind dpo: every split's reference log-probs, with the model as it is now (before the first
        step) and its adapters off (engine.dpo.prepare_reference)."""
        loaders = {"train": self.train_ds, "valid": self.valid_ds, "test": self.test_ds}
        # A Loader wraps its dataset; tests hand the datasets themselves.
        datasets = {n: getattr(ld, "dataset", ld) for n, ld in loaders.items() if ld is not None}
        self.train.ddp.eval()
        try:
            prepare_reference(
                datasets,
                self.train.model.module,
                self.row_logps,
                self._micro_ids,
                self.cfg.global_batch_size,
                self.state,
                key,
                self.log.say,
            )
        finally:
            self.train.ddp.train()

    @torch.no_grad()
    def evaluate(self, dataset: Loader | None = None, iters: int | None = None) -> tuple[float, float | None]:
        """(per-token loss, token accuracy) over the first `iters` (default eval_iters) global
        batches of the split (the same ones every time): the loss tokens' summed loss over their
        number, across micro-batches and dp ranks, and the share of them whose label was the
        argmax (None where no fused cross-entropy counted, and for preference pairs). The split is
        validation unless `dataset` names another."""
        dataset = dataset or self.valid_ds
        assert dataset is not None
        ddp, pipeline = self.train.ddp, self.train.pipeline
        ddp.eval()
        total = torch.zeros((), device=self.device)  # Σ loss over loss tokens (last stage)
        count, masked = 0, False
        with counting_token_hits() as hits, counting_binary() as binary:
            for it in range(iters or self.cfg.eval_iters):
                ids = self._micro_ids(it * self.cfg.global_batch_size)
                batches = [batch_of(dataset, i, self.device, self.state) for i in ids]
                if self.encoder:  # its sentence-order loss counts as in training, per iteration
                    set_binary_scales(batches, loss_denominator(batches, self.state))
                if self.preference is not None:
                    total += self._pairs_loss(batches)
                    count += sum(mb.tokens.shape[0] // 2 for mb in batches)
                    continue
                if pipeline is not None:
                    total += pipeline.forward_only(batches, self._summed_loss)
                else:
                    for mb in batches:
                        # (max: what a batch without loss tokens adds beside them, see token_share)
                        total += lm_loss(ddp, mb, self.state) * max(mb.num_loss_tokens, 1)
                # A classifier's batches hold no loss token: its loss is the mean over iterations.
                count += sum(mb.num_loss_tokens for mb in batches) or int(self.encoder)
                masked = masked or any(mb.loss_mask is not None for mb in batches)
        ddp.train()
        if pipeline is not None:
            pipeline.times.reset()  # the bubble figure is the training schedule's
        if self.encoder:  # its binary head's figures, for the validation row
            self.eval_binary = binary_metrics(binary.as_tensor(self.device), self.state, self.binary_name)
        if self.preference is not None:  # the mean over pairs: every rank holds as many
            return reduce_mean(total, self.state) / count, None
        # Means over dp of the sum and of the count (every stage holds the count): their ratio is the
        # global per-token loss.
        count_mean = mean_loss_tokens(count, masked, self.state)
        loss = reduce_mean(total, self.state) / count_mean if count_mean else float("nan")
        correct = hits.correct if hits.correct is not None else total.new_zeros(())
        counts = torch.stack([correct.float(), correct.new_tensor(float(hits.calls))])
        return loss, token_accuracy(counts, count_mean * self.state.dp_cp_size, self.state)

    def _pairs_loss(self, batches: list[MicroBatch]) -> torch.Tensor:
        """Preference pairs: the micro-batches' summed pair losses on this rank."""
        pairs = self.preference.summed  # type: ignore[union-attr]
        found = zip(self.row_logps(batches), batches, strict=True)
        return sum((pairs(lp, mb) for lp, mb in found if lp is not None), torch.zeros((), device=self.device))

    def _summed_loss(self, out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The pipeline loss as the micro-batch's loss-token sum (validation adds sums up)."""
        assert self.train.loss is not None
        return self.train.loss(out, mb) * max(mb.num_loss_tokens, 1)

    def run(self, start: Progress) -> dict[str, Any]:
        cfg, timers, log = self.cfg, self.timers, self.log
        step, consumed = start.step, start.consumed_samples
        last_eval: float | None = None
        self.train.ddp.train()
        window = Window(None)
        self.activity.phase = "training"
        if self.profiler is not None:
            self.profiler.start(step)
        while step < cfg.train_iters:
            self.activity.step = step + 1
            if self.profiler is not None:
                timers.annotate = self.profiler.annotate
            lr = lr_at(step + 1, cfg)
            timers.begin_step(sync=(step + 1) % cfg.log_interval == 0 or step + 1 == cfg.train_iters)
            self.train.optimizer.set_lr(lr)
            if step == start.step:
                self.train_ds.prefetch(consumed)
            if step + 1 < cfg.train_iters:
                self.train_ds.prefetch(consumed + cfg.global_batch_size)  # read while this step runs
            began = time.perf_counter()
            loss, result = self.step(consumed)
            if self.faults:
                self.faults.stretch(step + 1, time.perf_counter() - began)
            timers.end_step()
            step, consumed = step + 1, consumed + cfg.global_batch_size
            window.add(loss, result, self.last_hits)
            final = step == cfg.train_iters
            if step % cfg.log_interval == 0 or final:
                self._sync()
                with self._region("log"):
                    self._log_interval(window, step, lr, consumed)
                window = Window(window)
            paused = time.perf_counter()
            due = bool(cfg.eval_interval) and (step % cfg.eval_interval == 0 or final)
            if self.valid_ds is not None and due:
                last_eval = self._validate(step, final)
            if self.tasks is not None and (due or final):
                self._score_tasks(step)
            saved = bool(cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0) or final
            if saved:
                self._save(Progress(step, consumed))
            self.poll()
            if not final and self.stop():
                # Preempted: checkpoint this boundary so the next attempt redoes no work.
                if not saved:
                    self._save(Progress(step, consumed))
                log.say(f"step {step} | preempted: checkpointed, stopping")
                return {"step": step, "consumed_samples": consumed, "val_loss": last_eval, "preempted": True}
            if self.profiler is not None:
                self.profiler.step()  # at the end of its window it writes the trace: a pause
            self._sync()
            window.excluded += time.perf_counter() - paused
        test_loss = None
        if self.test_ds is not None and step == cfg.train_iters:
            test_loss, _ = self.evaluate(self.test_ds)
            log.metrics.write({"step": step, "test_loss": test_loss})
            log.say(f"step {step} | test loss {test_loss:.4f}")
        return {"step": step, "consumed_samples": consumed, "val_loss": last_eval, "test_loss": test_loss}

    def _validate(self, step: int, final: bool) -> float:
        """Validation at `step`: val_loss (and OpenAI's names for it, valid_loss and
        valid_mean_token_accuracy) over eval_iters batches, and at the end full_valid_* over the
        whole split (at most FULL_VALID_MAX_BATCHES global batches). The loss is returned."""
        self.activity.phase = "evaluation"  # a pause the hang watch allows for (worker.hang)
        began = time.perf_counter()
        loss, accuracy = self.evaluate()
        row: dict[str, Any] = {"step": step, "val_loss": loss, "valid_loss": loss}
        if accuracy is not None:
            row["valid_mean_token_accuracy"] = accuracy
        row.update({f"valid_{k}": v for k, v in self.eval_binary.items()})
        if final:
            assert self.valid_ds is not None
            batches = min(max(1, len(self.valid_ds) // self.cfg.global_batch_size), FULL_VALID_MAX_BATCHES)
            full, full_accuracy = self.evaluate(iters=max(batches, self.cfg.eval_iters))
            row["full_valid_loss"] = full
            if full_accuracy is not None:
                row["full_valid_mean_token_accuracy"] = full_accuracy
        self.activity.phase = "training"
        self.log.metrics.write(row)
        self._evaluated(step, "validation", time.perf_counter() - began)
        shown = f" | token accuracy {accuracy:.3f}" if accuracy is not None else ""
        self.log.say(f"step {step} | validation loss {loss:.4f}{shown}")
        return loss

    def _score_tasks(self, step: int) -> None:
        """training.eval_tasks at `step`: one metrics row {"step", "eval": {task: {metric: ...}}}."""
        from megatrain.engine.evaluation.job import table

        assert self.tasks is not None
        self.activity.phase = "evaluation"
        began = time.perf_counter()
        results = self.tasks(self.train, self.cfg.micro_batch_size)
        self.activity.phase = "training"
        self.log.metrics.write({"step": step, "eval": results})
        self._evaluated(step, "tasks", time.perf_counter() - began)
        for line in table(results):
            self.log.say(f"step {step} | {line}")

    def _evaluated(self, step: int, what: str, seconds: float) -> None:
        """An `evaluated` event: the goodput ledger counts its seconds apart from training's."""
        self.log.events.write(
            {"event": "evaluated", "step": step, "what": what, "seconds": round(seconds, 3)}
        )

    def _save(self, progress: Progress) -> None:
        """A checkpoint, named as this rank's phase while it stalls the loop (the hang watch allows
        for it; an async save's background write is not a pause)."""
        self.activity.phase = "checkpoint"
        self.save(progress)
        self.activity.phase = "training"

    def _log_interval(self, w: Window, step: int, lr: float, consumed: int) -> None:
        iter_time = (time.perf_counter() - w.start - w.excluded) / w.steps
        loss_mean = reduce_mean(w.loss_sum, self.state) / w.steps
        world = self.state.layout.world_size
        r = self.rates
        rates = throughput(r.flops_per_iteration, r.tokens_per_iteration, iter_time, world, r.peak_tflops)
        row = {
            "step": step,
            "loss": loss_mean,
            "lr": lr,
            "grad_norm": w.grad_norm,
            **rates,
            **memory_row(self.device, self.train),
            **self.monitor.sample(),
            **self.host_load.sample(),
            "iter_time_s": iter_time,
            **{f"{k}_time_s": v for k, v in self.timers.means().items()},
            "consumed_samples": consumed,
            "trained_tokens": self.train_ds.trained_tokens(consumed, self.cfg.seq_length),
            "skipped_iters": w.skipped,
        }
        if w.loss_scale is not None:
            row["loss_scale"] = w.loss_scale
        row.update(moe_metrics(self.train.model.module, self.moe, self.state))  # {} when dense
        if self.preference is not None:
            row.update(self.preference.metrics(self.state))
        elif w.hits is not None:
            accuracy = token_accuracy(w.hits, w.tokens, self.state)
            if accuracy is not None:
                row["token_accuracy"] = accuracy
        if self.encoder:
            row.update(binary_metrics(self.binary_window, self.state, self.binary_name))
            self.binary_window = torch.zeros(3, device=self.device)
        pipeline = self.train.pipeline
        # Time in the step's collectives (the rest of a step is the rank's own work): stragglers.
        wait = self.timers.means().get("grad_sync", 0.0)
        wait += pipeline.times.wait_s / w.steps if pipeline is not None else 0.0
        row.update(report_stragglers(self.stragglers, iter_time, wait, self.state.device, self.log, step))
        bubble = ""
        if pipeline is not None:
            row.update(pipeline_metrics(pipeline, self.state, w.steps))
            bubble = f" | bubble {row['pipeline_bubble_fraction']:.1%}"
            pipeline.times.reset()
        self.log.metrics.write(row)
        self.timers.reset()
        mfu = f"{rates['mfu']:.1%}" if rates["mfu"] is not None else "n/a"
        skipped = f" | skipped {w.skipped} (loss scale {w.loss_scale:g})" if w.skipped else ""
        if "moe_aux_loss" in row:
            skipped += f" | moe aux {row['moe_aux_loss']:.4g} imbalance {row['moe_load_imbalance']:.2f}"
        if "token_accuracy" in row:
            skipped += f" | acc {row['token_accuracy']:.3f}"
        name = self.binary_name
        if f"{name}_accuracy" in row:
            skipped += f" | {name} loss {row[f'{name}_loss']:.4f} acc {row[f'{name}_accuracy']:.3f}"
        if "rewards/accuracies" in row:  # preference training: what TRL's console shows
            skipped += f" | reward acc {row['rewards/accuracies']:.2f} margin {row['rewards/margins']:.3f}"
        self.log.say(
            f"step {step}/{self.cfg.train_iters} | loss {loss_mean:.4f} | lr {lr:.3e} | grad_norm "
            f"{w.grad_norm:.3f} | {rates['tokens_per_s']:.0f} tok/s | "
            f"{rates['tflops_per_device']:.3f} TFLOP/s/device | mfu {mfu} | {iter_time * 1e3:.0f} ms/it"
            f"{bubble}{skipped}"
        )
