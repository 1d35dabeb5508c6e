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
import json
import math
import signal
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from nmt_cli.config import TrainConfig
from nmt_cli.engine import beam, checkpoint, distributed
from nmt_cli.engine.model import ModelConfig, Transformer
from nmt_cli.errors import NmtError
from nmt_cli.rundir import RunDir, atomic_write_text, now
from nmt_cli.shards import PAD, Shard, collate, make_batches, padding_share


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Section 5.3: d^-0.5 * min(step^-0.5, step * warmup^-1.5), times `scale`."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy with a hand-written backward: the gradient is
    softmax - (1 - epsilon) * onehot - epsilon / V, computed in place from the saved
    log-probabilities. Autograd's version materialises three more (N, V) tensors."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, epsilon: float):
        lprobs = F.log_softmax(logits.float(), dim=-1)                       # (N, V)
        nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)                # (N,)
        uniform = -lprobs.sum(dim=-1) / lprobs.shape[-1]                     # (N,)
        ctx.save_for_backward(lprobs, target)
        ctx.epsilon, ctx.dtype = epsilon, logits.dtype
        return ((1.0 - epsilon) * nll + epsilon * uniform).sum(), nll.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, grad_nll: torch.Tensor | None):
        lprobs, target = ctx.saved_tensors
        eps, v = ctx.epsilon, lprobs.shape[-1]
        g_loss = grad_loss.float()
        g_nll = grad_nll.float() if grad_nll is not None else torch.zeros_like(g_loss)
        grad = lprobs.exp_().mul_(g_loss + g_nll).sub_(g_loss * eps / v)    # softmax, in place
        grad.scatter_add_(-1, target[:, None],
                          (-(g_loss * (1.0 - eps) + g_nll)).expand(len(target), 1).contiguous())
        return grad.to(ctx.dtype), None, None


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor,
                        epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed smoothed loss and summed NLL of (N, V) scores against (N,) targets.

    The smoothing mass epsilon is spread uniformly over the vocabulary (section 5.4).
    """
    return _SmoothedCrossEntropy.apply(logits, target, epsilon)


def batch_loss(model: Transformer, forward: torch.nn.Module, batch: list[torch.Tensor],
               label_smoothing: float, autocast) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Summed smoothed loss, summed NLL and target token count of one (src, tgt_in, tgt_out)."""
    src, tgt_in, tgt_out = batch
    with autocast():
        hidden = forward(src, tgt_in)
        mask = tgt_out != PAD
        logits = model.logits(hidden[mask])  # padding never reaches the output layer
    loss, nll = label_smoothed_loss(logits, tgt_out[mask], label_smoothing)
    return loss, nll, int(mask.sum())


def train_step(model: Transformer, forward: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, batches: list[list[torch.Tensor]], *,
               label_smoothing: float, clip_norm: float, lr: float, autocast,
               group: distributed.Group) -> dict | None:
    """One update from (src, tgt_in, tgt_out) batches: forward, label-smoothed loss, backward,
    the gradient as a per-token mean over all ranks, clipping, Adam. None if non-finite.

    `forward` is the model as called for training (compiled and/or DDP-wrapped); gradients are
    all-reduced only after the last batch.
    """
    model.train()
    loss_sum = nll_sum = tokens = 0.0
    for i, batch in enumerate(batches):
        sync = i == len(batches) - 1
        with (contextlib.nullcontext() if sync else group.no_sync(forward)):
            loss, nll, n = batch_loss(model, forward, batch, label_smoothing, autocast)
            scaler.scale(loss).backward()
        loss_sum += loss.item()
        nll_sum += nll.item()
        tokens += n
    loss_sum, nll_sum, tokens = group.sum([loss_sum, nll_sum, tokens], batches[-1][2].device)
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # The loss is a sum over this rank's tokens and DDP averaged over ranks: make the gradient
    # the mean over every token of the update.
    torch._foreach_mul_(grads, group.world / tokens)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm or math.inf)
    if not (math.isfinite(loss_sum) and math.isfinite(float(norm))):
        optimizer.zero_grad(set_to_none=True)
        scaler.update()  # with fp16, backs the loss scale off
        return None
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "lr": lr,
            "grad_norm": float(norm), "tokens": int(tokens)}


class Reporter(Protocol):
    def progress(self, state: "State", total_steps: int | None, metrics: dict) -> None: ...
    def say(self, message: str) -> None: ...


