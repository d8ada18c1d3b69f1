"""The model cache: a GGUF file converted once into a Hugging Face directory that later loads read instead.

transformers parses a GGUF file three times per load and dequantizes every tensor (~17 s for the default model
on the 2-core CI machine); the converted copy must load the same model and tokenizer in a few seconds."""

import os
import stat

import pytest
import torch

from tandem import models
from tandem.models import default_model_path, gguf_fingerprint, load_model, model_cache_dir


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_MODEL_CACHE", raising=False)
    return tmp_path


def _entries():
    root = model_cache_dir()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_and_its_copy_loads_the_same_model(cache_root, smollm):
    """The first load converts (an entry appears, nothing partial is left); the second reads the entry and gives
    the model the GGUF file gives: every tensor, the config, the tokenizer with its chat template."""
    first, _ = load_model(device="cpu", dtype="float32")
    gguf = default_model_path()
    assert _entries() == [f"{gguf.stem}-{gguf_fingerprint(gguf)}"]
    entry = model_cache_dir() / _entries()[0]
    assert (entry / "model.safetensors").is_file() and (entry / "tandem-source.json").is_file()
    del first
    cached, tokenizer = load_model(device="cpu", dtype="float32")
    reference, ref_tokenizer = (
        smollm  # loaded by the session (from the file, or its copy in the user's cache)
    )
    ref_state = reference.state_dict()
    for name, tensor in cached.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    assert cached.config.num_hidden_layers == reference.config.num_hidden_layers
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()  # still tied
    chat = [{"role": "user", "content": "What is a key-value cache?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert ids == ref_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        ref_tokenizer.eos_token_id,
        ref_tokenizer.pad_token_id,
    )
    assert tokenizer.padding_side == "left"


class _Loaded:
    """What the transformers loaders return, recorded: where they were asked to load from."""

    pad_token, eos_token, padding_side = "<pad>", "</s>", "right"

    def __init__(self, log, location, kwargs):
        log.append((location, kwargs.get("gguf_file")))

    def to(self, device):
        return self

    def eval(self):
        return self


def test_the_cache_can_be_turned_off_and_a_partial_entry_is_ignored(cache_root, monkeypatch):
    """Where the loaders are pointed: the GGUF file while there is no complete entry (an interrupted conversion
    leaves none) or when the cache is off (argument or environment, and then nothing is stored); the entry once
    it is complete."""
    import transformers

    log, stored = [], []
    loader = classmethod(lambda cls, location, **kwargs: _Loaded(log, location, kwargs))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loader)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loader)
    monkeypatch.setattr(models, "_store_converted", lambda target, entry, model, tok: stored.append(target))
    gguf = default_model_path()
    entry = model_cache_dir() / f"{gguf.stem}-{gguf_fingerprint(gguf)}"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")  # an interrupted conversion: no tandem-source.json
    load_model(device="cpu")
    assert log[-1] == (str(gguf.parent), gguf.name) and stored == [gguf]  # read the file, then stored it
    load_model(device="cpu", cache=False)
    monkeypatch.setenv("TANDEM_MODEL_CACHE", "off")
    load_model(device="cpu")
    assert log[-1] == (str(gguf.parent), gguf.name) and stored == [gguf]  # the file, nothing stored
    monkeypatch.delenv("TANDEM_MODEL_CACHE")
    (entry / "tandem-source.json").write_text("{}")
    load_model(device="cpu")
    assert log[-1] == (str(entry), None) and stored == [gguf]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_cache_does_not_stop_the_load(cache_root):
    root = model_cache_dir()
    root.mkdir(parents=True)
    root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        model, _ = load_model(device="cpu")
        assert model.config.num_hidden_layers == 30 and _entries() == []
    finally:
        root.chmod(stat.S_IRWXU)


def test_the_fingerprint_follows_the_content(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(3 << 20))
    b.write_bytes(b"GGUF" + bytes(3 << 20))
    assert gguf_fingerprint(a) == gguf_fingerprint(b)
    b.write_bytes(b"GGUF" + bytes(3 << 20) + b"x")  # another size
    assert gguf_fingerprint(a) != gguf_fingerprint(b)
    data = bytearray(a.read_bytes())
    data[-5] = 1  # the last MiB changes
    b.write_bytes(bytes(data))
    assert gguf_fingerprint(a) != gguf_fingerprint(b)


def test_auto_dtype_is_bfloat16_on_a_cpu_with_native_bf16(cache_root, monkeypatch):
    """dtype="auto" asks for bfloat16 on a CPU with native bf16 (a GPU keeps the checkpoint's dtype); a load that
    converts the GGUF file stores what transformers gives (float32) and casts after."""
    import transformers

    seen, casts, stored = [], [], []

    class Model(_Loaded):
        def to(self, target):
            casts.append(target)
            return self

    def model_loader(cls, location, **kwargs):
        seen.append(kwargs.get("dtype"))
        return Model([], location, kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(model_loader))
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        classmethod(lambda cls, loc, **kw: _Loaded([], loc, kw)),
    )
    monkeypatch.setattr(models, "_store_converted", lambda target, entry, model, tok: stored.append(entry))
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: True)
    load_model(device="cpu")  # no copy yet: converts
    assert seen[-1] is None and len(stored) == 1 and torch.bfloat16 in casts  # stored float32, then cast
    (stored[0]).mkdir(parents=True)
    (stored[0] / "tandem-source.json").write_text("{}")  # the copy is complete from now on
    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(models, "cpu_has_bf16", lambda native=native: native)
        load_model(device="cpu")
        assert seen[-1] is expected
        assert models.auto_dtype(torch.device("cuda")) is None  # GPUs keep the checkpoint's dtype
    load_model(device="cpu", dtype="float32")
    assert seen[-1] is torch.float32 and len(stored) == 1  # an explicit dtype wins; nothing stored again


def test_a_packaged_model_is_assembled_once_from_its_parts(cache_root, monkeypatch, tmp_path):
    """`--model gemma3-270m`: the GGUF is written from the installed parts into the model cache once (whole or
    not at all), and a missing package or a damaged part is a clear error naming the install command."""
    import sys
    import types

    calls = []

    def assemble(path, overwrite=False):
        calls.append(path)
        if len(calls) == 2:
            raise ValueError("Assembled file sha256 did not match expected value")
        path.write_bytes(b"GGUF")
        return path

    fake = types.ModuleType("fake_parts_gguf")
    fake.MODEL_NAME, fake.assemble = "fake.gguf", assemble
    monkeypatch.setitem(sys.modules, "fake_parts_gguf", fake)
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: name == "fake_parts_gguf" or None)
    monkeypatch.setitem(models.PACKAGED, "fake-model", ("fake_parts_gguf", "pip install fake-parts"))
    path = models.packaged_model_path("fake-model")
    assert path == model_cache_dir() / "fake.gguf" and path.read_bytes() == b"GGUF"
    assert models.packaged_model_path("fake-model") == path and len(calls) == 1  # read from the cache after
    path.unlink()
    with pytest.raises(FileNotFoundError, match="could not be assembled.*pip install fake-parts"):
        models.packaged_model_path("fake-model")
    assert not path.exists() and not list(model_cache_dir().glob("*.partial"))
    monkeypatch.setitem(models.PACKAGED, "absent-model", ("no_such_parts_gguf", "pip install absent-parts"))
    with pytest.raises(
        FileNotFoundError, match="'absent-model' is not installed: run `pip install absent-parts`"
    ):
        models.locate_model("absent-model")
