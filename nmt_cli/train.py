"""`nmt train` below the CLI: the settings of a run, training in this process, launching
workers, and the worker that a launch starts.

A launched worker is given its run directory, not a command line: it reads the settings the
launcher saved there (train.json) and trains with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable

from nmt_cli import ui
from nmt_cli.config import PRESETS, LaunchConfig, TrainConfig, from_json
from nmt_cli.engine import checkpoint, launcher, parts, state, trainer
from nmt_cli.engine.batches import Split
from nmt_cli.errors import NmtError
from nmt_cli.files import read_regular
from nmt_cli.rundir import RunDir
from nmt_cli.shards import Shard


def _saved(run: RunDir) -> TrainConfig:
    """The settings a run saved (train.json), read as a regular file under a size cap."""
    path = run.config_path("train")
    return from_json(TrainConfig, read_regular(path, 1 << 20).decode("utf-8", "replace"), str(path))


def settings(run: RunDir, given: dict, explicit: set[str]) -> TrainConfig:
    """The run's TrainConfig: a resume keeps the saved settings, and the options set on the
    command line (`explicit`) override them; a new run takes `given` whole."""
    if checkpoint.listed(run.checkpoints) and run.config_path("train").exists():
        saved = _saved(run)
        if "optimizer" in explicit and given["optimizer"] != saved.optimizer:
            raise NmtError(
                f"{run.root} trains with --optimizer {saved.optimizer}, whose state its checkpoints "
                "hold: a resume keeps it (start a new run, or --init-from this one)"
            )
        return dataclasses.replace(saved, **{k: given[k] for k in explicit})
    config = TrainConfig(**given)
    if config.init_from and "size" in explicit:  # --init-from keeps its model's shape: a --size
        preset = {k: v for k, v in PRESETS[config.size].items() if "dropout" not in k}  # must be it
        config = dataclasses.replace(
            config, **{k: v for k, v in preset.items() if getattr(config, k) is None}
        )
    if config.init_from and not config.init_schedule and not explicit & set(SCHEDULE_OPTIONS):
        return fine_tuning_schedule(config)
    return config


# The options that shape the learning rate: give any of them and the schedule is yours.
SCHEDULE_OPTIONS = ("schedule", "lr", "lr_scale", "warmup", "min_lr")


def fine_tuning_schedule(config: TrainConfig) -> TrainConfig:
    """--init-from's schedule unless one is asked for: a short warm-up to 1e-4 (about the rate
    the paper's schedule has come down to after a base run's 100k steps), then a linear decay to
    zero at --max-steps (held with no limit). The paper's schedule restarted would take a trained
    model back up to several times that rate (7e-4 for base) over 4,000 steps."""
    steps = config.max_steps
    warmup = max(1, min(500, steps // 10)) if steps else 500
    schedule = "linear" if steps > warmup else "constant"
    return dataclasses.replace(config, schedule=schedule, lr=1e-4, warmup=warmup)


def train_here(run: RunDir, config: TrainConfig, rank: int) -> dict:
    """Train in this process (alone, or as one rank that torchrun or SLURM started)."""
    if rank == 0:
        run.save_config("train", config)
    return _train(run, config)


def check_launch(how: LaunchConfig, device: str) -> None:
    if how.gpus:
        if device == "cpu":
            raise NmtError("--gpus trains on GPUs: drop --device cpu, or use --procs N instead")
        launcher.check_gpus(how.gpus)
    elif device.startswith("cuda"):
        raise NmtError("--procs starts CPU workers: use --gpus N for GPUs")


def launch(run: RunDir, config: TrainConfig, how: LaunchConfig) -> None:
    """Start this node's workers on `config`; returns when the job has finished."""
    check_launch(how, config.device)
    if not how.gpus and config.device == "auto":
        config = dataclasses.replace(config, device="cpu")
    workers = how.gpus or how.procs
    ui.say(
        f"starting {workers} worker{'s' if workers > 1 else ''} on node {how.node_rank} "
        f"({'NCCL, one GPU each' if how.gpus else 'gloo, CPU'}); effective batch: "
        f"{config.max_tokens} tokens x {workers * how.nnodes} ranks x {config.update_freq} = "
        f"{config.max_tokens * workers * how.nnodes * config.update_freq:,} tokens per update"
    )
    # Node 0 holds the run directory's lock for the whole job; the other nodes share that
    # directory (or it is their own copy, whose checkpoints the ranks then compare on resume).
    with run.lock("train") if how.node_rank == 0 else contextlib.nullcontext():
        run.save_config("train", config)
        try:
            launcher.launch(
                workers,
                ["-m", "nmt_cli.train", str(run.root)],
                how.nnodes,
                how.node_rank,
                how.rdzv_endpoint,
                how.max_restarts,
                ui.say,
                how.stop_grace,
            )
        except launcher.Stopped as e:  # the workers saved what they could
            saved = checkpoint.listed(run.checkpoints)
            step = checkpoint.step_of(saved[-1]) if saved else None
            raise state.Interrupted(e.signum, step) from None


