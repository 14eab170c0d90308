"""Typed msgpack encoding for everything that crosses a process boundary; never pickle.

A pickle stream is a program: whoever can write one into a process runs code in it. A
msgpack message is data, and ``decode(data, T)`` builds only ``T`` and the types ``T``
declares (msgspec checks every field), so a forged message can at worst fail to decode.

What encodes, and how it comes back:

* ints, floats, str, bytes, lists, tuples, dicts, enums, ``None``, ``msgspec.Struct``s and
  dataclasses (``SchedulerOutput``, ``EngineConfig``, ...): natively, by declared field types;
  a dataclass's ``__post_init__`` runs on decode, so its validation runs on the receiving side;
* pydantic models: ``model_dump()`` on the way out, ``model_validate()`` into the declared
  class on the way in (validation runs again on the receiving side);
* ``torch.Tensor``: a msgpack extension holding dtype, shape and the raw bytes, so bulk
  data costs one copy each way, and a tensor comes back even where a field says ``Any``;
* a ``ModelConfig`` is not sent as itself: its transformers config is a class with code
  (and, in transformers 5, a dataclass whose native encoding is not its serialization),
  so it travels as ``tandem.ipc.configs.WireModelConfig``.

Anything else raises ``TypeError`` on encode, so an unsupported object is found by the
sender, not guessed at by the receiver.
"""
from __future__ import annotations

import functools
import struct
import sys
from typing import Any, TypeVar, cast

import msgspec

__all__ = ["encode", "decode", "DecodeError"]

T = TypeVar("T")

DecodeError = msgspec.DecodeError  # also raised (as its subclass ValidationError) for a wrong type

_EXT_TENSOR = 1
_HEADER_LEN = struct.Struct("<I")


def _is_pydantic_model(obj_or_type: Any) -> bool:
    """Without importing pydantic: if nobody imported it, nothing can be one of its models."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is None:
        return False
    if isinstance(obj_or_type, type):
        return issubclass(obj_or_type, pydantic.BaseModel)
    return isinstance(obj_or_type, pydantic.BaseModel)


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _encode_tensor(t: Any) -> msgspec.msgpack.Ext:
    import torch

    t = t.detach().to("cpu").contiguous()
    header = _ENCODER.encode((str(t.dtype).removeprefix("torch."), list(t.shape)))
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return msgspec.msgpack.Ext(_EXT_TENSOR, _HEADER_LEN.pack(len(header)) + header + raw.tobytes())


def _decode_tensor(data: memoryview) -> Any:
    import torch

    (n,) = _HEADER_LEN.unpack_from(data)
    dtype_name, shape = msgspec.msgpack.decode(data[_HEADER_LEN.size:_HEADER_LEN.size + n],
                                               type=tuple[str, list[int]])
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise msgspec.ValidationError(f"not a torch dtype: {dtype_name!r}")
    raw = data[_HEADER_LEN.size + n:]
    if len(raw) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _enc_hook(obj: Any) -> Any:
    if _is_tensor(obj):
        return _encode_tensor(obj)
    if _is_pydantic_model(obj):
        return obj.model_dump()
    raise TypeError(f"{type(obj).__module__}.{type(obj).__qualname__} cannot cross a process boundary "
                    "(tandem.ipc.codec encodes plain data, dataclasses, structs, pydantic models and tensors)")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_TENSOR:
        return _decode_tensor(data)
    raise msgspec.ValidationError(f"unknown msgpack extension type {code}")


def _dec_hook(tp: Any, obj: Any) -> Any:
    if isinstance(tp, type) and isinstance(obj, tp):  # a tensor built by _ext_hook
        return obj
    if _is_pydantic_model(tp):
        return tp.model_validate(obj)
    raise NotImplementedError(f"cannot decode {type(obj).__name__} into {tp!r}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(obj: Any) -> bytes:
    """One message as msgpack bytes (see the module docstring for what may be in it)."""
    return _ENCODER.encode(obj)


@functools.lru_cache(maxsize=256)
def _decoder(tp: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(tp, dec_hook=_dec_hook, ext_hook=_ext_hook)


def decode(data: bytes | memoryview | msgspec.Raw, tp: type[T] | Any = Any) -> T:
    """Decode ``data`` into ``tp`` (a class, a ``typing`` form such as ``Optional[X]``, or
    ``Any`` for plain data); raises ``DecodeError``/``msgspec.ValidationError`` when the
    bytes are not a ``tp``."""
    return _decoder(cast(Any, tp)).decode(data)
