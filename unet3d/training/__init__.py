"""The distributed training runtime: everything one rank does under torchrun (or alone), in the order
train_ddp.py uses it.

    config         TrainConfig: the validated options, their device defaults, the command line
    dist           the process group: set-up, rank accessors, the few collectives the trainer uses
    runtime        Runtime: where and how this rank computes (device, precision, layout, steps); DDP wrapping
    loading        the data on every rank: checked and cached together, the loader, the validation shard
    state          TrainState: exactly what a checkpoint holds, with state_dict() and load()
    checkpointing  when to save it, where to resume from, whether a checkpoint may be continued
    optim          optimizers and the progress-driven learning-rate schedules
    epoch          train_one_epoch: the step, and the per-step agreement between ranks
    timing         where each rank's time goes: data wait, compute, sync wait; diagnoses; the profiler
    control        that agreement (bad steps, stop signals, the time budget), StopReason, failing together
    hang           a rank that stalls near --dist-timeout: said, with its threads' stacks; another node's end
    validation     distributed validation, exact whatever the number of ranks
    report         rank 0's epoch line, TensorBoard, the closing words
    preflight      launch.sh's check of the data and the checkpoint before any rank starts
    agent          launch.sh's one process per node: the pre-flight, then torchrun's agent in it
    faults         fault injection for the tests (NaN losses, out of memory), off in normal runs
    rng, logs      generator states as plain lists; per-rank log files
"""
