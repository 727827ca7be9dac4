"""Train a 3D U-Net with DistributedDataParallel: `bash launch.sh 5,6,7 [options]`, or `python train_ddp.py`.

The story of one rank, top to bottom: configuration -> process group -> the checkpoint to continue from, if
any -> data (checked, planned, cached) -> runtime -> state (resumed from the checkpoint) -> wrap -> for
each epoch: train, maybe validate, save, report -> teardown.
Its parts live in unet3d/training/; every rank runs every line, and only side effects (writing files,
printing) are left to rank 0.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from data.dataset import close_loader
from unet3d.checkpoint import load_checkpoint
from unet3d.files import out_of_room, writable_folder
from unet3d.loss import build_loss
from unet3d.shutdown import exit_with
from unet3d.training import dist, hang
from unet3d.training.checkpointing import (
    check_resumable,
    follow_checkpoint,
    resume,
    resume_source,
    save_checkpoints,
)
from unet3d.training.config import UNTIL_TIME_LIMIT, TrainConfig, parse_args
from unet3d.training.control import (
    StepControl,
    StopReason,
    TimeBudget,
    TrainingError,
    end_job_without_restart,
    fail_alone,
    fail_together,
    launch_time,
    no_room,
    schedule_start,
    tell_the_launcher,
)
from unet3d.training.epoch import train_one_epoch
from unet3d.training.faults import inject_faults, slow_start
from unet3d.training.loading import make_loader, open_cases, prepare_data
from unet3d.training.logs import get_logger, setup_logging
from unet3d.training.preflight import preflight
from unet3d.training.report import Reporter, closing_words
from unet3d.training.runlock import lock_run_folder
from unet3d.training.runtime import describe_run, make_runtime, wrap_for_training
from unet3d.training.state import build_state
from unet3d.training.timing import profiler
from unet3d.training.validation import ever_validates, run_validation, validation_due

INPUT_ERRORS = (ValueError, FileNotFoundError)  # bad data, options or checkpoints: exit 2, one message


@record
def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    cfg = parse_args(argv)
    if cfg.prepare_only:
        return preflight(cfg)  # launch.sh's check, before any rank starts
    slow_start()  # (a test hook)
    try:
        info = dist.setup(timedelta(seconds=cfg.dist_timeout), timedelta(seconds=cfg.setup_timeout))
    except ValueError as e:  # no process group yet: every rank of this node finds the same (its GPUs, its
        # environment), and a restart would find it again. Each rank asks torchrun to end the job: one that
        # only exited would be restarted when its exit reached the agent before another rank's request.
        print(f"error: {e}", file=sys.stderr)
        end_job_without_restart()
        return 2
    setup_logging(info.rank)  # the console, until the run folder is known to take files
    try:
        logs = dist.run_on_local_main(
            lambda: writable_folder(Path(cfg.out_dir) / "logs", f"--out-dir {cfg.out_dir}"), info
        )
        setup_logging(info.rank, logs)
        return train(cfg, info, started)
    except (*INPUT_ERRORS, TrainingError) as e:  # every rank reached the same verdict
        return fail_together(e, info)
    # torch.cuda.OutOfMemoryError: in every torch this project allows (the top-level alias came later)
    except torch.cuda.OutOfMemoryError as e:  # this rank alone; a restart would run out of memory again
        return fail_alone(e, info)
    except OSError as e:  # a full disk or quota, a file-size limit: a restart would only fail the same way
        if out_of_room(e) is None:
            raise
        return fail_together(no_room(e), info)
    except RuntimeError as e:  # a collective that gave up waiting is said to have (torchrun then restarts the job)
        message = hang.describe_failure(e, info.rank, cfg.dist_timeout)
        if message is not None:
            get_logger().error(message)
        raise
    finally:
        dist.cleanup()


def train(cfg: TrainConfig, info: dist.DistInfo, started: float) -> int:
    # A checkpoint to continue from (rank 0 picks it), read by every rank into host memory: loading copies
    # the weights and the optimizer's moments onto this rank's device, and the optimizer's step counters
    # stay on the host (on a GPU, foreach AdamW would read them back with a sync per tensor each step).
    unguarded = dist.run_on_main(lambda: lock_run_folder(cfg.out_dir))  # one job per --out-dir
    if unguarded:
        get_logger().warning(unguarded)
    source = dist.run_on_main(lambda: resume_source(cfg))
    checkpoint = load_checkpoint(source, "cpu") if source is not None else None

    # Data: checked, planned and cached by the ranks together; each rank validates its own share.
    cfg = follow_checkpoint(cfg, checkpoint)
    data = prepare_data(cfg, info, checkpoint)
    train_cases, val_cases = open_cases(data, info)
    rt = make_runtime(cfg, info, data)
    describe_run(rt, data)

    # State: built on this rank's device; the checkpoint is loaded into it on every rank before DDP wraps it.
    state = build_state(rt, data)
    if checkpoint is not None:
        check_resumable(rt, checkpoint, state.model_args, Path(source), state.class_names)
        resume(rt, state, checkpoint, Path(source))
    saved_epochs = (checkpoint.get("config") or {}).get("epochs") if checkpoint is not None else None
    del checkpoint  # its host copy of the weights and moments is no longer needed
    validates = ever_validates(rt.cfg)  # a budget keeps room for a last validation only where one comes
    launches = dist.all_gather_object(launch_time())  # every rank: when launch.sh started on each node
    saved_budget, saved_progress = state.budget, state.schedule.progress
    epoch_progress = (state.epoch + state.step / rt.steps_per_epoch) / rt.cfg.epochs
    epochs_changed = saved_epochs is not None and saved_epochs != rt.cfg.epochs
    until_limit = rt.cfg.epochs >= UNTIL_TIME_LIMIT
    same_job = TimeBudget.same_job(rt.cfg.time_limit, saved_budget, launches)
    progress = schedule_start(same_job, saved_progress, epoch_progress, epochs_changed, until_limit)
    # a new job's budget anneals from there (a restarted one's keeps its own start)
    state.budget = TimeBudget.for_job(rt.cfg.time_limit, saved_budget, started, progress, validates, launches)
    if progress < saved_progress - 1e-3:
        state.schedule.set_progress(progress)
        where = "of a new cycle" if until_limit else f"of this run ({state.epoch} of {rt.cfg.epochs} epochs)"
        why = "another --epochs" if epochs_changed else "annealed to its end by a time budget"
        get_logger().warning(
            f"the learning-rate schedule resumes at {progress:.3f} {where}, where the checkpoint's stood at "
            f"{saved_progress:.3f} ({why}): the learning rate goes back up to {state.schedule.get_last_lr()[0]:.2e}"
        )
    model = wrap_for_training(rt, state.model)
    first_step = state.epoch * rt.steps_per_epoch + state.step
    loss_fn = inject_faults(build_loss(rt.cfg.loss, state.model), info.rank, first_step)
    loader = make_loader(rt, train_cases, data.plan.acquisition_channel)
    control = StepControl(rt.device, rt.cfg.max_bad_steps, state.budget, started)
    control.progress_floor = progress
    if rt.cfg.profile and (rt.is_main or rt.cfg.profile_every_rank):
        control.profiler = profiler(rt.cfg.profile, rt.out_dir, rt.device, info.rank)
    reporter = Reporter(rt, state, data.spec.class_names) if rt.is_main else None

    stats, pending = None, state.validation_pending and validates
    tell_the_launcher(starting=True)  # this torchrun attempt is the one whose stop lines count
    try:
        # SIGTERM/SIGINT: every rank finishes the step, saves and stops; a rank stalled for about --dist-timeout
        # logs where its threads are
        with control.running(), hang.watch(info, rt.cfg.dist_timeout):
            if pending:  # a stop signal cut the last epoch's validation short: it comes first now
                val = run_validation(rt, state.model, val_cases, data.spec.num_classes, control)
                if val is not None:
                    is_best = state.record(val.mean_dice)
                    state.validation_pending = pending = False
                    if rt.is_main:
                        reporter.validation(state.epoch, val, is_best)
                    save_checkpoints(rt, state, is_best)
            while state.epoch < rt.cfg.epochs and not pending:
                loader.sampler.set_epoch(state.epoch, skip=state.step * rt.cfg.batch_size)  # a new order each epoch
                stats = train_one_epoch(rt, state, model, loss_fn, loader, control)  # advances state
                val, given_up = None, False
                if validation_due(rt.cfg, state.epoch, stats.stopped):
                    val = run_validation(rt, state.model, val_cases, data.spec.num_classes, control)
                    given_up = val is None  # a stop signal came during it: the epoch is kept, not validated
                is_best = state.record(val.mean_dice if val is not None else None)
                state.validation_pending = given_up  # made up for by the run that resumes from this one
                if rt.is_main:  # TensorBoard before the checkpoint: a run killed between the two redoes the
                    # epoch and purges them first; the other way round they were lost for good
                    reporter.step_losses(stats)
                    reporter.board(stats, val)
                save_checkpoints(rt, state, is_best)
                if rt.is_main:  # the epoch line once it is saved
                    reporter.epoch(stats, val, is_best)
                if given_up:
                    stats = dataclasses.replace(stats, stopped=StopReason.SIGNAL)
                if stats.stopped is not None:
                    break
    finally:
        close_loader(loader)
        if reporter is not None:
            reporter.close()
    if pending:  # stopped again during the made-up validation: the epoch stays saved, still to be validated
        get_logger().info(
            f"stopped by a stop signal while validating epoch {state.epoch}; run the same command again to validate "
            "it and continue"
        )
        tell_the_launcher(StopReason.SIGNAL)
        return 0
    get_logger().info(closing_words(rt, state, stats))
    tell_the_launcher(stats.stopped if stats is not None else None)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--torchrun"]:  # launch.sh: the pre-flight, then torchrun's agent, in this process
        from unet3d.training.agent import run_agent

        exit_with(run_agent(sys.argv[2:], main))
    exit_with(main())
