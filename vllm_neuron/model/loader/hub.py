"""Models by Hugging Face id: `org/name` (safetensors) or `org/name:Q4_K_M` / --hf-file (one GGUF file), fetched
with huggingface_hub into its standard cache (or --download-dir), at --revision, with HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE honoured. Returns a local path the loader takes as it takes any folder or .gguf file.

Only what the loader reads is fetched: the top-level JSON files (config, generation config, tokenizer, index),
the safetensors weights (the shards an index names, not a `consolidated` copy beside them), the tokenizer's own
files and chat templates; never `.bin` / `.pt` weights. A GGUF repository gives one file (every part of a split
one): llama.cpp's rule (the `:TAG` quantization in the file name, case-insensitive, Q4_K_M when none is given, else
the first GGUF), never an `mmproj` file. Nothing truncated is ever loaded: files reach the snapshot only once whole.
The weight files (safetensors, GGUF: nearly all the bytes) are fetched by `_fetch_weight_blob` into
`<blob>.partial`, which a run stopped by Ctrl-C or killed leaves behind, and the next run continues it with a Range
request (huggingface_hub 2 deletes its own partial files when a download stops); each finished weight is checked
against its sha256 (the hub's ETag of an LFS file) before huggingface_hub links it into the snapshot. The other
files are huggingface_hub's own downloads; a dropped connection is resumed within the run.
Offline (HF_HUB_OFFLINE=1, or the hub unreachable) the cache alone is used; what is missing is named.

Every failure is a ValueError of one line that says what went wrong and what to do.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass

from vllm_neuron import envs
from vllm_neuron.logger import init_logger
from vllm_neuron.model.loader import gguf_split

logger = init_logger(__name__)

GGUF_DEFAULT_TAG = "Q4_K_M"  # llama.cpp's `-hf org/name` default
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_QUANT_TAG = re.compile(r"[A-Za-z0-9_]+")
# Top-level files besides the weights that the loader, the tokenizer and the chat template may read.
_SIDE_FILES = ("*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt")
_PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    tag: str | None = None  # `org/name:TAG`: a GGUF quantization


def parse_hub_id(model: str) -> HubModel | None:
    """`org/name` or `org/name:TAG` when `model` is not a local path; None when it cannot be a repository id."""
    if os.path.exists(os.path.expanduser(model)) or model.startswith((".", "/", "~")) or model.endswith(".gguf"):
        return None
    repo, _, tag = model.partition(":")
    if not _REPO_ID.fullmatch(repo) or (tag and not _QUANT_TAG.fullmatch(tag)) or ".." in repo:
        return None
    return HubModel(repo, tag or None)


def _network_errors() -> tuple[type[BaseException], ...]:
    try:
        import httpx2 as http  # huggingface_hub's HTTP client (an httpx fork since huggingface_hub 2)
    except ImportError:
        import httpx as http
    return http.ConnectError, http.TimeoutException, http.NetworkError


def _top_level(files: list[str]) -> list[str]:
    return [f for f in files if "/" not in f]


def weight_patterns(files: list[str], repo_id: str) -> list[str]:
    """allow_patterns of a safetensors repository: the exact top-level files the loader reads."""
    top = _top_level(files)
    weights = [f for f in top if f.endswith(".safetensors")]
    if "model.safetensors.index.json" in top:  # the index's shards; a `consolidated` single file is another copy
        weights = [f for f in weights if not f.startswith("consolidated")]
    if not weights:
        pickles = [f for f in top if f.endswith(_PICKLE_WEIGHTS)]
        what = f"only {', '.join(pickles[:3])} (pickle weights, never loaded here)" if pickles else "no weights"
        raise ValueError(f"Hugging Face repository {repo_id!r} has {what}: vllm-neuron loads safetensors or GGUF; "
                         "pick a repository (or revision) with *.safetensors, or a GGUF one with org/name:QUANT")
    side = [f for f in top if any(fnmatch.fnmatchcase(f, p) for p in _SIDE_FILES)]
    if "config.json" not in side:
        raise ValueError(f"Hugging Face repository {repo_id!r} has safetensors but no config.json: it is not a "
                         "transformers model folder")
    return sorted(side + weights)


def select_gguf(files: list[str], repo_id: str, tag: str | None, hf_file: str | None) -> str:
    """The GGUF file to load: --hf-file, else the file whose name carries `tag` (llama.cpp's rule); for a split
    GGUF, its first part (all parts are fetched: `_plan`)."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and "mmproj" not in os.path.basename(f).lower())
    if hf_file is not None:
        if hf_file not in files:
            raise ValueError(f"--hf-file {hf_file!r} is not in {repo_id!r}; its GGUF files: {ggufs or 'none'}")
        chosen = hf_file
    else:
        if not ggufs:
            raise ValueError(f"{repo_id!r} has no GGUF file to take the quantization {tag!r} from; drop ':{tag}' for "
                             "a safetensors repository")
        wanted = tag or GGUF_DEFAULT_TAG
        pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(wanted)}(?![A-Za-z0-9_])", re.IGNORECASE)
        matches = [f for f in ggufs if pattern.search(os.path.basename(f))]
        if not matches and tag is not None:
            raise ValueError(f"{repo_id!r} has no GGUF file for the quantization {tag!r}; its GGUF files: "
                             f"{', '.join(ggufs)} (pick one with org/name:QUANT or --hf-file)")
        chosen = (matches or ggufs)[0]
    parsed = gguf_split.parse_part(chosen)
    if parsed is not None:  # fetch every part; the loader is given the first
        parts = gguf_split.sibling_parts(gguf_split.part_name(parsed[0], 1, parsed[2]))
        missing = [p for p in parts if p not in files]
        if missing:
            raise ValueError(f"{chosen!r} in {repo_id!r} is one part of a split GGUF of {parsed[2]} files, and the "
                             f"repository lacks {', '.join(missing)}")
        return parts[0]
    return chosen


