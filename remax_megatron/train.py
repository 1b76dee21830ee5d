"""Entry point: ReMax training.

    python -m remax_megatron.launch --nproc_per_node=2 -m remax_megatron.train --config configs/tiny_cpu.yaml
    torchrun --nproc_per_node=2 -m remax_megatron.train --config configs/tiny_cpu.yaml
    python -m remax_megatron.train --config configs/tiny_cpu.yaml actor.tp=1 trainer.steps=5   # key=value overrides

Everything a user can get wrong (config keys and values, layout vs world size,
model files, data, reward functions, output and checkpoint directories) is
checked before any model or output file is created; a mistake is one line on
stderr and exit 2. Then the run takes its directories (a run already using them:
exit 2) and the checkpoint it resumes is checked against the config. Later failures
are one line too, exit 1; SIGTERM / SIGUSR1 / a first SIGINT stop at a step boundary
with a checkpoint, exit 0, a second SIGINT at once, exit 130 (README: "Errors and
exit codes"; remax_megatron.launch makes the launcher exit with these codes).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Only light imports here: the stop-signal handlers are installed before torch is imported (a Ctrl-C
# while it loads is then kept like any other, not a KeyboardInterrupt traceback).
from remax_megatron.launch import report_error
from remax_megatron.processes import children_die_with_parent, preemption_flag, set_parent_death_signal
from remax_megatron.startup_times import StartupClock


def _stop_with_launcher() -> None:
    """Under torchrun: the kernel sends this worker SIGTERM when its launcher dies (plain torchrun
    killed by SIGUSR1, or any launcher killed by SIGKILL), so it saves at the step boundary and
    exits instead of training on as an orphan. Linux only (prctl PR_SET_PDEATHSIG); a safety net:
    remax_megatron.launch forwards the stop signals itself."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    os.environ["REMAX_LAUNCHER_PID"] = str(os.getppid())  # checkpoint.preemption_save_refusal reads it
    set_parent_death_signal(signal.SIGTERM)


def _refuse(error: Exception) -> None:
    """Bad input: one line on stderr (rank 0), exit 2.

    Once the process group is up (a refusal from claim_run), os._exit as in `_fail`: a peer may already
    be gone, and the group's threads torn down at interpreter exit then can abort the process (a CI run
    saw rank 1 of a refused second run die from SIGABRT, exit 134, instead of exit 2)."""
    report_error(f"error: {error}", printer=int(os.environ.get("RANK", "0")) == 0, same_on_every_rank=True)
    if "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    sys.exit(2)


