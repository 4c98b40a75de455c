"""Models by Hugging Face Hub name: ``--model ORG/NAME`` as vLLM takes it.

A model argument that is an existing local directory is used as it is. Otherwise, when it looks
like a Hub repo id (``ORG/NAME``), it is resolved to a snapshot folder of the Hugging Face cache:
the cache first (no network), then a download unless ``HF_HUB_OFFLINE`` forbids it. Only what
pdserve reads is fetched: the config files, the tokenizer and chat template files, and the
safetensors files the weights need (the shards ``model.safetensors.index.json`` lists, else
``model.safetensors``; repos that also carry a second copy of the weights, such as Mistral's
``consolidated.safetensors``, are not downloaded twice).

Every node resolves the name from its own cache: the launch node for the router (tokenizer,
chat template), each worker for its weights. The launch node pins the commit it found, so every
worker loads the same snapshot.

No torch here: the command line refuses a bad ``--model`` before anything heavy is imported.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Files pdserve reads besides the weights (loader.py, the router's chat template).
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"({_PART})/({_PART})")
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelResolveError(ValueError):
    """The model argument names no local directory and no model the Hub cache has (or can
    get); the message says which and where it looked."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user gave: shown, and served as the OpenAI model id for Hub models
    path: Path  # the local directory on this node
    commit: str | None = None  # the snapshot's commit, for a Hub model

    @property
    def from_hub(self) -> bool:
        return self.commit is not None


def is_repo_id(model: str) -> bool:
    """``ORG/NAME`` as the Hub spells repo ids (no ``--`` or ``..``, no ``.git`` ending)."""
    return (bool(_REPO_ID.fullmatch(model)) and "--" not in model and ".." not in model
            and not model.endswith(".git"))


def hub_cache_dir() -> Path:
    """The Hub cache folder, read from the environment now (huggingface_hub.constants reads it
    once, at import): HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub."""
    def expand(p: str) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(p)))

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return expand(os.environ[var])
    if os.environ.get("HF_HOME"):
        return expand(os.environ["HF_HOME"]) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return expand(xdg) / "huggingface" / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now, as huggingface_hub spells true."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in _TRUE


class UnsupportedOption(ValueError):
    """A vLLM model option pdserve does not implement. ``option`` is its Python name; the
    message spells it as the Python API does, ``flag_message`` as the command line does."""

    def __init__(self, option: str, value: Any, reason: str) -> None:
        self.option, self.value, self.reason = option, value, reason
        super().__init__(f"{option}={value!r} is not supported: {reason}")

    @property
    def flag_message(self) -> str:
        flag = "--" + self.option.replace("_", "-")
        shown = "" if self.value is True else f" {self.value}"
        return f"{flag}{shown} is not supported: {self.reason}"


def check_supported_options(model: str | os.PathLike | None = None, *, revision: str | None = None,
                            tokenizer: str | os.PathLike | None = None,
                            trust_remote_code: bool = False) -> None:
    """Refuse the vLLM model options pdserve does not implement (``UnsupportedOption``), rather
    than ignore them. A ``tokenizer`` that is the model itself is vLLM's default, so it passes."""
    if revision is not None:
        raise UnsupportedOption(
            "revision", revision,
            "pdserve loads the revision the Hugging Face cache's refs/main names (or downloads "
            "main); to serve another, download it into a directory (`hf download ORG/NAME "
            "--revision REV --local-dir DIR`) and pass that directory as the model")
    if tokenizer is not None and not _same_model(tokenizer, model):
        raise UnsupportedOption(
            "tokenizer", os.fspath(tokenizer),
            "pdserve uses the model's own tokenizer.json; put the tokenizer's files into the "
            "model directory instead")
    if trust_remote_code:
        raise UnsupportedOption(
            "trust_remote_code", True,
            "pdserve runs no code from model repos; it serves the architectures it implements "
            f"({_architectures()}) from config.json and safetensors")


def _same_model(tokenizer: str | os.PathLike, model: str | os.PathLike | None) -> bool:
    if model is None:
        return False
    if os.fspath(tokenizer) == os.fspath(model):
        return True
    a, b = Path(tokenizer).expanduser(), Path(model).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def _architectures() -> str:
    try:
        from pdserve.workers.model.registry import ARCHITECTURES

        return ", ".join(sorted(ARCHITECTURES))
    except Exception:  # the message must not fail for want of the list
        return "see docs/operations.md"