def _plan(files: list[str], ref: HubModel, hf_file: str | None, only_tokenizer: bool) -> tuple[list[str], str | None]:
    """(the files to fetch, the GGUF among them or None)."""
    top = _top_level(files)
    gguf_repo = ref.tag is not None or hf_file is not None or (
        "config.json" not in top and any(f.endswith(".gguf") for f in files))
    if gguf_repo:  # a GGUF carries its tokenizer too
        chosen = select_gguf(files, ref.repo_id, ref.tag, hf_file)
        return gguf_split.sibling_parts(chosen), chosen
    if only_tokenizer:
        side = sorted(f for f in top if any(fnmatch.fnmatchcase(f, p) for p in _SIDE_FILES)
                      and f != "model.safetensors.index.json")
        if not {"tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt"} & set(side):
            raise ValueError(f"Hugging Face repository {ref.repo_id!r} has no tokenizer files (tokenizer.json, "
                             "tokenizer.model, vocab.json)")
        return side, None
    return weight_patterns(files, ref.repo_id), None


def _describe_http_error(e: Exception, repo_id: str, revision: str, endpoint: str) -> str:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, GatedRepoError):
        return (f"{repo_id!r} is gated on {endpoint}: accept its terms on the model's page, then set HF_TOKEN to a "
                "token of that account")
    if isinstance(e, RevisionNotFoundError):
        return (f"revision {revision!r} does not exist in {repo_id!r} on {endpoint}: pass one of its branches, tags "
                "or commit hashes with --revision")
    if isinstance(e, RepositoryNotFoundError) and status == 401:
        token = "the HF_TOKEN sent was refused" if os.environ.get("HF_TOKEN") else "no token was sent"
        return (f"{repo_id!r} was not found on {endpoint} or is private, and {token} (401): if it exists, set HF_TOKEN "
                "to a token with access to it; else check the id")
    if isinstance(e, RepositoryNotFoundError):
        return (f"there is no model {repo_id!r} on {endpoint} and no local path of that name: check the id (org/name) "
                "or the path")
    return f"the hub at {endpoint} answered {status} for {repo_id!r}: {str(e).splitlines()[0]}"