def worker(run_dir: str) -> int:
    """A launched worker: train on the saved settings; the exit status."""
    run = RunDir(run_dir)
    if os.environ.get("RANK", "0") == "0":  # the launcher holds the run; rank 0 speaks for it
        ui.log_to(run.log, f"nmt train: rank 0 (pid {os.getpid()})")
    try:
        config = _saved(run)
        _train(run, config)
        return 0
    except state.Interrupted as e:  # the launcher says so, once
        return 128 + e.signum
    except Exception as e:  # noqa: BLE001 - every failure becomes the job's one error line
        message = (
            " ".join(str(e).split())
            if isinstance(e, NmtError)
            else f"internal error: {type(e).__name__}: {e}"
        )
        launcher.record_worker_error(message)
        print(f"nmt: rank {os.environ.get('RANK', '?')}: {message}", file=sys.stderr, flush=True)
        return 1


def _train(run: RunDir, config: TrainConfig) -> dict:
    scores_of = validation_scores(run, config)
    init = initial_model(run, config) if config.init_from else None
    if init is not None and config.share_embeddings is None:  # a fine-tuned model keeps its tying
        config = dataclasses.replace(config, share_embeddings=not init.config.src_vocab_size)
    resample = _resample(run, config) if config.bpe_dropout else None
    with ui.TrainDisplay() as display, contextlib.ExitStack() as stack:
        reporter = display
        if config.tensorboard:
            from nmt_cli.engine.tensorboard import TensorBoard

            reporter = stack.enter_context(TensorBoard(display, run.tensorboard))
        if config.compile:
            stack.enter_context(compile_cache(run))
        return build_trainer(config, run, reporter, scores_of, init, resample).train()


def validation_scores(run: RunDir, config: TrainConfig) -> Callable[[list[list[int]]], dict] | None:
    """What the validation's greedy translations are scored with (--eval-bleu, --comet), as
    token ids: the trainer's figures by name; None where neither is asked for."""
    from nmt_cli import metrics

    scorers: dict[str, Callable[[list[list[int]]], float | dict[str, float]]] = {}
    if config.eval_bleu:  # a figure each, or one for each direction of the run and their mean
        scorers["valid_bleu"] = metrics.bleu_of_ids(run, run.load_manifest()["prep"]["tgt"])
    if config.comet:
        scorers["valid_comet"] = comet_of_ids(
            run, config.comet, config.comet_lines, config.comet_precision, config.device
        )
        if os.environ.get("RANK", "0") == "0":
            kept = run.load_manifest()["prep"]["splits"].get("valid", {}).get("kept", "?")
            ui.say(
                f"validation COMET: greedy translations of the first {config.comet_lines} of {kept} "
                "validation lines (--comet-lines)"
            )
    if not scorers:
        return None

    def figures(ids: list[list[int]]) -> dict:
        out: dict = {}
        for name, scorer in scorers.items():
            found = scorer(ids)
            out.update(found if isinstance(found, dict) else {name: found})
        return out

    return figures