class _Quiet:
    def progress(self, state, total_steps, metrics) -> None:
        pass

    def say(self, message: str) -> None:
        pass


class Interrupted(Exception):
    """Training stopped by a signal after saving a checkpoint."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; a checkpoint "
                         "was saved: run `nmt train` again to resume")


@dataclass
class State:
    """Progress that a resume needs besides the tensors."""
    step: int = 0                 # updates made
    epoch: int = 0
    batch: int = 0                # next batch of this epoch
    seconds: float = 0.0          # training time of earlier processes
    best_valid: float = math.inf
    bad_evals: int = 0            # evaluations since the best one
    skipped: int = 0              # updates skipped for non-finite loss or gradients
    bad_in_a_row: int = 0


@dataclass
class Split:
    src: Shard
    tgt: Shard
    src_lengths: np.ndarray       # with the EOS
    tgt_lengths: np.ndarray       # with the BOS/EOS
    keep: np.ndarray              # sentences short enough for the model and the batch size

    @classmethod
    def load(cls, run: RunDir, split: str, src: str, tgt: str, limit: int) -> "Split":
        s, t = Shard(run.tokens(split, src)), Shard(run.tokens(split, tgt))
        sl, tl = s.lengths + 1, t.lengths + 1
        keep = np.flatnonzero((sl <= limit) & (tl <= limit))
        return cls(s, t, sl, tl, keep)

    def batches(self, max_tokens: int, seed: int, epoch: int, rank: int = 0,
                world: int = 1) -> list[np.ndarray]:
        """This rank's share of the epoch's batches: every world-th one, the same number on
        every rank (the few left over are dropped)."""
        groups = make_batches(self.src_lengths[self.keep], self.tgt_lengths[self.keep],
                              max_tokens, seed, epoch)
        usable = len(groups) // world * world
        return [self.keep[g] for g in groups[rank:usable:world]]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NmtError(f"--device {name}: no CUDA GPU is visible here; use --device cpu")
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise NmtError("--precision fp16 needs a GPU; on the CPU use bf16 or fp32")
    return precision


class Trainer:
    def __init__(self, config: TrainConfig, run: RunDir, reporter: Reporter):
        self.config, self.run, self.reporter = config, run, reporter
        prep = run.load_manifest().get("prep")
        bpe = run.load_manifest().get("bpe")
        if not prep or not bpe:
            raise NmtError(f"{run.root} has no binarized data: run `nmt "
                           f"{'prep' if not prep else 'bpe'}` first (with --run-dir {run.root})")
        self.src_lang, self.tgt_lang = prep["src"], prep["tgt"]
        if config.threads:
            torch.set_num_threads(config.threads)
        self.dist, self.device = distributed.setup(resolve_device(config.device))
        if not self.dist.is_main:  # rank 0 alone talks, logs and writes
            self.reporter = reporter = _Quiet()
        self.precision = resolve_precision(config.precision, self.device)
        self.model_config: ModelConfig = config.model_config(bpe["vocab_size"])
        limit = min(self.model_config.max_positions, config.max_tokens)
        self.train_data = Split.load(run, "train", self.src_lang, self.tgt_lang, limit)
        self.valid_data = (Split.load(run, "valid", self.src_lang, self.tgt_lang, limit)
                           if "valid" in prep["splits"] else None)
        if len(self.train_data.keep) == 0:
            raise NmtError("no training pair fits --max-tokens "
                           f"{config.max_tokens}: raise it")
        dropped = len(self.train_data.src) - len(self.train_data.keep)
        if dropped:
            reporter.say(f"{dropped} training pairs are longer than {limit} tokens and are left out")
        if not self.train_data.batches(config.max_tokens, config.seed, 0, self.dist.rank,
                                       self.dist.world):
            raise NmtError(f"too little training data for one batch per rank ({self.dist.world} "
                           "ranks): use fewer processes or a smaller --max-tokens")
        torch.manual_seed(config.seed)
        self.model = Transformer(self.model_config).to(self.device)
        if self.dist.world > 1:  # same initial weights everywhere, different dropout per rank
            torch.manual_seed(config.seed + 7919 * self.dist.rank)
        compiled = torch.compile(self.model) if config.compile else self.model
        self.forward = self.dist.wrap(compiled, self.device)
        cuda = self.device.type == "cuda"
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=0.0, betas=(config.beta1, config.beta2),
            eps=config.adam_eps, fused=cuda or None, foreach=None if cuda else True)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 7,
                                           enabled=self.precision == "fp16")
        self.state = State()
        self._signal: int | None = None
        self._valid_refs: list[str] | None = None  # loaded at the first --eval-bleu
        self._sp = None

    # -- checkpoints
    def save(self) -> None:
        """Every rank calls this at the same step (its RNG state is gathered); rank 0 writes."""
        rng_cpu = self.dist.gather(torch.get_rng_state())
        rng_cuda = (self.dist.gather(torch.cuda.get_rng_state(self.device).to(self.device)
                                     ) if self.device.type == "cuda" else [])
        if not self.dist.is_main:
            return
        tensors = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                   "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                   "rng_cpu": torch.stack(rng_cpu)}
        if rng_cuda:
            tensors["rng_cuda"] = torch.stack([r.cpu() for r in rng_cuda])
        # The time trained so far goes with the checkpoint: --max-time budgets the whole run,
        # however many times it was interrupted and resumed.
        state = dataclasses.replace(self.state, seconds=self.elapsed())
        meta = {"format": 1, "saved": now(), "step": self.state.step,
                "state": dataclasses.asdict(state),
                "model": dataclasses.asdict(self.model_config),
                "train": dataclasses.asdict(self.config),
                "src": self.src_lang, "tgt": self.tgt_lang, "world": self.dist.world}
        path = checkpoint.path_for(self.run.checkpoints, self.state.step)
        try:
            checkpoint.save_tensors(path, tensors, meta)
        except OSError as e:
            raise NmtError(f"could not write checkpoint {path} ({e.strerror or e}); the previous "
                           "checkpoints are intact: free space or fix the disk, then rerun to "
                           "resume") from None
        checkpoint.prune(self.run.checkpoints, self.config.keep_last)

    def resume(self) -> bool:
        found = checkpoint.load_latest(self.run.checkpoints, self.reporter.say)
        if found is None:
            return False
        tensors, meta = found
        if meta["model"] != dataclasses.asdict(self.model_config):
            raise NmtError(f"the checkpoints in {self.run.checkpoints} are of another model shape "
                           f"({meta['model']}); use another --run-dir or the same shape options")
        self.model.load_state_dict(tensors["model"])
        self.optimizer.load_state_dict(tensors["optimizer"])
        if self.scaler.is_enabled() and tensors.get("scaler"):
            self.scaler.load_state_dict(tensors["scaler"])
        rng_cpu = tensors["rng_cpu"]
        if meta.get("world", 1) == self.dist.world:  # each rank continues its own dropout stream
            # clone(): torch.set_rng_state crashes (SIGSEGV) on a view such as a row.
            torch.set_rng_state((rng_cpu[self.dist.rank] if rng_cpu.dim() == 2 else rng_cpu).clone())
            if self.device.type == "cuda" and "rng_cuda" in tensors:
                torch.cuda.set_rng_state(tensors["rng_cuda"][self.dist.rank].clone(), self.device)
        else:
            self.reporter.say(f"the checkpoint was written by {meta.get('world', 1)} ranks, "
                              f"this run has {self.dist.world}: this epoch's data order and the "
                              "dropout streams differ from an uninterrupted run")
            torch.manual_seed(self.config.seed + 7919 * self.dist.rank + meta["step"])
        self.state = State(**meta["state"])
        if self.dist.is_main:
            self._truncate_metrics(self.state.step)
        self.reporter.say(f"resuming from step {self.state.step} (epoch {self.state.epoch + 1})")
        return True

    # -- metrics
    def _truncate_metrics(self, step: int) -> None:
        """Drop figures logged after the checkpoint we resume from: those steps are redone."""
        if not self.run.metrics.exists():
            return
        kept = []
        for line in self.run.metrics.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a kill
        atomic_write_text(self.run.metrics, "".join(f"{line}\n" for line in kept))

    def log(self, kind: str, metrics: dict) -> None:
        if not self.dist.is_main:
            return
        record = {"kind": kind, "step": self.state.step, "epoch": self.state.epoch + 1,
                  "minutes": round(self.elapsed() / 60, 4), **metrics}
        with open(self.run.metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def elapsed(self) -> float:
        return self.state.seconds + time.monotonic() - self._started

    # -- the loop
    def autocast(self):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def to_device(self, arrays) -> list[torch.Tensor]:
        return [torch.from_numpy(a).to(self.device, non_blocking=True) for a in arrays]

    def step(self, group: list[np.ndarray]) -> dict | None:
        """One update from a group of batches; None if it was skipped as non-finite."""
        batches = [self.to_device(collate(self.train_data.src, self.train_data.tgt, indices))
                   for indices in group]
        lr = learning_rate(self.state.step + 1, self.model_config.d_model, self.config.warmup,
                           self.config.lr_scale)
        return train_step(self.model, self.forward, self.optimizer, self.scaler, batches,
                          label_smoothing=self.config.label_smoothing,
                          clip_norm=self.config.clip_norm, lr=lr, autocast=self.autocast,
                          group=self.dist)

    @torch.no_grad()
    def validate(self) -> dict | None:
        if self.valid_data is None:
            return None
        self.model.eval()
        nll_sum, tokens = 0.0, 0
        for indices in self.valid_data.batches(self.config.max_tokens, 0, 0):
            batch = self.to_device(collate(self.valid_data.src, self.valid_data.tgt, indices))
            _, nll, n = batch_loss(self.model, self.forward, batch, 0.0, self.autocast)
            nll_sum += nll.item()
            tokens += n
        nll = nll_sum / max(tokens, 1)
        metrics = {"valid_nll": nll, "valid_ppl": math.exp(min(nll, 50.0))}
        if self.config.eval_bleu and self.dist.is_main:
            metrics["valid_bleu"] = self.valid_bleu()
        return metrics

    @torch.no_grad()
    def valid_bleu(self, batch_size: int = 64) -> float:
        """sacreBLEU of greedy translations of the validation set against its references as
        released: a cheap stand-in for the test score while training."""
        from nmt_cli import bpe
        from nmt_cli.score import score
        data = self.valid_data
        if self._valid_refs is None:
            path = self.run.text("valid", self.tgt_lang, raw=True)
            if not path.exists():
                path = self.run.text("valid", self.tgt_lang)
            self._valid_refs = path.read_text(encoding="utf-8").splitlines()[:len(data.src)]
            self._sp = bpe.load(self.run)
        ids: list[list[int]] = [[] for _ in range(len(data.src))]
        order = data.keep[np.argsort(-data.src_lengths[data.keep], kind="stable")]
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            src = self.to_device(collate(data.src, data.tgt, rows)[:1])[0]
            with self.autocast():
                hyps = beam.translate(self.model, src, beam=1)
            for i, h in zip(rows, hyps):
                ids[i] = h[0].tokens
        texts = self._sp.decode(ids)
        return score(texts[:len(self._valid_refs)], self._valid_refs, ["bleu"])[0].score

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum

    def should_stop(self) -> str | None:
        """Why training ends now, if it does; every rank reaches the same answer."""
        c, s = self.config, self.state
        if c.max_steps and s.step >= c.max_steps:
            return f"reached --max-steps {c.max_steps}"
        if c.max_epochs and s.epoch >= c.max_epochs:
            return f"reached --max-epochs {c.max_epochs}"
        # Clocks differ between ranks: stop when any rank's has run out.
        time_up = bool(c.max_time) and self.elapsed() >= c.max_time * 60
        if c.max_time and self.dist.sum([float(time_up)], self.device)[0] > 0:
            return f"reached --max-time {c.max_time:g} minutes"
        if c.patience and s.bad_evals >= c.patience:
            return f"validation loss did not improve in {c.patience} evaluations (--patience)"
        return None

    def evaluate_and_maybe_stop(self) -> None:
        metrics = self.validate()
        if metrics is None:
            return
        if metrics["valid_nll"] < self.state.best_valid:
            self.state.best_valid, self.state.bad_evals = metrics["valid_nll"], 0
        else:
            self.state.bad_evals += 1
        self.log("valid", metrics)
        self.reporter.progress(self.state, self.config.max_steps or None, metrics)

    def skipped(self) -> None:
        self.state.skipped += 1
        self.state.bad_in_a_row += 1
        self.log("skipped", {"skipped": self.state.skipped})
        self.reporter.say(f"skipped an update with non-finite loss or gradients "
                          f"({self.state.skipped} so far)")
        if self.state.bad_in_a_row >= self.config.max_bad_steps:
            raise NmtError(f"{self.state.bad_in_a_row} updates in a row had non-finite loss "
                           f"or gradients (at step {self.state.step}): lower --lr-scale, "
                           "set --clip-norm, or use --precision fp32")

    def train(self) -> dict:
        """Train until a limit is reached; returns the last figures."""
        self.resume()
        self._started = time.monotonic()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        c = self.config
        last: dict = {}
        saved_at = self.state.step if self.state.step else -1
        resumed_at = self.state.step
        try:
            reason = self.should_stop()
            window_tokens, window_start = 0, time.monotonic()
            while reason is None:
                batches = self.train_data.batches(c.max_tokens, c.seed, self.state.epoch,
                                                  self.dist.rank, self.dist.world)
                if self.state.batch == 0:
                    share = padding_share(batches, self.train_data.src_lengths,
                                          self.train_data.tgt_lengths)
                    self.log("epoch", {"batches": len(batches), "padding": share})
                while self.state.batch < len(batches) and reason is None:
                    group = batches[self.state.batch:self.state.batch + c.update_freq]
                    result = self.step(group)
                    self.state.batch += len(group)
                    if result is None:
                        self.skipped()
                    else:
                        self.state.bad_in_a_row = 0
                        self.state.step += 1
                        window_tokens += result["tokens"]
                        seconds = time.monotonic() - window_start
                        last = {**result, "ppl": math.exp(min(result["nll"], 50.0)),
                                "tokens_per_s": window_tokens / seconds if seconds > 0 else 0.0}
                        if self.state.step % 10 == 0 or self.state.step == 1:
                            self.log("train", last)
                            window_tokens, window_start = 0, time.monotonic()
                        self.reporter.progress(self.state, c.max_steps or None, last)
                        evaluate = self.state.step % c.eval_every == 0
                        save = self.state.step % c.save_every == 0
                        if evaluate:
                            self.evaluate_and_maybe_stop()
                        if save:
                            self.save()
                            saved_at = self.state.step
                        if evaluate or save:  # tokens/s measures training only
                            window_tokens, window_start = 0, time.monotonic()
                    signum = self._signal or 0
                    if self.dist.active:  # a signal seen by one rank stops them all, together
                        signum = int(max(self.dist.gather(torch.tensor([signum], device=self.device))).item())
                    if signum:
                        if saved_at != self.state.step:
                            self.save()
                        raise Interrupted(signum, self.state.step)
                    reason = self.should_stop()
                if self.state.batch >= len(batches):
                    self.state.epoch += 1
                    self.state.batch = 0
                    reason = reason or self.should_stop()
            # A resumed run that made no update was validated at this step before.
            if self.state.step % c.eval_every != 0 and self.state.step != resumed_at:
                self.evaluate_and_maybe_stop()
            if saved_at != self.state.step:
                self.save()
            # The ranks leave together: none tears down its connections while rank 0 still writes.
            self.dist.barrier()
            self.reporter.say(f"training stopped: {reason}")
            return {"reason": reason, "step": self.state.step, **last}
        except RuntimeError as e:
            if self.dist.active and not isinstance(e, NmtError):
                raise NmtError(f"lost contact with the other ranks at step {self.state.step} "
                               f"({str(e).splitlines()[0][:200]})") from None
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # DDP holds the process group; released here, gloo's threads stop now rather than
            # during interpreter shutdown, where a rank could abort (SIGABRT) after a finished run.
            self.forward = None
            gc.collect()
            self.dist.close()


def train(config: TrainConfig, run: RunDir, reporter: Reporter) -> dict:
    return Trainer(config, run, reporter).train()


def average(run: RunDir, last: int, say: Callable[[str], None]) -> dict:
    """Average the last `last` checkpoints into the run's averaged model."""
    paths = checkpoint.listed(run.checkpoints)
    if not paths:
        raise NmtError(f"no checkpoints in {run.checkpoints}: run `nmt train` first")
    if len(paths) < last:
        say(f"only {len(paths)} checkpoints exist; averaging all of them")
    chosen = paths[-last:]
    weights, meta = checkpoint.average(chosen)
    newest = json.loads(chosen[-1].with_suffix(".json").read_text(encoding="utf-8"))
    record = {**{k: meta[k] for k in ("format", "model", "train", "src", "tgt")},
              "step": newest["step"], "averaged": [p.name for p in chosen], "saved": now()}
    checkpoint.save_tensors(run.averaged, {"model": weights}, record)
    return record
