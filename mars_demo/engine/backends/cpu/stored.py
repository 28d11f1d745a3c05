"""A model converted to a compute path, kept on disk and rebuilt without converting it again.

Putting the model on a path (quant.py: folding the smoothing, quantising, packing) is the largest part of a
warm start. ``save`` writes every tensor the converted model holds: parameters, buffers (non-persistent ones
too) and the native kernel's packed weights (``int8gemm.Weights``). ``rebuild`` runs the same ``convert`` on
the model's skeleton on the meta device, which gives the converted modules without any arithmetic, and fills
their tensors from the file: the rebuilt model is the converted one bit for bit, and a file that does not fit
the skeleton (a tensor missing, left over, of another shape or dtype) is refused whole (``StoredError``).

An entry is named by everything its bits depend on (``entry``): the source weights, the path, the smoothing
ranges, this conversion code and the kernels' packing (quant.py's and int8gemm.py's text), torch and
transformers, the CPU, and whether the native kernel runs. fbgemm's packed weights (no native kernel) are not
stored: ``storable`` says so and the model converts as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from ...machine import cpu_features, cpu_model
from . import int8gemm, quant
from .quant import RowInt8Linear, convert

logger = logging.getLogger(__name__)

FORMAT = 1  # bumped when what ``save`` writes changes
FOLDER = "converted"
STALE_SECONDS = 3600  # a staging file this old has no writer left
KERNEL_TENSORS = ("packed", "sums", "scales", "bias")  # int8gemm.Weights' tensors
ALIGNMENT = 64  # bytes: where the kernels may expect a tensor to start (torch's allocator aligns to this)
_CODE = (Path(quant.__file__), Path(int8gemm.__file__))  # the conversion and the packing: their text keys entries


class StoredError(ValueError):
    """A stored conversion that does not fit the model it should rebuild; the message says where."""


def _holders(model: nn.Module) -> list[tuple[str, object, str, torch.Tensor]]:
    """Every tensor ``model`` holds: (name, holder, key, tensor); the holder is a module's parameter or buffer
    dict, or an ``int8gemm.Weights`` (key: its attribute)."""
    found = []
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for table in (module._parameters, module._buffers):
            found += [(dot + key, table, key, t) for key, t in table.items() if t is not None]
        weights = getattr(module, "weights", None)
        if isinstance(weights, int8gemm.Weights):
            for key in KERNEL_TENSORS:
                if getattr(weights, key) is not None:
                    found.append((f"{dot}weights.{key}", weights, key, getattr(weights, key)))
    return found


def _put(holder: object, key: str, tensor: torch.Tensor) -> None:
    if isinstance(holder, dict):
        holder[key] = tensor
    else:
        setattr(holder, key, tensor)


def storable(model: PreTrainedModel) -> bool:
    """Whether ``save`` can write ``model``: no fbgemm-packed linear (a script object, not a tensor)."""
    return not any(isinstance(m, RowInt8Linear) and m.packed is not None for m in model.modules())


def entry(where: Path, source: str, name: str, path: str, ranges: dict[str, torch.Tensor] | None) -> Path:
    """The file of ``source`` (what identifies the fp32 weights) converted to ``path`` with ``ranges``."""
    digest = hashlib.sha256()
    for part in (f"format={FORMAT}", source, path, f"torch={torch.__version__}",
                 f"transformers={transformers.__version__}", cpu_model(), cpu_features(),
                 f"native={int8gemm.kernel() is not None}", *(code.read_text() for code in _CODE)):
        digest.update(part.encode() + b"\0")
    for key in sorted(ranges or {}):
        digest.update(key.encode() + b"\0" + ranges[key].float().contiguous().numpy().tobytes())
    return where / FOLDER / f"{name}-{path}-{digest.hexdigest()[:16]}.safetensors"


def save(model: PreTrainedModel, file: Path) -> bool:
    """Write ``model``'s tensors to ``file`` (atomically; older entries of the same name and path go); False and
    one logged line where it cannot be written."""
    names: dict[int, str] = {}
    tensors, aliases = {}, {}
    for name, _, _, tensor in _holders(model):
        first = names.setdefault(id(tensor), name)
        if first != name:
            aliases[name] = first  # one tensor held twice (a linear's bias is also its kernel's)
        else:
            tensors[name] = tensor.detach().contiguous()
    file.parent.mkdir(parents=True, exist_ok=True)
    for stale in file.parent.glob("*.tmp*"):  # a writer that died (a process killed while it wrote)
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > STALE_SECONDS:
                stale.unlink()
    staging = file.with_name(file.name + f".tmp{os.getpid()}")
    try:
        save_file(tensors, staging, metadata={"format": str(FORMAT), "aliases": json.dumps(aliases)})
        staging.replace(file)
    except (OSError, RuntimeError, ValueError, SafetensorError) as error:
        staging.unlink(missing_ok=True)
        logger.warning("could not store the converted model in %s (%s): it converts again next start", file, error)
        return False
    prefix = file.name.rsplit("-", 1)[0] + "-"
    for old in file.parent.glob(prefix + "*.safetensors"):
        if old != file and old.name.rsplit("-", 1)[0] + "-" == prefix:
            old.unlink(missing_ok=True)
    return True


def _read(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(file, "pt") as stored:
        meta = stored.metadata() or {}
        if meta.get("format") != str(FORMAT):
            raise StoredError(f"format {meta.get('format')}, not {FORMAT}")
        names = stored.keys()  # a safe_open handle has no iteration of its own
        # A tensor backed by the file's mapping sits wherever the file's header puts it (8-byte aligned): torch's int8
        # weight-only GEMM (int8's path) crashed on such weights, so a tensor off a 64-byte boundary is copied out
        # (torch's own allocations are aligned). An entry is only ever replaced by a rename, never written in place.
        tensors = {name: _aligned(stored.get_tensor(name)) for name in names}
        return tensors, json.loads(meta.get("aliases", "{}"))


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Replace every (meta) tensor of ``model`` with its stored one, checked against the skeleton's."""
    new: dict[int, torch.Tensor] = {}
    used = set()
    for name, holder, key, old in _holders(model):
        if id(old) not in new:
            stored = tensors.get(aliases.get(name, name))
            if stored is None or stored.shape != old.shape or stored.dtype != old.dtype:
                seen = "missing" if stored is None else f"{tuple(stored.shape)} {stored.dtype}"
                raise StoredError(f"{name}: {seen}, the model needs {tuple(old.shape)} {old.dtype}")
            used.add(aliases.get(name, name))
            new[id(old)] = nn.Parameter(stored, old.requires_grad) if isinstance(old, nn.Parameter) else stored
        _put(holder, key, new[id(old)])
    if used != set(tensors):
        raise StoredError(f"tensors the model does not hold: {', '.join(sorted(set(tensors) - used)[:3])}")


def rebuild(
    skeleton: PreTrainedModel, path: str, ranges: dict[str, torch.Tensor] | None, file: Path,
) -> PreTrainedModel:
    """``skeleton`` (the fp32 model's modules on the meta device) converted to ``path`` and filled from ``file``.

    Raises StoredError, OSError or SafetensorError where the file cannot be read or does not fit.
    """
    with torch.device("meta"):  # the structure only: every tensor the conversion makes is on meta
        convert(skeleton, path, ranges={k: torch.empty_like(r, device="meta") for k, r in (ranges or {}).items()})
    tensors, aliases = _read(file)
    _fill(skeleton, tensors, aliases)
    return skeleton


def tensors_of(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor ``save`` writes, aliases included (for tests)."""
    for name, _, _, tensor in _holders(model):
        yield name, tensor