@contextlib.contextmanager
def compile_cache(run: RunDir):
    """torch.compile's caches in the run directory while it trains: a resumed run (on another
    machine too, or after /tmp was cleared) reuses the kernels compiled before instead of
    compiling them again, in a folder of the CPU's kind (cpu_kind: a run resumed on another
    kind of CPU compiles its own). A cache directory the user chose stays theirs (torch itself
    writes its default into the variable once it has compiled something)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from nmt_cli.engine.device import cpu_kind

    key = "TORCHINDUCTOR_CACHE_DIR"
    before = os.environ.get(key)
    if before is not None and os.path.abspath(before) != os.path.abspath(default_cache_dir()):
        yield
        return
    os.environ[key] = str(run.compile_cache / cpu_kind())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def data_of(run: RunDir, temperature: float = 1.0) -> parts.Data:
    """The binarized data of `run` (`nmt prep` and `nmt bpe`), as the trainer takes it, its
    training corpora sampled at `temperature` (--pair-temperature)."""
    manifest = run.load_manifest()
    prep, bpe = manifest.get("prep"), manifest.get("bpe")
    if not prep or not bpe:
        raise NmtError(
            f"{run.root} has no binarized data: run `nmt "
            f"{'prep' if not prep else 'bpe'}` first (with --run-dir {run.root})"
        )
    src, tgt = prep["src"], prep["tgt"]

    def pairs(split: str) -> tuple[Shard, Shard]:
        return Shard(run.tokens(split, src)), Shard(run.tokens(split, tgt))

    return parts.Data(
        train=pairs("train"),
        valid=pairs("valid") if "valid" in prep["splits"] else None,
        src=src,
        tgt=tgt,
        vocab_size=bpe["vocab_size"],
        corpora=Split.tempered(prep["splits"]["train"].get("corpora", []), temperature),
        src_vocab_size=None if bpe.get("joint", True) else bpe["src_vocab_size"],
    )


def build_trainer(
    config: TrainConfig,
    run: RunDir,
    reporter: state.Reporter,
    scores_of=None,
    init: state.Initial | None = None,
    resample=None,
) -> trainer.Trainer:
    """A Trainer over `run`'s data, writing its checkpoints, best models and figures there,
    handed the parts `config` asks for."""
    data = data_of(run, config.pair_temperature)
    setup = parts.build(config, data, reporter, init.config if init is not None else None)
    return trainer.Trainer(config, data, run, reporter, setup, scores_of, init, resample)


def _resample(run: RunDir, config: TrainConfig):
    """--bpe-dropout's encoding of an epoch's training pairs, for the trainer."""
    from nmt_cli.bpe import dropout_encoding

    prep = run.load_manifest()["prep"]
    if run.load_manifest().get("bpe", {}).get("languages"):
        raise NmtError("--bpe-dropout of a run that fine-tunes a multilingual model: not yet")

    def resample(epoch: int):
        return tuple(
            dropout_encoding(run, lang, config.bpe_dropout, config.seed, epoch)
            for lang in (prep["src"], prep["tgt"])
        )

    return resample


def initial_model(run: RunDir, config: TrainConfig) -> state.Initial:
    """--init-from: a package, a run directory (its averaged model, else its latest
    checkpoint) or a checkpoint file; refused unless it shares this run's BPE models. With
    --init-optimizer / --init-schedule, a training checkpoint (a run's latest, or the file)."""
    from pathlib import Path

    from nmt_cli.inference import models

    where = config.init_from
    keep = config.init_optimizer or config.init_schedule
    if keep and RunDir(Path(where)).manifest_path.is_file():  # a run: its latest checkpoint
        found = checkpoint.listed(RunDir(Path(where)).checkpoints)
        if not found:
            raise NmtError(f"--init-from {where} has no training checkpoint to keep the optimizer or step of")
        where = str(found[-1])
    # Read once: the weights come from the same tensors as the optimizer state.
    path = Path(where)
    is_checkpoint = path.is_file() and path.with_suffix(".json").is_file()
    loaded = checkpoint.load_tensors(path) if keep and is_checkpoint else None
    # adapters are merged into their base one level deep: new ones adapt a plain model (an
    # adapted run's averaged model, or its export)
    model = models.locate(path, loaded, adapted=not config.adapters)
    if model.load_weights is None:
        raise NmtError(
            f"--init-from {where} is a CTranslate2 export: give the run directory or the nmt package"
        )
    if models.vocabulary_key(model.vocabs) != models.vocabulary_key(run.vocabularies()):
        raise NmtError(
            f"{run.root}'s BPE model is not the one {where} was trained with: "
            f"encode the data with `nmt bpe --from {where}`"
        )
    tensors, meta = loaded or ({}, {})
    if keep and "optimizer" not in tensors:
        raise NmtError(
            f"--init-from {where} is not a training checkpoint (an averaged model or a package "
            "keeps no optimizer or step): give one of checkpoints/checkpoint_*.pt"
        )
    optimizer = tensors["optimizer"] if config.init_optimizer else None
    step = meta["step"] if config.init_schedule else 0
    return state.Initial(str(model.where), model.config, model.load_weights, optimizer, step, model.sha256)


def comet_of_ids(
    run, folder: str, lines: int, precision: str = "fp32", device: str = "cpu"
) -> Callable[[list[list[int]]], float]:
    """What `nmt train --comet` hands the trainer: the COMET of translations given as token ids
    of the validation set, on its first `lines` lines, with their sources and references as
    released. The model is read at the first call (rank 0's alone), on the device training
    runs on (`device`, as --device names it): a GPU is the one the trainer made the main
    thread's current, named here by its index."""
    from pathlib import Path

    from nmt_cli import metrics
    from nmt_cli.inference import comet
    from nmt_cli.vocab import processor

    if not (Path(folder) / "checkpoints" / "model.ckpt").is_file():
        raise NmtError(f"--comet {folder} is not a COMET model folder: no checkpoints/model.ckpt in it")
    prep = run.load_manifest()["prep"]
    sources, refs = (metrics.valid_lines(run, lang)[:lines] for lang in (prep["src"], prep["tgt"]))
    sp = processor(run.vocabularies().target)
    drop = metrics.language_ids(run, sp)
    model: list = []

    def score(ids: list[list[int]]) -> float:
        if not model:
            import torch

            from nmt_cli.config import resolve_device_name

            place = resolve_device_name(device, torch.cuda.is_available())
            if place.startswith("cuda"):
                place = f"cuda:{torch.cuda.current_device()}"
            model.append(comet.load(folder, precision, place))
            if not model[0].hparams.needs_reference:
                raise NmtError(
                    f"--comet {folder} is a reference-free model: give a reference-based COMET model"
                )
        kept = [[t for t in x if t not in drop] for x in ids[: len(refs)]]
        return comet.system_score(model[0].score(sp.decode(kept), sources, refs))

    return score


if __name__ == "__main__":
    code = worker(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skipping the interpreter's teardown keeps a late C++ abort in torch.distributed from
    # turning a finished job into a failed one.
    os._exit(code)