def _cache_listing(repo_id: str, revision: str, cache_dir: str | None) -> list[str] | None:
    """The repository's file list as a previous download cached it (None when there is none)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache_dir)]
    except CachedRepoTreeNotFoundError:
        return None


def _is_weight(name: str) -> bool:
    return name.endswith((".safetensors", ".gguf"))


def _fetch_weight_blob(repo_id: str, name: str, revision: str, cache_dir: str | None, endpoint: str) -> None:
    """Puts the weight file `name` into the cache's blob store, continuing `<blob>.partial` left by an earlier
    run; huggingface_hub then finds the blob and only links it into the snapshot."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(repo_id, name, revision=revision, endpoint=endpoint)
    meta = get_hf_file_metadata(url, endpoint=endpoint)
    if not meta.etag or meta.size is None:
        return  # huggingface_hub's own download then
    folder = os.path.join(cache_dir or constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type="model"))
    blob = os.path.join(folder, "blobs", meta.etag)
    if os.path.exists(blob):
        return
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    partial = blob + ".partial"
    headers = build_hf_headers()
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a CDN location: the token is for the hub only
    with WeakFileLock(partial + ".lock"):  # two starts never append to one file
        if os.path.exists(blob):
            return
        have = os.path.getsize(partial) if os.path.exists(partial) else 0
        if have > meta.size:
            have = 0
        if have:
            logger.info("Resuming %s of %s at %.1f of %.1f MB (left by an interrupted run)", name, repo_id,
                        have / 1e6, meta.size / 1e6)
        with open(partial, "r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            http_get(meta.location, f, resume_size=have, headers=headers, expected_size=meta.size,
                     displayed_filename=name)
        if re.fullmatch(r"[0-9a-f]{64}", meta.etag):  # an LFS file: its ETag is the content's sha256
            digest = _sha256(partial)
            if digest != meta.etag:
                os.remove(partial)
                raise ValueError(f"{name} of {repo_id} downloaded with sha256 {digest}, not the hub's {meta.etag}: "
                                 "the partial file was removed; run again to download it afresh")
        os.replace(partial, blob)


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_model(model: str, *, revision: str | None = None, download_dir: str | None = None,
                hf_file: str | None = None, only_tokenizer: bool = False) -> str:
    """The local path (a snapshot folder, or a .gguf file in one) of the hub model `model` (`org/name[:TAG]`).
    only_tokenizer: the tokenizer's files and the JSON beside them, no weights (--tokenizer, --tokenizer-revision)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    ref = parse_hub_id(model)
    if ref is None:
        raise ValueError(f"{model!r} is neither a local path nor a Hugging Face id (org/name, org/name:QUANT)")
    revision = revision or "main"
    endpoint = (envs.HF_ENDPOINT or "https://huggingface.co").rstrip("/")
    offline = envs.HF_HUB_OFFLINE
    where = download_dir or "the Hugging Face cache"
    files: list[str] | None = None
    commit: str | None = None
    unreachable: BaseException | None = None
    if not offline:
        try:
            # model_info, not list_repo_files: its one request fails at once when the hub is unreachable (the
            # listing's retries would wait ~30 s before the cache is looked at).
            info = HfApi(endpoint=endpoint).model_info(ref.repo_id, revision=revision)
            files, commit = [sib.rfilename for sib in info.siblings or []], info.sha
        except _network_errors() as e:
            unreachable = e
            logger.warning("The hub at %s cannot be reached (%s: %s); looking for %s in %s", endpoint,
                           type(e).__name__, e, ref.repo_id, where)
        except HfHubHTTPError as e:
            raise ValueError(_describe_http_error(e, ref.repo_id, revision, endpoint)) from None
    if files is None:
        files = _cache_listing(ref.repo_id, revision, download_dir)
        if files is None:
            why = ("HF_HUB_OFFLINE=1" if offline else
                   f"the hub at {endpoint} cannot be reached ({type(unreachable).__name__})")
            todo = ("run once without HF_HUB_OFFLINE to download it" if offline else
                    "check the network and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the cache only")
            raise ValueError(f"{why} and {ref.repo_id!r} (revision {revision!r}) is not in {where}: {todo}, or pass "
                             "a local folder or .gguf file")
    wanted, gguf = _plan(files, ref, hf_file, only_tokenizer)
    logger.info("%s %s (revision %s) from %s: %s", "Tokenizer" if only_tokenizer else "Model", ref.repo_id, revision,
                "the cache" if offline or unreachable else endpoint, ", ".join(wanted))
    try:
        if not offline and unreachable is None:
            # The repository's listing and the revision's ref are cached with the first small file (what an offline
            # start checks the cache against), then each file comes with a progress bar of its own, all at one commit.
            wanted.sort(key=_is_weight)
            if _is_weight(wanted[0]):
                _fetch_weight_blob(ref.repo_id, wanted[0], commit or revision, download_dir, endpoint)
            snapshot_download(ref.repo_id, revision=revision, cache_dir=download_dir, allow_patterns=wanted[:1],
                              endpoint=endpoint)
            for name in wanted[1:]:
                if _is_weight(name):
                    _fetch_weight_blob(ref.repo_id, name, commit or revision, download_dir, endpoint)
                hf_hub_download(ref.repo_id, name, revision=commit or revision, cache_dir=download_dir,
                                endpoint=endpoint)
        folder = snapshot_download(ref.repo_id, revision=revision, cache_dir=download_dir, allow_patterns=wanted,
                                   endpoint=endpoint, local_files_only=True)
    except IncompleteSnapshotError as e:
        missing = str(e).split("missing (", 1)[-1].split(")", 1)[0]
        raise ValueError(f"the cached {ref.repo_id!r} (revision {revision!r}) in {where} is incomplete, missing "
                         f"{missing}: an earlier download was interrupted; run once with network access (without "
                         "HF_HUB_OFFLINE) to finish it") from None
    except LocalEntryNotFoundError:
        raise ValueError(f"{ref.repo_id!r} (revision {revision!r}) is not in {where} and the hub cannot be used: run "
                         "once with network access to download it") from None
    except HfHubHTTPError as e:
        raise ValueError(_describe_http_error(e, ref.repo_id, revision, endpoint)) from None
    except _network_errors() as e:
        raise ValueError(f"downloading {ref.repo_id!r} from {endpoint} failed ({type(e).__name__}: {e}); run again: "
                         "the files already fetched are kept") from None
    except KeyboardInterrupt:
        logger.error("Download of %s interrupted: the files it finished stay in %s and the next run fetches the "
                     "rest, continuing a weight file where it stopped", ref.repo_id, where)
        raise
    missing = [f for f in wanted if not os.path.isfile(os.path.join(folder, f))]
    if missing:  # a cache without a listing (filled by older tools): nothing else says what is missing
        raise ValueError(f"the cached {ref.repo_id!r} in {folder} lacks {', '.join(missing)}: run once with network "
                         "access (without HF_HUB_OFFLINE) to finish the download")
    return os.path.join(folder, gguf) if gguf is not None else folder
