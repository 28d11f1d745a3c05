"""The training loop (docs/METHOD.md, "Training"): resume or start, step, validate, checkpoint, summarise."""

from __future__ import annotations

import gc
import json
import logging
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...engine.decoding.chat import pad_id
from .checkpoints import (
    CHECKPOINT,
    attach_lora,
    load_trainable_state,
    read_checkpoint,
    save_checkpoint,
    save_model,
    set_rng_state,
)
from .layout import Example, collate, examples_digest, micro_batches
from .logs import LOSS_LOG, VAL_LOG, StepLog, plot_losses, read_history, write_history
from .loss import cuda_autocast
from .parallel import MarsObjective, make_accelerator, shard
from .recipe import TrainConfig, describe
from .validation import Validation, validate

logger = logging.getLogger(__name__)


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup: float):
    """Linear warm-up over ``warmup`` of the steps, then cosine decay to zero."""
    warm = max(1, round(total_steps * warmup)) if warmup > 0 else 0

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def total_steps(n_examples: int, config: TrainConfig, processes: int = 1) -> int:
    """Optimizer steps of a run; each takes ``grad_accum`` micro-batches on each of ``processes``."""
    if config.max_steps is not None:
        return config.max_steps
    per_epoch = math.ceil(n_examples / config.batch_size)
    return max(1, math.ceil(config.epochs * per_epoch / (config.grad_accum * processes)))


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def torch_time() -> float:
    """Wall time that counts queued GPU work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class TrainResult:
    model: torch.nn.Module  # the PEFT-wrapped (or fully trained) model, in train mode
    history: list[StepLog]
    validation: list[Validation]
    steps: int
    total_steps: int
    seconds: float


@dataclass
class Source:
    """What a run trains on and where it started: the data, and the adapter it was initialised from."""

    examples: list[Example]
    base_spec: str
    data_path: str = ""
    started_from: str | None = None  # for training.json; a resumed run's checkpoint holds the weights
    val_examples: list[Example] | None = None
    val_every: int = 100
    val_data: str = ""


def start_or_resume(out_dir: Path, config: TrainConfig, source: Source, resume: bool, init_adapter) -> tuple:
    """(config, the checkpoint or None, the adapter to start from): a resumed run takes the checkpoint's settings."""
    ckpt_dir = out_dir / CHECKPOINT
    if not resume:
        if (ckpt_dir / "state.pt").is_file():
            raise ValueError(f"{out_dir} holds a checkpoint: pass --resume to continue it, or choose another --out")
        source.started_from = str(init_adapter) if init_adapter is not None else None
        return config, None, init_adapter
    saved = read_checkpoint(ckpt_dir)
    changed = {k: v for k, v in saved["config"].items() if asdict(config)[k] != v}
    if changed:
        logger.warning("resuming with the checkpoint's settings %s", changed)
    examples = source.examples[: saved["examples"]]  # a distilled file may have grown since
    if len(examples) < saved["examples"] or examples_digest(examples) != saved["digest"]:
        raise ValueError("the data file no longer starts with the examples this run was trained on")
    source.examples, source.started_from = examples, saved.get("init_adapter")
    return TrainConfig(**saved["config"]), saved, None


