"""Pretrained weights for a job's first step (``model.init_from``): a state dict file, a Lightning
``.ckpt``, ``.safetensors``, or a checkpoint of another of our jobs, local or on S3.

A tenant's file is data, never code: pickles load with ``torch.load(weights_only=True)``, which
refuses anything but tensors and plain containers. What is loaded must fit the model exactly;
a mismatch is an error that names every missing and unexpected key and every shape that differs.
Only rank 0 loads, at step 0: DDP's construction broadcasts rank 0's parameters to the others,
and a resume always starts from the job's own checkpoint instead.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import pyarrow.fs as pafs

from cluster.storage import check_uri, open_root
from trainers import checkpoint_files as ckpt

if TYPE_CHECKING:  # the driver checks the file exists without torch
    import torch

log = logging.getLogger(__name__)

FIELD = "model.init_from"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SUFFIXES = (*PICKLE_SUFFIXES, ".safetensors")
SHOWN_KEYS = 8  # keys listed per kind of mismatch; the rest are counted
FIX = ("point model.init_from at weights saved from this same architecture (model.name or factory, its options "
       "and sizes), e.g. a checkpoint of a job with this model section")


class InitFromError(ValueError):
    """Weights that cannot start this model; the message is ``model.init_from: value: problem: fix``."""


def problem(uri: str, what: str, fix: str) -> InitFromError:
    return InitFromError(f"{FIELD}: {uri!r}: {what}: {fix}")


def absolute(uri: str) -> str:
    """A local path made absolute against the current directory (what the workers get); URIs as given."""
    if urlparse(uri).scheme:
        return uri
    return str(Path(uri).expanduser().resolve())


def _locate(uri: str) -> tuple[pafs.FileSystem, str, pafs.FileType]:
    why = check_uri(uri)
    if why:
        raise problem(uri, why, "use a local path, file:// or s3://bucket/key")
    root = open_root(uri)
    return root.fs, root.base, root.fs.get_file_info(root.base).type


def check_exists(uri: str) -> None:
    """What the driver can check before Ray starts: the file (of a known kind) or the folder of
    checkpoints is there. Reads no weights (the workers verify and load them)."""
    fs, path, kind = _locate(uri)
    if kind == pafs.FileType.NotFound:
        raise problem(uri, "not found", "check the path or the bucket (a relative path is read from the "
                                        "directory you launch in)")
    if kind == pafs.FileType.File and not path.endswith(SUFFIXES):
        raise problem(uri, "not a weights file this reads", f"use one of {', '.join(SUFFIXES)}, a job's "
                                                             "checkpoint_<step> folder or its checkpoints folder")
    if kind == pafs.FileType.Directory and ckpt.step_of(posixpath.basename(path)) is None \
            and not ckpt.checkpoint_folders(fs, path):
        raise problem(uri, "a folder with no checkpoint_<step> folder in it",
                      "name a job's checkpoints folder (<storage root>/<job>/checkpoints), one checkpoint_<step> "
                      f"folder in it, or a weights file ({', '.join(SUFFIXES)})")


def read_state_dict(uri: str) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors by name that ``uri`` holds, and what they were read from (a job's newest verified
    checkpoint when ``uri`` is its checkpoints folder)."""
    check_exists(uri)
    fs, path, kind = _locate(uri)
    if kind == pafs.FileType.Directory:
        return _from_job_checkpoint(uri, fs, path)
    if path.endswith(".safetensors"):
        return _from_safetensors(uri, fs, path), uri
    return _from_pickle(uri, fs, path), uri


def _from_job_checkpoint(uri: str, fs: pafs.FileSystem, path: str) -> tuple[dict, str]:
    if ckpt.step_of(posixpath.basename(path)) is not None:
        _, why = ckpt.verify(fs, path)
        if why:
            raise problem(uri, f"the checkpoint does not verify ({why})", "name another of the job's checkpoints, "
                                                                          "or its checkpoints folder for the newest good one")
        chosen = path
    else:
        found, skipped = ckpt.find_restore(fs, path)
        for c in skipped:
            log.warning("%s: skipping %s: %s", FIELD, posixpath.basename(c.path), c.problem)
        if found is None:
            raise problem(uri, "no checkpoint in it verifies", "name a job whose checkpoints completed")
        chosen = found.path
    state = ckpt.load_state(fs, chosen)
    where = uri if chosen == path else f"{uri.rstrip('/')}/{posixpath.basename(chosen)}"
    return _tensors(uri, state.get("model")), where