def _fail(logger, lock, error: Exception, printer: bool, same_on_every_rank: bool) -> None:
    """A failure after start-up: close the run's files, release its directories, the one line
    (`report_error`), exit 1 at once.

    os._exit skips C++ destructors: a peer rank may already be gone, and tearing down the process
    group's threads then can abort the process ("terminate called without an active exception",
    SIGABRT, exit 134 instead of 1; seen once in the reward-error test at dp2)."""
    if logger is not None:
        logger.close()
    if lock is not None:
        lock.release()
    report_error(f"error: {error}", printer=printer, same_on_every_rank=same_on_every_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def teardown(engine) -> None:
    """The end of a run (finished, or stopped by a signal after its collective save): every rank past
    its last collective, then the engine and the process groups released in order. Left to interpreter
    exit, vLLM's finalizer (which destroys its groups and torch's default one) and the process groups'
    own threads were torn down in no fixed order: once in many runs a rank aborted after its last line
    ("terminate called without an active exception", exit 134). The run's files are complete by now,
    so a failure here is one warning line, not a failed run."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier()
        engine.shutdown()
        if dist.is_initialized():  # the native engine (vLLM's shutdown destroyed the default group)
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the exit must stay 0 after a complete run
        print(
            f"warning: teardown at exit failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            file=sys.stderr,
            flush=True,
        )


def main(argv=None) -> None:
    preemption_flag()  # a stop signal from here on ends the run at a step boundary with a checkpoint
    _stop_with_launcher()
    children_die_with_parent()
    clock = StartupClock()  # where the time to the first step goes (time/startup_s, time/startup/<part>_s)
    with clock.part("checks"):
        cfg = _config(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Imported in this order: what the libraries print is set before they load (remax_megatron.console),
    # the checks need torch and transformers only, megatron-core and vLLM load for the claim and the build.
    with clock.part("checks"):  # their imports (torch, transformers) included
        from remax_megatron.console import quiet_console

        quiet_console(cfg.logging.level)
        from remax_megatron.startup import check_inputs, claim_run, prepare_models

        try:
            checked = check_inputs(cfg, world)
        except (ValueError, FileNotFoundError) as e:
            _refuse(e)
    with clock.part("builtin_models"):
        prepare_models(cfg, checked)  # built-in models on first use (a minute once), before the process group
    bridge = None
    if cfg.rollout.placement == "separate":  # the world splits: the last rollout.ranks ranks serve the engine
        from remax_megatron.parallel.split import split_world

        split = split_world(cfg.rollout.ranks, cfg.trainer.dist_timeout_minutes)
        if split.role == "rollout":
            _serve_rollouts(cfg, checked, split)
            return
        bridge = split.bridge
    with clock.part("claim"):  # megatron-core's import, the checkpoint to resume checked
        from remax_megatron.checkpoint import CheckpointError
        from remax_megatron.metrics import is_rank0
    try:
        with clock.part("claim"):
            claim = claim_run(cfg, checked)  # from here on this run owns its directories (rank 0 holds the lock)
    except (ValueError, FileNotFoundError) as e:
        _refuse(e)
    except CheckpointError as e:  # the checkpoint to resume cannot be read (every rank raises the same line)
        _fail(None, None, e, printer=is_rank0(), same_on_every_rank=True)

    if int(os.environ.get("RANK", "0")) == 0:
        _print_banner(cfg, checked, world)
    try:
        _train(cfg, checked, claim, clock, bridge)
    finally:  # a run that failed before its first record leaves no lock file and no directory it created
        if claim.lock is not None:
            claim.lock.release()


def _config(argv):
    """The run's Config from --config and the dotted overrides (--help lists every key); bad input exits 2."""
    from remax_megatron.config import config_help, load_config
    from remax_megatron.reward.functions import contract_help

    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"{contract_help()}\n\n{config_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=None, help="YAML config (configs/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.tp=2")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, args.overrides)  # yaml only: a mistyped key is refused in a second
    except (ValueError, FileNotFoundError) as e:
        _refuse(e)


def _print_banner(cfg, checked, world: int) -> None:
    """Rank 0's first line: engine, actor, layout and data; then the config's start-up warnings."""
    dp = cfg.train_world(world) // (cfg.actor.tp * cfg.actor.pp)
    where = (
        f" on {cfg.rollout.ranks} separate rank(s), {cfg.rollout.max_staleness} version(s) behind at most"
        if cfg.rollout.placement == "separate"
        else ""
    )
    print(
        f"remax-megatron: rollout engine {cfg.rollout.engine} (rollout.tp={cfg.rollout.tp}){where}, actor "
        f"{checked.arch.architecture} from {cfg.actor.model}, {cfg.actor.tp}x{cfg.actor.pp}x{dp} "
        f"(tp x pp x dp), {len(checked.train)} train / {len(checked.eval)} eval prompts "
        f"{checked.data_counts}",
        flush=True,
    )
    for line in cfg.start_warnings():
        print(line, file=sys.stderr, flush=True)
    from remax_megatron.algo.zero_advantage import skip_start_line

    skip = skip_start_line(cfg, checked.arch.is_moe)
    if skip:
        print(skip, flush=True)


def _serve_rollouts(cfg, checked, split) -> None:
    """A rollout rank of rollout.placement=separate: build the engine, serve the training ranks until they
    stop, tear down. A failure here is one line and exit 1; the launcher then ends the training ranks."""
    import torch.distributed as dist

    from remax_megatron.rollout.remote import serve
    from remax_megatron.startup import build_rollout_engine

    try:
        engine = build_rollout_engine(cfg, checked)
        serve(engine, split.bridge)
    except (RuntimeError, ValueError, dist.DistBackendError) as e:
        _fail(
            None,
            None,
            RuntimeError(
                f"rollout rank {split.global_rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ),
            printer=True,
            same_on_every_rank=False,
        )
    teardown(engine)


def _train(cfg, checked, claim, clock: StartupClock, bridge=None) -> None:
    """Build, train, tear down: the run after its inputs were checked and its directories claimed."""
    with clock.part("imports"):  # megatron-core's models and optimizers, the engines
        from remax_megatron.checkpoint import CheckpointError
        from remax_megatron.config import save_config
        from remax_megatron.memory import keep_freed_host_memory
        from remax_megatron.metrics import MetricsLogger, is_rank0, print0, run_summary
        from remax_megatron.reward import RewardError
        from remax_megatron.startup import build
        from remax_megatron.trainer import StageError, Trainer

    keep_freed_host_memory()  # CPU: no page faults on every step's big tensors (remax_megatron.memory)
    parts = build(cfg, checked, bridge, clock)
    # config.yaml, metrics.jsonl and TensorBoard events appear with the first record: a run that fails
    # before it has trained or evaluated anything leaves an existing run's files as they were.
    logger = MetricsLogger(
        cfg.trainer.output_dir,
        cfg.trainer.steps,
        tensorboard=cfg.logging.tensorboard,
        wandb_project=cfg.logging.wandb_project,
        progress_bar=cfg.logging.progress_bar,
        config=None,
        on_first_record=lambda: save_config(cfg, cfg.trainer.output_dir),
    )
    trainer = Trainer(parts, logger)
    try:
        finished = trainer.fit(resume=claim.resume)
    except CheckpointError as e:  # every rank raises the same one line: print it once
        _fail(logger, claim.lock, e, printer=is_rank0(), same_on_every_rank=True)
    except RewardError as e:  # every rank raises it; the first rank that saw it prints it
        _fail(logger, claim.lock, e, printer=e.report, same_on_every_rank=False)
    except StageError as e:  # names the rank that saw the failure
        _fail(logger, claim.lock, e, printer=True, same_on_every_rank=False)
    finally:  # _fail exits without it: the reward workers then die with this process (PR_SET_PDEATHSIG)
        logger.close()
        parts.scorer.close()
    if trainer.step > cfg.trainer.steps:  # resumed past the end: the loop had nothing to do
        if is_rank0():
            print(
                f"warning: the checkpoint resumed from is at step {trainer.step}, past trainer.steps="
                f"{cfg.trainer.steps}: nothing was trained; set trainer.steps above {trainer.step} to train on "
                "(or checkpoint.resume=none to start over)",
                file=sys.stderr,
                flush=True,
            )
    elif finished:
        if is_rank0():  # metrics.jsonl is rank 0's
            print0(run_summary(cfg.trainer.output_dir))
    teardown(parts.engine)  # fit returned on every rank: the stop decision and its save are collective


if __name__ == "__main__":
    main()