def resolve_model(model: str | os.PathLike, *, commit: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> ResolvedModel:
    """``model`` as a local directory: itself when it is one, else the Hub cache's snapshot of
    the repo id it names (downloaded unless HF_HUB_OFFLINE is set). ``commit`` pins the
    snapshot (the launch node passes the one it found to the workers). Raises
    ``ModelResolveError``."""
    text = os.fspath(model)
    local = Path(text).expanduser()
    if local.is_dir():
        return ResolvedModel(text, local)
    repo, sep, rev = text.partition("@")
    if sep and is_repo_id(repo):
        check_supported_options(repo, revision=rev)  # ORG/NAME@REV is a revision: refused
    if not is_repo_id(text):
        raise ModelResolveError(f"model directory {text} does not exist (nor is {text!r} a "
                                "Hugging Face repo id, ORG/NAME)")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    path = _from_cache(text, commit, cache)
    if path is not None and not _missing(path):
        return ResolvedModel(text, path, path.name)
    where = f"the Hugging Face cache at {cache}"
    if hub_offline():
        if path is None:
            at = f" at commit {commit} (the launch node's)" if commit else ""
            raise ModelResolveError(
                f"model {text!r}{at} is not in {where} and HF_HUB_OFFLINE=1 forbids downloading "
                "it (nor is it a local directory)")
        raise ModelResolveError(
            f"model {text!r}: the snapshot in {where} ({path}) lacks "
            f"{', '.join(_missing(path))}, and HF_HUB_OFFLINE=1 forbids downloading them")
    path = _download(text, commit, cache)
    missing = _missing(path)
    if missing:
        raise ModelResolveError(f"model {text!r}: the Hub repo has no {', '.join(missing)} "
                                f"(pdserve loads safetensors checkpoints; snapshot {path})")
    return ResolvedModel(text, path, path.name)


def _from_cache(repo_id: str, commit: str | None, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=commit, cache_dir=cache,
                                      local_files_only=True))
    except LocalEntryNotFoundError:  # IncompleteSnapshotError included: download the rest
        return None


def _download(repo_id: str, commit: str | None, cache: Path) -> Path:
    """Metadata first, then exactly the weight files the index (or its absence) names, both
    from the same commit."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        path = Path(snapshot_download(repo_id, revision=commit, cache_dir=cache,
                                      allow_patterns=list(METADATA_FILES)))
        weights = _weight_files(path) or [SINGLE_WEIGHTS]
        return Path(snapshot_download(repo_id, revision=path.name, cache_dir=cache,
                                      allow_patterns=weights))
    except GatedRepoError as exc:
        raise ModelResolveError(
            f"model {repo_id!r} is gated: accept its terms on the Hub and log in (`hf auth "
            f"login` or HF_TOKEN) ({_first_line(exc)})") from None
    except RepositoryNotFoundError as exc:
        raise ModelResolveError(
            f"model {repo_id!r}: no such repo on the Hub, or it is private and no token gives "
            f"access ({_first_line(exc)}); nor is it a local directory") from None
    except RevisionNotFoundError as exc:
        raise ModelResolveError(f"model {repo_id!r}: {_first_line(exc)}") from None
    except LocalEntryNotFoundError as exc:  # no network, and not cached
        raise ModelResolveError(
            f"model {repo_id!r} is not in the Hugging Face cache at {cache} and the Hub cannot "
            f"be reached to download it ({_first_line(exc)})") from None
    except OSError as exc:  # disk full, permissions, other HTTP errors
        raise ModelResolveError(f"model {repo_id!r}: downloading into {cache} failed: "
                                f"{_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def _weight_files(path: Path) -> list[str]:
    """The shard files the snapshot's index lists (empty without an index)."""
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        return []
    try:
        weight_map: Any = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return []  # the loader names the broken file
    return sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []


def _missing(path: Path) -> list[str]:
    """What pdserve needs that the snapshot lacks (a cache can hold a partial snapshot, e.g.
    config.json alone from a transformers AutoConfig call)."""
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    shards = _weight_files(path)
    if shards:
        missing += [s for s in shards if not (path / s).is_file()]
    elif not (path / SINGLE_WEIGHTS).is_file():
        missing.append(f"{SINGLE_WEIGHTS} (or {WEIGHTS_INDEX} and its shards)")
    return missing

