"""A warm start: a local checkpoint put on its compute path from its stored conversion, with no fp32 weights read
and nothing converted.

The first load on a path converts as always (backends/cpu/paths.py ``select``) and stores the result
(``store``); later loads read the cost table's choice (``paths.from_table``), build the model's skeleton on
the meta device and fill it from the stored file (``backends/cpu/stored.py``), bit for bit the conversion.
Anything missing or unfit (no table entry, no smoothing ranges known, no file, a file that does not read or
fit) sends the load down the converting path, with one logged line where a file was there but unusable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel

from .. import progress
from ..backends.cpu import stored
from ..backends.cpu.calibration import ranges_file, shipped_ranges
from ..backends.cpu.paths import ComputePath, checked_curve, curve_widths, from_table, model_key, table_key
from ..machine import cache_dir

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("*.safetensors", "*.bin")
_writers: list[threading.Thread] = []  # store's threads not yet waited for


def source(directory: str) -> str:
    """What names a local checkpoint's fp32 weights: its path, config, and weight files' sizes and change times
    (a checkpoint saved again, like the merged adapter's cache, gets new times)."""
    folder = Path(directory).resolve()
    config = folder / "config.json"
    parts = [str(folder), config.read_text() if config.is_file() else ""]
    for pattern in WEIGHT_FILES:
        for file in sorted(folder.glob(pattern)):
            seen = file.stat()
            parts.append(f"{file.name}:{seen.st_size}:{seen.st_mtime_ns}")
    return "\n".join(parts)


def skeleton(directory: str, config: PretrainedConfig, trust_remote_code: bool = False) -> PreTrainedModel:
    """The checkpoint's fp32 model with every tensor on the meta device: its modules, no weights, no allocation."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.config._name_or_path = directory  # as from_pretrained names it: the cost table's and the ranges' key
    if Path(directory, "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


def smoothing_inputs(model: PreTrainedModel) -> tuple[str, dict | None]:
    """Where int8dyn's ranges for the fp32 ``model`` (or its skeleton) come from: its model_key (the cached
    measurement's name) and the shipped ranges. Taken before converting: a converted model has other parameters."""
    return model_key(model), shipped_ranges(model)


def known_ranges(inputs: tuple[str, dict | None]) -> dict | None:
    """The ranges ``calibration.smoothing_ranges`` reads or has read, without measuring: cached, else shipped,
    else None."""
    key, shipped = inputs
    try:
        return load_file(ranges_file(key, cache_dir()))
    except (OSError, ValueError, SafetensorError):
        return shipped


def _entry(directory: str, path: str, inputs: tuple[str, dict | None]) -> tuple[Path, dict | None] | None:
    ranges = known_ranges(inputs) if path == "int8dyn" else None
    if path == "fp32" or (path == "int8dyn" and ranges is None):
        return None  # nothing converted, or ranges not known without measuring
    return stored.entry(cache_dir(), source(directory), Path(directory).name, path, ranges), ranges


def load(
    directory: str, config: PretrainedConfig, precision: str, *, block_size: int, rows: int,
    rate: Callable[[dict[int, float], int], float], trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, ComputePath] | None:
    """The checkpoint in ``directory`` on the path the cached table chooses, from its stored conversion; None
    where there is none to use (module docstring)."""
    try:
        model = skeleton(directory, config, trust_remote_code)
    except (ValueError, TypeError, OSError, ImportError) as error:  # the converting path says why, if it fails too
        logger.info("no skeleton of %s on the meta device (%s): converting", directory, error)
        return None
    compute = from_table(model, precision, block_size=block_size, table_dir=cache_dir(), rows=rows, rate=rate)
    found = None if compute is None else _entry(directory, compute.path, smoothing_inputs(model))
    if found is None or not found[0].is_file():
        return None
    file, ranges = found
    key = table_key(model, curve_widths(block_size))  # the skeleton's, as the table has it
    progress.report(f"putting the model on {compute.path} (stored conversion)")
    try:
        model = stored.rebuild(model, compute.path, ranges, file)
    except (stored.StoredError, OSError, RuntimeError, ValueError, SafetensorError) as error:
        logger.warning("stored conversion %s unusable (%s): converting again", file.name, error)
        return None
    return model, checked_curve(model, compute, key, curve_widths(block_size), cache_dir())


def store(model: PreTrainedModel, compute: ComputePath, directory: str, inputs: tuple[str, dict | None]) -> None:
    """Keep ``model``, just converted to ``compute.path``, for the next start (``inputs``: ``smoothing_inputs`` of
    it before converting).

    Written by a thread, so that the first start's model is ready meanwhile: it only reads the tensors, which
    no one writes after the conversion, and the process waits for it at exit (not a daemon). ``wait_stored``
    waits for it sooner.
    """
    found = _entry(directory, compute.path, inputs)
    if found is not None and stored.storable(model):
        writer = threading.Thread(target=stored.save, args=(model, found[0]), name="store the conversion")
        _writers.append(writer)
        writer.start()


def wait_stored() -> None:
    """Wait until the conversions being stored are written (tests, and a load timed right after another)."""
    while _writers:
        _writers.pop().join()