def _from_safetensors(uri: str, fs: pafs.FileSystem, path: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    try:
        if isinstance(fs, pafs.LocalFileSystem):
            return load_file(path)  # memory-mapped
        with fs.open_input_stream(path) as f:
            return load(f.read())
    except SafetensorError as exc:
        raise problem(uri, f"not a readable .safetensors file ({exc})", "save it again with "
                                                                         "safetensors.torch.save_file") from None


def _from_pickle(uri: str, fs: pafs.FileSystem, path: str) -> dict:
    import pickle

    import torch

    try:
        with fs.open_input_file(path) as f:
            loaded = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message leads with advice to load with weights_only=False: only its reason is ours to show
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. |\n|$)", str(exc))
        reason = (found.group(1).strip() if found else str(exc).strip().splitlines()[-1])[:300]
        if reason.startswith("Unsupported global"):
            raise problem(uri, f"holds more than tensors, and a weights file is never run as code "
                               f"(torch.load(weights_only=True) refused it: {reason})",
                          "save the state dict alone (torch.save(model.state_dict(), path)) or as .safetensors") from None
        raise problem(uri, f"not a readable torch file ({reason})",
                      "save it with torch.save(model.state_dict(), path)") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise problem(uri, f"not a readable torch file ({type(exc).__name__}: {str(exc)[:300]})",
                      "save it with torch.save(model.state_dict(), path)") from None
    return _tensors(uri, _state_dict_in(uri, loaded))


def _state_dict_in(uri: str, loaded: Any) -> Any:
    """The state dict itself, or the one a training checkpoint holds under 'state_dict' (Lightning) or 'model'."""
    if isinstance(loaded, dict) and loaded and all(_is_tensor(v) for v in loaded.values()):
        return loaded
    for key in ("state_dict", "model"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            return loaded[key]
    keys = ", ".join(map(repr, list(loaded)[:SHOWN_KEYS])) if isinstance(loaded, dict) else type(loaded).__name__
    raise problem(uri, f"holds no state dict (found {keys})", "save tensors by name (model.state_dict()), or a "
                                                               "mapping with them under 'state_dict' or 'model'")


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _tensors(uri: str, state: Any) -> dict:
    if not isinstance(state, dict) or not state:
        raise problem(uri, "holds no model weights", FIX)
    odd = [k for k, v in state.items() if not (isinstance(k, str) and _is_tensor(v))]
    if odd:
        raise problem(uri, f"its state dict holds values that are not tensors ({', '.join(map(repr, odd[:SHOWN_KEYS]))})",
                      "save model.state_dict() itself")
    return state


def strip_prefixes(state: dict, model_keys: set[str]) -> dict:
    """Keys without a first component that every key carries and no key of the model does
    ('model.' from a LightningModule holding the net as ``self.model``, 'module.' from DDP,
    '_orig_mod.' from torch.compile), repeatedly."""
    while state:
        first = {k.split(".", 1)[0] for k in state}
        if len(first) != 1 or any("." not in k for k in state):
            return state
        prefix = first.pop() + "."
        if any(k.startswith(prefix) for k in model_keys):
            return state
        state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else "")


def fit_problems(state: dict, expected: dict) -> list[str]:
    """How ``state`` fails to fit a model whose state dict is ``expected`` (names and shapes); [] when it fits."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: expected {tuple(expected[k].shape)}, found {tuple(state[k].shape)}"
              for k in sorted(set(state) & set(expected)) if tuple(state[k].shape) != tuple(expected[k].shape)]
    out = []
    if missing:
        out.append(f"missing keys ({len(missing)}): {_listed(missing)}")
    if unexpected:
        out.append(f"unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
    if shapes:
        out.append(f"shapes differ ({len(shapes)}): {_listed(shapes)}")
    return out


def load_into(model: torch.nn.Module, uri: str) -> str:
    """Copy the weights ``uri`` holds into ``model`` (in place: an optimizer built on its parameters
    keeps them); return what they were read from. InitFromError when they do not fit."""
    state, source = read_state_dict(uri)
    expected = model.state_dict()
    state = strip_prefixes(state, set(expected))
    problems = fit_problems(state, expected)
    if problems:
        raise problem(uri, "does not fit the model: " + "; ".join(problems), FIX)
    model.load_state_dict(state)
    log.info("starting from pretrained weights: %s (%d tensors)", source, len(state))
    return source
