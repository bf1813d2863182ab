"""onnxruntime sessions over model protos whose weights may stay on disk.

A model over 2 GB must keep its weights in external data files, and protobuf cannot hold it as
one message. `slicer.preflight.read_model` then leaves the weights where they are: the proto holds
only references (`location` relative to the model's folder), and the folder is recorded in the
proto's metadata under `EXTERNAL_DIR_KEY`, which every copy of the proto (the canonical model, a
probe with more outputs) carries. A session over such a proto is made from its few bytes, with
onnxruntime told where the data lies; writing one out (`save_with_data`) reads the weights it
holds one tensor at a time into a data file of its own.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx
import onnxruntime as ort
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor, uses_external_data

EXTERNAL_DIR_KEY = "dvabatch.external_data_dir"


def external_data_dir(model: onnx.ModelProto) -> Path | None:
    """The folder this proto's external data lies in, where its weights were left on disk."""
    raw = next((p.value for p in model.metadata_props if p.key == EXTERNAL_DIR_KEY), None)
    return Path(raw) if raw else None


def keep_data_on_disk(model: onnx.ModelProto, folder: Path) -> None:
    """Record that `model`'s external data stays in `folder` (read_model, for a model over 2 GB)."""
    forget_data_dir(model)
    model.metadata_props.add(key=EXTERNAL_DIR_KEY, value=str(Path(folder).resolve()))


def forget_data_dir(model: onnx.ModelProto) -> None:
    """Drop the record of where the data lies (a proto saved beside its data files)."""
    for prop in list(model.metadata_props):
        if prop.key == EXTERNAL_DIR_KEY:
            model.metadata_props.remove(prop)


def proto_session(model: onnx.ModelProto, options: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU session over `model`, its weights read from their folder when they stayed on disk."""
    folder = external_data_dir(model)
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """Initializers (of the main graph) whose data lies in an external file."""
    return [t for t in model.graph.initializer if uses_external_data(t)]


def save_with_data(model: onnx.ModelProto, path: Path, data_file: str, folder: Path | None = None) -> None:
    """Save `model` at `path`. Where its weights stayed on disk (in `folder`, default the one its
    metadata names), they are read one tensor at a time and written to `data_file` beside it (the
    proto itself never holds them all); otherwise a plain save."""
    folder = folder or external_data_dir(model)
    tensors = external_tensors(model)
    if folder is None or not tensors:
        onnx.save(model, str(path))
        return
    offset = 0
    with open(path.parent / data_file, "wb") as out:
        for tensor in tensors:
            load_external_data_for_tensor(tensor, str(folder))
            data = tensor.raw_data
            out.write(data)
            del tensor.external_data[:]
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data_file), ("offset", str(offset)), ("length", str(len(data)))):
                tensor.external_data.add(key=key, value=value)
            offset += len(data)
            del data
    forget_data_dir(model)
    onnx.save(model, str(path))


def copy_data_files(model: onnx.ModelProto, folder: Path) -> None:
    """Place the external data files `model` refers to in `folder` (a hard link where the file
    system allows, else a copy), so the proto saved there finds them."""
    source = external_data_dir(model)
    if source is None:
        return
    for location in sorted({ExternalDataInfo(t).location for t in external_tensors(model)}):
        target = folder / location
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / location, target)
        except OSError:
            shutil.copyfile(source / location, target)
