"""`etrain export`: a job's trained weights out of one of its verified checkpoints, as a plain
state dict other tools load (``.safetensors``, or ``.pt`` for ``torch.load``), in its folder.

The checkpoint holds far more (optimizer, data cursor, RNG, metrics): the export is the model's
``state_dict()`` alone, the same whatever world size the job ran at. It is what
``model.init_from`` takes too, so another job can start from it.
"""

from __future__ import annotations

import io
import logging
import posixpath

from cluster.storage import write_whole
from trainers import checkpoint_files as ckpt
from trainers.config.job import JobSpec
from trainers.job_folder import EXPORTED_DIR, EXPORTED_FILES, JobHome, job_home

log = logging.getLogger(__name__)

FORMATS = tuple(EXPORTED_FILES)


class ExportError(Exception):
    """Nothing to export; the message says why and what to do."""


def chosen_checkpoint(home: JobHome, name: str, step: int | None) -> str:
    """The path of the checkpoint to export: the newest verified one, or the one at ``step`` (verified)."""
    fs = home.root.fs
    folders = ckpt.checkpoint_folders(fs, home.run_path)
    if step is None:
        chosen, skipped = ckpt.find_restore(fs, home.run_path, folders)
        if chosen is None:
            why = "".join(f"; {posixpath.basename(c.path)}: {c.problem}" for c in skipped)
            raise ExportError(f"job {name!r}: no verified checkpoint in {home.run_uri}{why}: run the job first "
                              "(etrain run SPEC), or check the spec's name and checkpoint.storage_root")
        return chosen.path
    paths = dict(folders)
    if step not in paths:
        steps = ", ".join(str(s) for s, _ in sorted(folders)) or "none"
        raise ExportError(f"--step {step}: job {name!r} has no checkpoint at that step in {home.run_uri} "
                          f"(steps with one: {steps}): pick one of them, or leave --step out for the newest")
    _, why = ckpt.verify(fs, paths[step])
    if why:
        raise ExportError(f"--step {step}: the checkpoint does not verify ({why}): pick another step, or leave "
                          "--step out for the newest verified one")
    return paths[step]


def unshared(weights: dict) -> dict:
    """Tensors that share no memory (tied weights stored once in the model), contiguous: as
    safetensors stores them. Loading copies each into its parameter, tied ones included."""
    seen, out = set(), {}
    for key, tensor in weights.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone().contiguous() if ptr in seen else tensor.contiguous()
        if ptr is not None:
            seen.add(ptr)
    return out


def serialized(weights: dict, fmt: str, metadata: dict[str, str]) -> bytes:
    if fmt == "safetensors":
        from safetensors.torch import save

        return save(unshared(weights), metadata=metadata)
    import torch

    buffer = io.BytesIO()
    torch.save(weights, buffer)
    return buffer.getvalue()


def export_weights(spec: JobSpec, step: int | None = None, fmt: str = "safetensors") -> str:
    """Write the model weights of the job's newest verified checkpoint (or the one at ``step``) to
    ``<job folder>/exported/`` and return the file's URI (a ``model.hf`` job: save_pretrained's folder,
    whatever ``fmt``). ExportError when there is none."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
    home = job_home(spec)
    path = chosen_checkpoint(home, spec.name, step)
    if spec.model.hf is not None:
        return export_pretrained_folder(spec, home, path)
    state = ckpt.load_state(home.root.fs, path)
    metadata = {"job": spec.name, "step": str(state["step"]), "checkpoint": posixpath.basename(path)}
    name = EXPORTED_FILES[fmt]
    write_whole(home.root.fs, home.root.path(home.job, EXPORTED_DIR, name), serialized(state["model"], fmt, metadata))
    log.info("exported the model of %s (step %s): %d tensors", posixpath.basename(path), state["step"],
             len(state["model"]))
    return home.root.uri_of(home.job, EXPORTED_DIR, name)


def export_pretrained_folder(spec: JobSpec, home: JobHome, checkpoint_path: str) -> str:
    """A ``model.hf`` job's checkpoint as the model's own folder, with its tokenizer, in
    ``<job folder>/exported/`` (save_pretrained: what from_pretrained loads); its URI."""
    from trainers.workloads.hf import export_pretrained

    state = ckpt.load_state(home.root.fs, checkpoint_path)
    return export_pretrained(spec, state["model"], home.root, home.job, EXPORTED_DIR)
