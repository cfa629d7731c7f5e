"""A local model directory: checked before any heavy work; its config and tokenizer.

Nothing here touches the network or runs remote code (``local_files_only=True``,
``trust_remote_code=False``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qerl.errors import QerlConfigError
from qerl.modeling.weights import weight_files

__all__ = [
    "QERL_CONFIG_KEY",
    "has_tokenizer",
    "load_config",
    "load_tokenizer",
    "validate_model_dir",
]

#: config.json entry written by :func:`qerl.modeling.fp4_checkpoint.save_quantized`.
QERL_CONFIG_KEY = "qerl_quantization"


def validate_model_dir(
    model_path: str | os.PathLike[str], field: str = "model.path"
) -> tuple[Path, dict[Path, dict[str, Any]]]:
    """Check a model directory (config.json + good safetensors weights) and list its weight files.

    Every safetensors file is checked (:func:`qerl.modeling.weights.weight_files`: header length,
    JSON header, declared byte ranges against the file size, every shard of an index), so a
    corrupt, truncated or foreign file is refused here, before any weight is read.

    Returns:
        ``(directory, {weight file: its safetensors header})``, files in a stable order.

    Raises:
        QerlConfigError: naming ``field`` and the file at fault, with the fix.
    """
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise QerlConfigError(
            field,
            f"{str(path)!r} is not an existing directory",
            "point it at a local model directory (no hub downloads happen at run time)",
        )
    if not (path / "config.json").is_file():
        raise QerlConfigError(
            field,
            f"{str(path)!r} has no config.json",
            "point it at a directory written by save_pretrained (config.json + model.safetensors)",
        )
    return path, weight_files(path, field)


def load_config(path: Path) -> Any:
    """The model config without any stored quantization_config (we handle quantization)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    if hasattr(config, QERL_CONFIG_KEY):
        delattr(config, QERL_CONFIG_KEY)
    return config


def has_tokenizer(path: Path) -> bool:
    """Whether ``path`` holds tokenizer files."""
    return any(
        (path / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    )


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in ``path`` (field ``model.path`` in errors)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as exc:
        raise QerlConfigError(
            "model.path",
            f"no tokenizer could be loaded from {str(path)!r} ({exc})",
            "save the tokenizer next to the weights with tokenizer.save_pretrained(model.path)",
        ) from None