@dataclass
class Run:
    """One training run's live state: the model and its optimizer, the step, and the logs so far.

    ``accelerator`` (parallel.py) runs ``objective``, the loss around ``model``: one process, or
    one of several under ``accelerate launch``; only the main process writes files.
    """

    lm: object  # the LoadedModel of the base
    config: TrainConfig
    source: Source
    out_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    steps: int
    accelerator: object
    objective: torch.nn.Module
    step: int = 0
    seconds: float = 0.0
    history: list[StepLog] = field(default_factory=list)
    val_history: list[Validation] = field(default_factory=list)

    @classmethod
    def open(cls, lm, config: TrainConfig, source: Source, out_dir: Path, saved: dict | None, init_adapter) -> Run:
        """Wrap the model, build optimizer and schedule, restore a checkpoint, and reload the logs up to its step."""
        accelerator = make_accelerator(lm.model.device)
        torch.manual_seed(config.seed)
        model = attach_lora(lm.model.float().to(accelerator.device), config, lm.meta.mask_token_id, init_adapter)
        model.train()
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
        )
        steps = total_steps(len(source.examples), config, accelerator.num_processes)
        scheduler = cosine_schedule(optimizer, steps, config.warmup)  # one step per optimizer step: not prepared
        objective, optimizer = accelerator.prepare(MarsObjective(model, config.ar_weight), optimizer)
        run = cls(lm, config, source, out_dir, model, optimizer, scheduler, steps, accelerator, objective)
        if saved is not None:
            if saved.get("processes", 1) != accelerator.num_processes:  # the stream's offset counts them
                raise ValueError(f"this checkpoint was written by {saved.get('processes', 1)} processes: "
                                 "resume with as many")
            load_trainable_state(model, saved["trainable"])
            optimizer.load_state_dict(saved["optimizer"])
            run.scheduler.load_state_dict(saved["scheduler"])
            set_rng_state(saved["rng"])
            run.step, run.seconds = saved["step"], saved["seconds"]
        run.history = read_history(out_dir / LOSS_LOG, run.step)
        run.val_history = read_history(out_dir / VAL_LOG, run.step, Validation)
        if run.main:
            write_history(out_dir / LOSS_LOG, run.history)  # drops steps logged after the checkpoint
            if (out_dir / VAL_LOG).is_file():
                write_history(out_dir / VAL_LOG, run.val_history)
        logger.info("training %d of %d parameters for %d steps on %d examples", run.trainable_parameters,
                    sum(p.numel() for p in model.parameters()), steps, len(source.examples))
        return run

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    def payload(self) -> dict:
        """What the checkpoint records besides the tensors."""
        src = self.source
        return {
            "step": self.step, "seconds": self.seconds, "config": asdict(self.config), "examples": len(src.examples),
            "digest": examples_digest(src.examples), "base": src.base_spec, "data": src.data_path,
            "init_adapter": src.started_from, "processes": self.processes,
        }

    def checkpoint(self) -> None:
        if not self.main:
            return
        save_checkpoint(self.out_dir / CHECKPOINT, self.model, self.optimizer, self.scheduler, self.payload())
        save_model(self.model, self.lm, self.out_dir, self.source.base_spec, self.config.block_size)
        if self.history:
            plot_losses(self.history, self.out_dir / "loss.png", self.val_history)

    def measure(self) -> None:
        """The held-out figures at this step (once per step), appended to val.jsonl."""
        val = self.source.val_examples
        if not self.main or not val or any(v.step == self.step for v in self.val_history):
            return
        meta = self.lm.meta
        result, = validate(self.model, val, meta.mask_token_id, pad_id(self.lm.tokenizer), self.config.block_size,
                           step=self.step)
        self.val_history.append(result)
        with open(self.out_dir / VAL_LOG, "a") as sink:
            sink.write(json.dumps(asdict(result)) + "\n")
        logger.info("validation at step %d: %s", self.step, asdict(result))

    def train_step(self, batches) -> StepLog:
        """One optimizer step over ``grad_accum`` micro-batches; one host sync; logged to loss.jsonl."""
        config, device = self.config, self.accelerator.device
        started = torch_time()
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(3, device=device)
        for _ in range(config.grad_accum):
            batch = collate([self.source.examples[i] for i in next(batches)], self.lm.meta.mask_token_id,
                            pad_id(self.lm.tokenizer), config.block_size, noisy=config.objective == "mars")
            with cuda_autocast(device):
                losses = self.objective(batch.to(device))  # (loss, noisy_loss, ar_loss)
            self.accelerator.backward(losses[0] / config.grad_accum)
            sums += losses.detach().float() / config.grad_accum
        self.accelerator.clip_grad_norm_(self.params, config.clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.seconds += torch_time() - started
        total, noisy, ar = self.accelerator.gather(sums[None]).mean(dim=0).tolist()  # every process's; one sync
        log = StepLog(self.step, round(total, 5), round(noisy, 5), round(ar, 5), lr, round(self.seconds, 2))
        self.history.append(log)
        if self.main:
            with open(self.out_dir / LOSS_LOG, "a") as sink:
                sink.write(json.dumps(asdict(log)) + "\n")
        return log

    def summary(self) -> dict:
        """training.json: every setting, the data, the hardware, the final losses and held-out figures."""
        config, src, meta = self.config, self.source, self.lm.meta
        summary = describe(config) | {
            "data": src.data_path, "init_adapter": src.started_from, "examples": len(src.examples), "steps": self.step,
            "epochs": round(self.step * config.grad_accum * config.batch_size * self.processes / len(src.examples), 3),
            "wall_seconds": round(self.seconds, 1), "seconds_per_step": round(self.seconds / max(self.step, 1), 3),
            "hardware": self.hardware(), "base": src.base_spec, "mask_token": meta.mask_token,
            "mask_token_id": meta.mask_token_id, "trainable_parameters": self.trainable_parameters,
            "final_loss": _tail_mean(self.history, "loss"), "final_noisy_loss": _tail_mean(self.history, "noisy_loss"),
            "final_ar_loss": _tail_mean(self.history, "ar_loss"),
        }
        if config.objective == "mars":
            summary |= {
                "noisy_stream": "restricted to the blocks holding response tokens",
                "noisy_block_starts": "left out of the loss ((B+1)-ahead targets decoding never reads)",
            }
        else:
            summary |= {"noisy_stream": "none: the AR-SFT baseline"}
        if self.val_history and src.val_examples:
            summary |= {"val_data": src.val_data, "val_examples": len(src.val_examples),
                        "validation": asdict(self.val_history[-1])}
        return summary

    def hardware(self) -> str:
        one = hardware(self.accelerator.device)
        return one if self.processes == 1 else f"{self.processes} processes x {one}"

    def finish(self) -> None:
        """training.json once the run is complete; under ``accelerate launch``, the process group goes down in order.

        Every process waits for the main one's files first: a process that exits with gloo's threads
        still running aborts ("terminate called without an active exception"), and the launcher
        then fails the whole run.
        """
        if self.step == self.steps and self.main:
            (self.out_dir / "training.json").write_text(json.dumps(self.summary(), indent=2) + "\n")
        if self.processes > 1:
            self.accelerator.wait_for_everyone()
            # DDP's wrapper and the prepared optimizer go first, while every process's group is up: left to
            # the end of train()'s frame, the main process's gloo group once waited for a peer that had gone
            self.objective = self.optimizer = None
            self.accelerator.free_memory()
            gc.collect()
            self.accelerator.wait_for_everyone()
            self.accelerator.end_training()

    def result(self) -> TrainResult:
        return TrainResult(self.model, self.history, self.val_history, self.step, self.steps, self.seconds)


def _tail_mean(history: list[StepLog], name: str, count: int = 10) -> float | None:
    tail = [getattr(h, name) for h in history[-count:]]
    return round(sum(tail) / len(tail), 4) if tail else None


def train(
    lm,
    examples: list[Example],
    config: TrainConfig,
    out_dir: str | Path,
    *,
    base_spec: str,
    data_path: str = "",
    init_adapter: str | Path | None = None,
    resume: bool = False,
    val_examples: list[Example] | None = None,
    val_every: int = 100,
    val_data: str = "",
    stop_after: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Fine-tune ``lm`` (a LoadedModel of the base) with the MARS loss and write the outputs to ``out_dir``.

    ``resume`` continues from ``out_dir/checkpoint`` exactly (weights, optimizer, schedule, data order,
    RNG); the checkpoint's settings win. ``val_examples`` are measured by ``validate`` before the first
    step, every ``val_every`` steps and at the end. ``stop_after`` ends early at that step (tests).
    """
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    source = Source(examples, base_spec, data_path, None, val_examples, val_every, val_data)
    config, saved, init_adapter = start_or_resume(out_dir, config, source, resume, init_adapter)
    if not source.examples:
        raise ValueError("no training examples")
    out_dir.mkdir(parents=True, exist_ok=True)
    run = Run.open(lm, config, source, out_dir, saved, init_adapter)
    lengths = [len(ex) for ex in source.examples]
    start = run.step * config.grad_accum * run.processes
    batches = shard(micro_batches(lengths, config.batch_size, config.seed, start=start), run.accelerator)
    if run.step == 0:
        run.measure()  # the starting point
    bar = tqdm(total=run.steps, initial=run.step, desc="train", disable=not (progress and run.main), dynamic_ncols=True)
    try:
        while run.step < run.steps and (stop_after is None or run.step < stop_after):
            log = run.train_step(batches)
            bar.update(1)
            bar.set_postfix(loss=f"{log.loss:.3f}", noisy=f"{log.noisy_loss:.3f}", ar=f"{log.ar_loss:.3f}",
                            lr=f"{log.lr:.2e}")
            if run.step % val_every == 0 or run.step == run.steps:
                run.measure()
            if run.step % config.save_every == 0 or run.step == run.steps:
                run.checkpoint()
    except KeyboardInterrupt:
        logger.warning("interrupted at step %d: saving a checkpoint (continue with --resume)", run.step)
        run.checkpoint()
        raise
    finally:
        bar.close()
    run.finish()
    return run.result()
