"""The MemGraph file format: JSON for the graph, safetensors for the tensors, in one zip archive.

A ``.mg`` file is a zip archive of exactly two members:

- ``graph.json``: ``{"format": "turnip.memgraph", "version": 7, "memgraph": ...}``,
  the MemGraph (with its TaskGraph, Plan and OptimizerSpec) as tagged JSON;
- ``state.safetensors``: every tensor the graph holds (initial states), named
  by number; ``graph.json`` refers to them as ``{"t": "tensor", "v": "<name>"}``.

Loading parses JSON and safetensors and builds only the types named in
`Codec`'s registry (the contract dataclasses and enums) and a fixed list of
torch constants, so a file runs no code of its author: no pickle anywhere.
A file of another version than `VERSION` (7), 6, 5 or 4 (read as 7 in one process, 5 and 4 on one device, 4 without
host updates) is refused,
naming its version; version 1 files were pickles, refused without being opened as one.

Tagged JSON: JSON scalars (str, int, bool, null, finite float) and arrays
(Python lists) stand for themselves; everything else is an object
``{"t": tag, "v": payload}``: tuple, dict (str keys; "map" for other keys, as
[key, value] pairs), set, frozenset, non-finite float, complex, torch.Size,
torch.dtype/device/layout/memory_format, the torch.fx immutable containers the
tracer leaves in templates, a pytree TreeSpec (``treespec_dumps``), a tensor,
or a registered dataclass or enum by class name.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
import os
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch.fx.immutable_collections import immutable_dict, immutable_list

FORMAT = "turnip.memgraph"
# 1 was a pickle, which loading refuses: it could run code; 2 the first zip of JSON and safetensors;
# 3 added MemGraph.segments, TaskGraph.batch_constants, OptimizerSpec.params and Plan.release_after;
# 4 added TaskGraph.accumulation_steps; 5 Plan.host_update and .resident (and Stream "host"). A file of version 4
# reads as one of 5 with no host updates (ADDED_FIELDS); 6 added the devices of TaskGraph, Vertex and Value (a file of
# 4 or 5 is one device's); 7 the rank of TaskGraph and their count (a file of 4 to 6 is one process's); other versions
# are read only by their turnip.
VERSION = 7
ADDED_FIELDS = {"Plan": {"host_update": 5, "resident": 5}, "TaskGraph": {"devices": 6, "rank": 7, "ranks": 7},
                "Vertex": {"device": 6},
                "Value": {"device": 6}}  # class -> field -> the version that added it (it has a default)
GRAPH_MEMBER = "graph.json"
STATE_MEMBER = "state.safetensors"

# torch constants a template may hold, by the name torch exports them under
_TORCH_CONSTANTS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


class Unencodable(TypeError):
    """A value of a type the format does not hold, with its path in the saved object and the
    TaskGraph vertex whose template holds it (if one does)."""

    def __init__(self, obj: Any):
        super().__init__()
        self.obj = obj
        self.where: list[str] = []  # path parts, innermost first
        self.vertex: tuple[int, str] | None = None

    def __str__(self) -> str:
        cls = type(self.obj)
        path = "".join(reversed(self.where)) or "the top"
        vertex = f" (TaskGraph vertex {self.vertex[0]}, {self.vertex[1]})" if self.vertex else ""
        return (f"cannot save a {cls.__module__}.{cls.__qualname__} ({_short_repr(self.obj)}) at {path}{vertex}: "
                f"a MemGraph file holds only plain data (None, bool, int, float, str, list, tuple, dict, set, "
                f"torch dtype/device/layout/memory_format/Size, tensors, pytree TreeSpecs and turnip's "
                f"contract dataclasses and enums)")


def _short_repr(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


class Codec:
    """Encodes objects to tagged JSON (collecting tensors by name) and decodes them back.

    ``types`` are the dataclasses and enums a file may name: decoding builds
    nothing else, so the registry is what keeps loading free of code.
    """

    def __init__(self, types: Iterable[type], version: int = VERSION):
        self.version = version  # of the file decoded: fields added since then take their defaults
        self.types: dict[str, type] = {}
        for cls in types:
            if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
                raise TypeError(f"{cls.__name__} is neither a dataclass nor an enum")
            if self.types.setdefault(cls.__name__, cls) is not cls:
                raise ValueError(f"two registered types are named {cls.__name__}")
        self.tensors: dict[str, torch.Tensor] = {}
        self._tensor_names: dict[int, str] = {}  # id(tensor) -> name: a tensor held twice is stored once
        self._held: list[torch.Tensor] = []  # keeps ids above from being reused while encoding
        self._storages: set[int] = set()
        self._decoded: dict[tuple, torch.Tensor] = {}

    # -- encoding --------------------------------------------------------------------
    def encode(self, obj: Any) -> Any:
        if obj is None or type(obj) in (str, int, bool):
            return obj
        if type(obj) is float:
            return obj if math.isfinite(obj) else {"t": "float", "v": repr(obj)}  # JSON has no inf/nan
        if type(obj) is list:
            return [self._item(x, i) for i, x in enumerate(obj)]
        if type(obj) is tuple:
            return {"t": "tuple", "v": [self._item(x, i) for i, x in enumerate(obj)]}
        if type(obj) is dict:
            return self._dict(obj, "dict")
        if isinstance(obj, enum.Enum):  # before str: the contract enums are str enums
            self._registered(obj)
            return {"t": type(obj).__name__, "v": self.encode(obj.value)}
        if isinstance(obj, pytree.TreeSpec):  # before dataclasses: TreeSpec is one
            try:
                return {"t": "treespec", "v": pytree.treespec_dumps(obj)}
            except Exception as exc:  # a pytree node type registered without a serialized name
                raise Unencodable(obj) from exc
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return self._dataclass(obj)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, torch.Size):
            return {"t": "size", "v": [int(x) for x in obj]}
        if isinstance(obj, torch.device):
            return {"t": "device", "v": str(obj)}
        for tag, cls in _TORCH_CONSTANTS.items():
            if isinstance(obj, cls):
                name = str(obj).removeprefix("torch.")
                if getattr(torch, name, None) is not obj:
                    raise Unencodable(obj)
                return {"t": tag, "v": name}
        if isinstance(obj, immutable_list):
            return {"t": "immutable_list", "v": [self._item(x, i) for i, x in enumerate(obj)]}
        if isinstance(obj, immutable_dict):
            return self._dict(obj, "immutable_dict")
        if isinstance(obj, (set, frozenset)) and type(obj) in (set, frozenset):
            items = sorted(obj) if all(type(x) is int for x in obj) else list(obj)  # stable files
            return {"t": type(obj).__name__, "v": [self.encode(x) for x in items]}
        # numbers of other libraries (numpy scalars in planner stats) are saved as Python numbers
        if isinstance(obj, numbers.Integral) and not isinstance(obj, bool):
            return int(obj)
        if isinstance(obj, numbers.Real):
            return self.encode(float(obj))
        if isinstance(obj, numbers.Complex):
            z = complex(obj)
            return {"t": "complex", "v": [self.encode(z.real), self.encode(z.imag)]}
        raise Unencodable(obj)

    def _item(self, obj: Any, index: int) -> Any:
        try:
            return self.encode(obj)
        except Unencodable as exc:
            exc.where.append(f"[{index}]")
            raise

    def _dict(self, obj: dict, tag: str) -> dict:
        out = {}
        if all(type(k) is str for k in obj):
            for k, v in obj.items():
                try:
                    out[k] = self.encode(v)
                except Unencodable as exc:
                    exc.where.append(f"[{k!r}]")
                    raise
            return {"t": tag, "v": out}
        pairs = []
        for k, v in obj.items():
            try:
                pairs.append([self.encode(k), self.encode(v)])
            except Unencodable as exc:
                exc.where.append(f"[{_short_repr(k)}]")
                raise
        return {"t": "map" if tag == "dict" else "immutable_map", "v": pairs}

    def _dataclass(self, obj: Any) -> dict:
        self._registered(obj)
        out = {}
        for f in dataclasses.fields(obj):
            try:
                out[f.name] = self.encode(getattr(obj, f.name))
            except Unencodable as exc:
                exc.where.append(f".{f.name}")
                if exc.vertex is None and hasattr(obj, "op") and hasattr(obj, "id"):
                    exc.vertex = (obj.id, obj.op)  # a TaskGraph vertex: its op says more than its index
                raise
        return {"t": type(obj).__name__, "v": out}

    def _registered(self, obj: Any) -> None:
        if self.types.get(type(obj).__name__) is not type(obj):
            raise Unencodable(obj)

    def _tensor(self, t: torch.Tensor) -> dict:
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise Unencodable(t)
        name = self._tensor_names.get(id(t))
        tag: dict[str, Any] = {"t": "tensor"}
        if not t.is_contiguous():
            # stored as the span of storage it covers, viewed again on load: exact strides, overlaps included
            tag["size"], tag["stride"] = list(t.shape), list(t.stride())
        if name is None:
            name = self._tensor_names[id(t)] = str(len(self.tensors))
            self._held.append(t)
            data = t.detach().to("cpu")  # initial states are CPU tensors; a GPU one is copied
            if not data.is_contiguous():
                span = 1 + sum((n - 1) * s for n, s in zip(data.shape, data.stride())) if data.numel() else 0
                data = data.as_strided((span,), (1,), data.storage_offset())
            ptr = data.untyped_storage().data_ptr()
            if ptr in self._storages:  # safetensors refuses tensors sharing memory; give this one its own
                data = data.clone()
            self._storages.add(data.untyped_storage().data_ptr())
            self.tensors[name] = data
        tag["v"] = name
        return tag

    # -- decoding ------------------------------------------------------------------------
    def decode(self, doc: Any, tensors: dict[str, torch.Tensor]) -> Any:
        if doc is None or type(doc) in (str, int, bool, float):
            return doc
        if type(doc) is list:
            return [self.decode(x, tensors) for x in doc]
        if type(doc) is not dict or set(doc) - {"t", "v", "size", "stride"} or "t" not in doc:
            raise ValueError(f"unexpected JSON {_short_repr(doc)}")
        tag, v = doc["t"], doc.get("v")
        if tag == "tuple":
            return tuple(self.decode(x, tensors) for x in v)
        if tag in ("dict", "immutable_dict"):
            out = {k: self.decode(x, tensors) for k, x in v.items()}
            return out if tag == "dict" else immutable_dict(out)
        if tag in ("map", "immutable_map"):
            out = {self.decode(k, tensors): self.decode(x, tensors) for k, x in v}
            return out if tag == "map" else immutable_dict(out)
        if tag == "immutable_list":
            return immutable_list(self.decode(x, tensors) for x in v)
        if tag == "set":
            return {self.decode(x, tensors) for x in v}
        if tag == "frozenset":
            return frozenset(self.decode(x, tensors) for x in v)
        if tag == "float":
            if v not in ("inf", "-inf", "nan"):
                raise ValueError(f"bad float {v!r}")
            return float(v)
        if tag == "complex":
            return complex(*(self.decode(x, tensors) for x in v))
        if tag == "size":
            return torch.Size(int(x) for x in v)
        if tag == "device":
            return torch.device(v)
        if tag in _TORCH_CONSTANTS:
            obj = getattr(torch, v, None) if type(v) is str else None
            if not isinstance(obj, _TORCH_CONSTANTS[tag]):
                raise ValueError(f"torch.{v} is not a {tag}")
            return obj
        if tag == "treespec":
            return pytree.treespec_loads(v)  # JSON; builds only pytree types registered by name
        if tag == "tensor":
            return self._decode_tensor(doc, tensors)
        cls = self.types.get(tag)
        if cls is None:
            raise ValueError(f"unknown type {tag!r}")
        if issubclass(cls, enum.Enum):
            return cls(self.decode(v, tensors))
        if type(v) is not dict:
            raise ValueError(f"{tag} holds {_short_repr(v)}, not its fields")
        added = ADDED_FIELDS.get(tag, {})
        names = {f.name for f in dataclasses.fields(cls) if f.init and added.get(f.name, 0) <= self.version}
        if set(v) != names:
            raise ValueError(f"{tag} has fields {sorted(v)}, expected {sorted(names)}")
        return cls(**{k: self.decode(x, tensors) for k, x in v.items()})

    def _decode_tensor(self, doc: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        name = doc["v"]
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is not in {STATE_MEMBER}")
        key = (name, tuple(doc.get("size", ())), tuple(doc.get("stride", ())))
        if key not in self._decoded:
            t = tensors[name]
            if "size" in doc:
                size, stride = tuple(doc["size"]), tuple(doc["stride"])
                need = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if 0 not in size else 0
                if t.dim() != 1 or t.numel() < need:
                    raise ValueError(f"tensor {name!r} has {tuple(t.shape)} elements, its view needs {need}")
                t = t.as_strided(size, stride, 0)
            self._decoded[key] = t
        return self._decoded[key]


def save(obj: Any, path: str | Path, types: Iterable[type]) -> None:
    """Write obj to path as a MemGraph file of format version `VERSION`; raises Unencodable (a
    TypeError) before writing anything."""
    codec = Codec(types)
    try:
        doc = {"format": FORMAT, "version": VERSION, "memgraph": codec.encode(obj)}
    except Unencodable as exc:
        exc.where.append(type(obj).__name__)
        raise
    graph = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    state = save_tensors(codec.tensors, metadata={"format": FORMAT, "version": str(VERSION)})
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")  # a failed write never leaves half a file at path
    with zipfile.ZipFile(tmp, "w") as zf:
        zf.writestr(GRAPH_MEMBER, graph, compress_type=zipfile.ZIP_DEFLATED)
        zf.writestr(STATE_MEMBER, state, compress_type=zipfile.ZIP_STORED)  # weights barely compress
    os.replace(tmp, path)


def load(path: str | Path, types: Iterable[type]) -> Any:
    """Read a MemGraph file of format version `VERSION` written by `save`; ValueError naming path
    and the problem otherwise (another format, another version, a damaged or corrupted file)."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a turnip MemGraph file (not a zip archive; files saved before format "
                         f"version 2 were pickles, which are refused because loading one could run "
                         f"code: compile the model and save it again)")
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if sorted(names) != sorted([GRAPH_MEMBER, STATE_MEMBER]):
                raise ValueError(f"{path} is not a turnip MemGraph file: it holds members {names}, "
                                 f"a MemGraph file exactly {[GRAPH_MEMBER, STATE_MEMBER]}")
            graph = zf.read(GRAPH_MEMBER)
            state = zf.read(STATE_MEMBER)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as exc:
        raise ValueError(f"{path}: damaged MemGraph file ({type(exc).__name__}: {exc})") from exc
    try:
        doc = json.loads(graph)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: {GRAPH_MEMBER} is not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise ValueError(f"{path} is not a turnip MemGraph file: format {found!r}, expected {FORMAT!r}")
    if doc.get("version") not in (4, 5, 6, VERSION):
        raise ValueError(f"{path} has MemGraph format version {doc.get('version')!r}, this turnip reads 4 to {VERSION}")
    try:
        tensors = load_tensors(state)
    except Exception as exc:  # safetensors reports a bad header in its own error types
        raise ValueError(f"{path}: {STATE_MEMBER} is not a valid safetensors file ({exc})") from exc
    try:
        return Codec(types, doc["version"]).decode(doc.get("memgraph"), tensors)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"{path}: corrupted MemGraph file ({type(exc).__name__}: {exc})") from exc

