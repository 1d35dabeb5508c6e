"""One written-out training loop: token batches, label-smoothed loss, Adam with the inverse
square-root schedule, validation, checkpoints, and an exact resume.

The learning-rate schedule and the loss are pure functions. Everything a resume needs (weights,
optimizer, scaler, RNG states, the data position) is in the checkpoint, so a run killed at any
moment and restarted ends with the same weights as one that never stopped (CPU, fp32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import signal
import time
from collections.abc import Callable

import torch

from nmt_cli.config import TrainConfig
from nmt_cli.engine import adapters, distributed, saving, validation
from nmt_cli.engine.batches import Batch, Epochs, Split, on_device, padding_share
from nmt_cli.engine.device import dtype_of
from nmt_cli.engine.figures import Figures, Window
from nmt_cli.engine.parts import Data, Setup
from nmt_cli.engine.schedule import learning_rate
from nmt_cli.engine.state import Initial, Interrupted, Outputs, Quiet, Reporter, State
from nmt_cli.engine.step import STEP_FIGURES, train_step
from nmt_cli.errors import NmtError
from nmt_cli.shards import Shard

# A compiled update's source and target lengths are multiples of this. The GPU's memory-efficient
# attention pads a mask whose last dimension is not 8-aligned, and a graph compiled for dynamic
# lengths then holds a guard on S % 8: the source lengths' grid (steps of 2) would compile the
# update again for each alignment, or fail on a misaligned bias (pytorch#163083, #150403).
ALIGN = 8

# The signals that stop a run after a checkpoint: a scheduler's or the user's SIGTERM and
# Ctrl-C, a closed terminal's SIGHUP, Ctrl-\'s SIGQUIT; the launcher passes each on to its
# workers (torch's elastic agent forwards these four).
STOPPING = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n))

# Updates in a window of training figures (engine/figures.py): the host reads them only this
# often (and at validations and checkpoints); signals and the time budget are looked at then too.
LOG_EVERY = 10


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        data: Data,
        out: Outputs,
        reporter: Reporter,
        setup: Setup,
        scores_of: Callable[[list[list[int]]], dict[str, float]] | None = None,
        init: Initial | None = None,
        resample: Callable[[int], tuple[Shard, Shard]] | None = None,
    ):
        """`setup`: the parts to train and where (`build(config, data, reporter)`).
        `scores_of` scores greedy translations of the validation set, given as token ids, by
        figure name (--eval-bleu's valid_bleu, --comet's valid_comet: train.validation_scores).
        `resample(epoch)` gives the training pairs of an epoch encoded anew (for --bpe-dropout;
        bpe.dropout_encoding makes them).
        nmt_cli.train.build_trainer hands a run directory's data and outputs to it."""
        self.config, self.out, self.reporter = config, out, reporter
        self.scores_of, self.init = scores_of, init
        self.dist, self.device, self.precision = setup.dist, setup.device, setup.precision
        if not self.dist.is_main:  # rank 0 alone talks, logs and writes
            self.reporter = reporter = Quiet()
        self.model_config, self.model, self.forward = setup.model_config, setup.model, setup.forward
        self.optimizer, self.scaler, self.ema = setup.optimizer, setup.scaler, setup.ema
        self.compiling = config.compile
        self._load_data(data, resample)
        self.parts = saving.Parts(self.model, self.optimizer, self.scaler, self.ema)
        # an adapted run's checkpoints hold the adapters, and name the model they adapt
        adapted = None
        if config.adapters and init is not None:
            base = os.path.abspath(init.where)
            adapted = {"rank": config.adapters, "base": base, "base_sha256": init.sha256}
        self.checkpoints = saving.Checkpoints(
            out, config, self.model_config, (data.src, data.tgt), self.dist, self.device, reporter, adapted
        )
        self.state = State()
        self.figures = Figures(late=self.device.type == "cuda")  # train_step's, not read yet
        # Updates collated in advance by a thread of their own: on a GPU only, where the host
        # feeds the device; on a CPU the thread would take cores from the step.
        self.collate_ahead = 2 if self.device.type == "cuda" else 0
        self.last: dict = {}  # the figures of the last read
        self.saved_at = -1
        self._signal: int | None = None
        self._started = self._window_start = time.monotonic()  # train() starts them again

    def _load_data(self, data: Data, resample: Callable[[int], tuple[Shard, Shard]] | None) -> None:
        """The training epochs and the validation split, pairs over the length limit left out."""
        config, reporter = self.config, self.reporter
        limit = min(self.model_config.max_positions, config.max_tokens)
        train = Split.of(*data.train, limit, list(data.corpora))
        # On a GPU the next epoch's batches are made while this one trains (as collation is).
        ahead = self.device.type == "cuda"
        self.epochs = Epochs(
            train,
            config.max_tokens,
            config.update_freq,
            config.seed,
            self.dist,
            resample,
            ahead,
            ALIGN if config.compile or config.fixed_shapes else 1,
            config.fixed_shapes,
        )
        self.valid_data = Split.of(*data.valid, limit) if data.valid is not None else None
        if len(self.epochs.fixed.keep) == 0:
            raise NmtError(f"no training pair fits --max-tokens {config.max_tokens}: raise it")
        dropped = len(self.epochs.fixed.src) - len(self.epochs.fixed.keep)
        if dropped:
            reporter.say(f"{dropped} training pairs are longer than {limit} tokens and are left out")

    # -- checkpoints (engine/saving.py)
    def save(self) -> None:
        self.checkpoints.save(self.parts, dataclasses.replace(self.state, seconds=self.elapsed()))
        self.saved_at = self.state.step

    def resume(self) -> None:
        """Go on from the newest checkpoint, else start from --init-from, if given."""
        adapting = bool(self.config.adapters) and self.init is not None
        if adapting and self.init is not None:  # the adapted model, then its adapters
            self.init.load_into(self.model, self.model_config)
        state = self.checkpoints.resume(self.parts)
        if state is not None:
            self.state, self.saved_at = state, state.step
        elif self.init is not None:  # a fresh optimizer and schedule, unless asked to keep them
            said = self.init.start(self.model, self.model_config, self.optimizer, self.state, loaded=adapting)
            self.reporter.say(said)
            saving.set_optimizer_options(self.optimizer, self.config)
            if (
                self.ema is not None
            ):  # the average starts from the model it fine-tunes, not the draws it replaced
                self.ema.load(self.model.state_dict())

    # -- metrics
    def log(self, kind: str, metrics: dict, step: int | None = None, epoch: int | None = None) -> None:
        if not self.dist.is_main:
            return
        record = {
            "kind": kind,
            "step": self.state.step if step is None else step,
            "epoch": (self.state.epoch if epoch is None else epoch) + 1,
            "minutes": round(self.elapsed() / 60, 4),
            **metrics,
        }
        self.out.add_metric(record)
        self.reporter.record(record)

    def elapsed(self) -> float:
        return self.state.seconds + time.monotonic() - self._started

    def read_figures(self, wait: bool = True) -> None:
        """Close the window of the updates since the last read and read the windows ready (all
        of them when `wait`: that waits for the device); count the skipped updates, and log the
        rest of each window as one "train" record."""
        now = time.monotonic()
        self.figures.close(self.state.step, self.state.epoch, now - self._window_start)
        self._window_start = now
        for window, rows in self.figures.ready(wait):
            self._read_window(window, rows)

    def _read_window(self, window: Window, rows: list[list[float]]) -> None:
        first = window.last_step - len(rows) + 1
        loss = nll = tokens = 0.0
        updates = 0
        for i, row in enumerate(rows):
            figures = dict(zip(STEP_FIGURES, row))
            if figures["skipped"]:
                self.skipped(first + i)
                continue
            self.state.bad_in_a_row = 0
            loss, nll = loss + figures["loss_sum"], nll + figures["nll_sum"]
            tokens += figures["tokens"]
            updates += 1
        if not updates:
            return
        c = self.config
        self.last = {
            "loss": loss / tokens,
            "nll": nll / tokens,
            "ppl": math.exp(min(nll / tokens, 50.0)),
            "lr": self.rate(window.last_step),
            "grad_norm": figures["grad_norm"] if not figures["skipped"] else None,
            "tokens": round(tokens / updates),
            "tokens_per_s": tokens / window.seconds if window.seconds > 0 else 0.0,
        }
        self.log("train", self.last, window.last_step, window.epoch)
        self.reporter.progress(self.state, c.max_steps or None, self.last)

    def skipped(self, step: int) -> None:
        self.state.skipped += 1
        self.state.bad_in_a_row += 1
        self.log("skipped", {"skipped": self.state.skipped}, step)
        self.reporter.say(
            f"skipped update {step}, whose loss or gradients were non-finite ({self.state.skipped} so far)"
        )
        if self.state.bad_in_a_row >= self.config.max_bad_steps:
            raise NmtError(
                f"{self.state.bad_in_a_row} updates in a row had non-finite loss "
                f"or gradients (up to step {step}): lower --lr-scale, "
                "set --clip-norm, or use --precision fp32"
            )

    def rate(self, step: int) -> float:
        """The learning rate of update `step`, by the configured schedule."""
        c = self.config
        return learning_rate(
            step, self.model_config.d_model, c.warmup, c.lr_scale, c.schedule, c.lr, c.max_steps, c.min_lr
        )

    # -- the loop
    def autocast(self):
        dtype = dtype_of(self.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def step(self, batches: list[Batch]) -> None:
        """Queue one update; its figures are read later (read_figures)."""
        lr = self.rate(self.state.step + 1)
        start = time.perf_counter()
        self.figures.add(
            train_step(
                self.model,
                self.forward,
                self.optimizer,
                self.scaler,
                batches,
                clip_norm=self.config.clip_norm,
                lr=lr,
                autocast=self.autocast,
                group=self.dist,
                fold=self.config.fold_scaling,
            )
        )
        if self.compiling:  # the first update traced and compiled the model with its loss
            self.compiling = False
            seconds = time.perf_counter() - start
            self.reporter.say(f"compiled the update (model, logits, loss) in {seconds:.1f} s")
        self.state.step += 1
        self.state.batch += len(batches)
        if self.ema is not None:
            self.ema.update(self.state.step)

    def validate(self) -> dict | None:
        """The validation figures, of the moving average of the weights with --ema."""
        if self.valid_data is None:
            return None
        with self.ema.swapped_into(self.model) if self.ema is not None else contextlib.nullcontext():
            return self._validate()

    def _validate(self) -> dict:
        assert self.valid_data is not None  # validate() asks for it
        c = self.config
        return validation.figures(
            self.model, self.valid_data, c.max_tokens, self.dist, self.device, self.autocast, self.scores_of
        )

    def evaluate(self) -> None:
        metrics = self.validate()
        if metrics is None:
            return
        # Lower is better: the NLL, or BLEU or COMET negated.
        best = self.config.best_metric
        score = metrics["valid_nll"] if best == "nll" else -metrics[f"valid_{best}"]
        if score < self.state.best_valid:
            self.state.best_valid, self.state.bad_evals = score, 0
        else:
            self.state.bad_evals += 1
        if self.config.keep_best and self.dist.is_main:
            weights = self.ema.weights if self.ema is not None else self.model.state_dict()
            if self.config.adapters:  # the best models are plain ones
                weights = adapters.merged(weights, adapters.own(weights))
            self.checkpoints.keep_if_best(weights, self.state.step, score, metrics)
        if self.config.keep_best:
            self.dist.wait_for_main()
        self.log("valid", metrics)
        self.reporter.progress(self.state, self.config.max_steps or None, metrics)

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def limit_reached(self) -> str | None:
        """The limits every rank reaches at the same update by itself."""
        c, s = self.config, self.state
        if c.max_steps and s.step >= c.max_steps:
            return f"reached --max-steps {c.max_steps}"
        if c.max_epochs and s.epoch >= c.max_epochs:
            return f"reached --max-epochs {c.max_epochs}"
        return None

    def agreed_stop(self) -> str | None:
        """What the ranks must decide together: a signal that any rank received (save and stop
        all), the time budget (clocks differ: any rank's), and patience (rank 0's)."""
        c, s = self.config, self.state
        mine = [
            self._signal or 0,
            int(bool(c.max_time) and self.elapsed() >= c.max_time * 60),
            int(bool(c.patience) and s.bad_evals >= c.patience and self.dist.is_main),
        ]
        signum, time_up, patience = self.dist.host_max(mine)
        if signum:
            self.read_figures()
            if self.saved_at != s.step:
                self.save()
            raise Interrupted(signum, s.step)
        if time_up:
            return f"reached --max-time {c.max_time:g} minutes"
        if patience:
            what = {"nll": "loss", "bleu": "BLEU", "comet": "COMET"}[c.best_metric]
            return f"validation {what} did not improve in {c.patience} evaluations (--patience)"
        return None

    def after_update(self) -> str | None:
        """Read, validate, save and decide at the updates that call for it; why training ends
        now, if it does."""
        c, s = self.config, self.state
        evaluate = s.step % c.eval_every == 0
        save = s.step % c.save_every == 0
        limit = self.limit_reached()
        if not (evaluate or save or limit or s.step % LOG_EVERY == 0 or s.step == 1):
            return None
        # Between validations and checkpoints, the figures may come a window late.
        self.read_figures(wait=bool(evaluate or save or limit))
        if evaluate:
            self.evaluate()
        if save:
            self.save()
        if evaluate or save:  # tokens/s measures training only
            self._window_start = time.monotonic()
        return limit or self.agreed_stop()

    def train(self) -> dict:
        """Train until a limit is reached; returns the last figures."""
        self.resume()
        self._started = self._window_start = time.monotonic()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOPPING}
        c = self.config
        resumed_at = self.state.step
        try:
            reason = self.limit_reached() or self.agreed_stop()
            while reason is None:
                data, batches = self.epochs.data(self.state.epoch), self.epochs.batches(self.state.epoch)
                if self.state.batch == 0:
                    share = padding_share(batches, data.src_lengths, data.tgt_lengths)
                    self.log("epoch", {"batches": len(batches), "padding": share})
                updates = [
                    batches[i : i + c.update_freq]
                    for i in range(self.state.batch, len(batches), c.update_freq)
                ]
                batched = on_device(data, updates, self.device, self.collate_ahead, c.fixed_shapes)
                for group in batched:
                    self.step(group)
                    reason = self.after_update()
                    if reason:
                        break
                if self.state.batch >= len(batches):
                    self.state.epoch += 1
                    self.state.batch = 0
                    reason = reason or self.limit_reached()
            self.read_figures()
            # A resumed run that made no update was validated at this step before.
            if self.state.step % c.eval_every != 0 and self.state.step != resumed_at:
                self.evaluate()
            if self.saved_at != self.state.step:
                self.save()
            # The ranks leave together: none tears down its connections while rank 0 still writes.
            self.dist.barrier()
            self.reporter.say(f"training stopped: {reason}")
            return {"reason": reason, "step": self.state.step, **self.last}
        except torch.OutOfMemoryError:
            raise NmtError(
                f"out of memory on {self.device} at step {self.state.step + 1} with batches of "
                f"--max-tokens {c.max_tokens}: lower --max-tokens, and raise --update-freq to "
                f"keep the tokens per update (now {c.max_tokens} x {self.dist.world} ranks x "
                f"{c.update_freq})"
            ) from None
        except RuntimeError as e:
            if self.dist.active and distributed.is_lost_contact(e):
                raise NmtError(
                    f"{distributed.LOST_CONTACT} at step {self.state.step} ({str(e).splitlines()[0][:200]})"
                ) from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # DDP holds the process group; released here, gloo's threads stop now rather than
            # during interpreter shutdown, where a rank could abort (SIGABRT) after a finished run.
            del self.forward
            gc.collect()
            self.dist.close()
