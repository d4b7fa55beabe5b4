"""Read a pickled checkpoint of someone else's code (the paper's Lightning `.ckpt`) without running
any code from it.

A pickle names the functions and classes that rebuild its objects, and the unpickler calls them:
whoever wrote the file chooses what runs. Here every name goes through one allowlist:
- torch's rebuild functions of plain tensors and parameters, dtypes, `torch.Size` and
  `torch.device` (torch's loader resolves the storage types itself), builtin containers and
  `collections.OrderedDict`/`defaultdict`, which only build data;
- the classes a Lightning checkpoint of the paper's trainer holds in `hyper_parameters`: omegaconf
  containers and nodes, `typing.Any`, Lightning's `AttributeDict`, the run's tokenizer (the paper's
  `dataloader` classes with their SentencePiece or tiktoken object, or a transformers/tokenizers
  one). They become inert placeholders that only keep the pickled arguments and state, so the
  real classes' code never runs, and they need not be installed.
Any other name is refused before its object is built, with a `RefusedGlobal` naming it. TorchScript
archives (which torch.load hands to torch.jit.load) and pre-1.0 tar archives are refused unread.
"""
from __future__ import annotations

import _codecs
import _compat_pickle
import builtins
import collections
import pickle
import tarfile
import types
import zipfile

import torch

from megatron_dllm.errors import InputError


class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


class Placeholder:
    """Stands for an object whose real class never runs here: keeps its constructor arguments and
    pickled state (`__setstate__`), and the items a dict or list subclass appends."""

    def __init__(self, *args, **kwargs):
        self.__dict__["_args"] = args

    def __setstate__(self, state):
        self.__dict__["_state"] = state

    def __setitem__(self, key, value):
        self.__dict__.setdefault("_items", {})[key] = value

    def append(self, value):
        self.__dict__.setdefault("_list", []).append(value)

    def extend(self, values):
        self.__dict__.setdefault("_list", []).extend(values)


class AttributeDict(dict):
    """Lightning's AttributeDict (a dict whose keys are also attributes), as the plain dict it holds."""


# Plain tensors and parameters only: the rebuilds that also set attributes or a subclass
# (`_rebuild_parameter_with_state`, `_rebuild_from_type_v2`) are left out.
_TORCH_OBJECTS = ("_utils._rebuild_tensor", "_utils._rebuild_tensor_v2", "_utils._rebuild_tensor_v3",
                  "_utils._rebuild_parameter", "Size", "device")
_BUILTINS = ("dict", "list", "tuple", "set", "frozenset", "bytearray", "bytes", "str", "int", "float", "bool",
             "complex", "slice", "range")


def _torch_object(path: str):
    value = torch
    for part in path.split("."):
        value = getattr(value, part)
    return value


_ALLOWED = {("builtins", name): getattr(builtins, name) for name in _BUILTINS}
_ALLOWED.update({("torch." + path).rpartition(".")[0::2]: _torch_object(path) for path in _TORCH_OBJECTS})
_ALLOWED.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
_ALLOWED.update({("collections", "OrderedDict"): collections.OrderedDict,
                 ("collections", "defaultdict"): collections.defaultdict,
                 ("_codecs", "encode"): _codecs.encode})  # pickle protocol 2 writes bytes as encode(str, latin1)

_ATTRIBUTE_DICTS = {"lightning.fabric.utilities.data", "lightning_fabric.utilities.data",
                    "lightning.pytorch.utilities.parsing", "pytorch_lightning.utilities.parsing"}
_PLACEHOLDER_MODULES = ("omegaconf", "transformers", "tokenizers")  # configs and the run's tokenizer
# the paper's own tokenizers (its dataloader.py, which Lightning's save_hyperparameters pickles) and what
# they hold: SentencePiece's processor, tiktoken's encoding
_PLACEHOLDER_CLASSES = {("dataloader", "TinyLLamaTokenizer"), ("dataloader", "CustomTikTokenizer"),
                        ("sentencepiece", "SentencePieceProcessor"), ("tiktoken.core", "Encoding")}
_placeholders: dict = {}


def _placeholder(module: str, name: str) -> type:
    key = (module, name)
    if key not in _placeholders:
        _placeholders[key] = type(name, (Placeholder,), {"__module__": "placeholder." + module})
    return _placeholders[key]


def resolve(module: str, name: str):
    """What the name `module.name` in a pickle stands for here, or RefusedGlobal."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))  # protocol 2's py2 names
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    if (module, name) in _ALLOWED:
        return _ALLOWED[(module, name)]
    if module in _ATTRIBUTE_DICTS and name == "AttributeDict":
        return AttributeDict
    if ((module, name) == ("typing", "Any") or (module, name) in _PLACEHOLDER_CLASSES
            or module.split(".")[0] in _PLACEHOLDER_MODULES):
        return _placeholder(module, name)
    raise RefusedGlobal(module, name)


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return resolve(module, name)


def load_pickle(file, **kwargs):
    """pickle.load through the allowlist (also the `load` torch.load calls for the legacy format's
    header records)."""
    return RestrictedUnpickler(file, **kwargs).load()


# What torch.load uses as its pickle module: the legacy format calls `load`, both formats subclass
# `Unpickler` (their find_class resolves storage types, then defers to ours).
restricted_pickle = types.SimpleNamespace(Unpickler=RestrictedUnpickler, load=load_pickle, __name__="pickle")


def torch_load(path: str, label: str):
    """torch.load of a zip-format, legacy-format or plain-pickle file through the allowlist, on the
    CPU (zip files memory-mapped: unused tensors are never read). Raises ValueError naming `label`
    (e.g. "--ref FILE") and, for a refused name, the name."""
    is_zip = zipfile.is_zipfile(path)
    if is_zip:
        with zipfile.ZipFile(path) as archive:
            if any(n.rsplit("/", 1)[-1] == "constants.pkl" for n in archive.namelist()):
                raise InputError(f"{label}: a TorchScript archive, which is never loaded (torch.load would run "
                                 f"its code through torch.jit.load); expected a torch.save checkpoint")
    elif tarfile.is_tarfile(path):
        raise InputError(f"{label}: a tar archive (torch's pre-1.0 format), which is not read")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=restricted_pickle,
                          mmap=is_zip)
    except RefusedGlobal as err:
        raise InputError(f"{label}: refuses to load global '{err.module}.{err.name}' (only tensors, containers "
                         f"and the paper's config and tokenizer classes, as inert data, are unpickled)") from None
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, zipfile.BadZipFile) as err:
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise InputError(f"{label}: not a readable PyTorch checkpoint ({why})") from None
