"""The Hub: a checkpoint's repo id (read off a path or a cache snapshot), and --push-to-hub,
an export directory uploaded to a Hub model repository.

Through ``huggingface_hub.HfApi.upload_folder`` (large files go by the Hub's chunked
transfer, and an interrupted push started again skips what already arrived). Every failure
(no credentials, offline mode, no network, a refusal by the Hub) is an ``ExportError``
sentence that names the repo and the cause, and says the export stays on disk and how to
push it later.
"""

import re
import sys
from pathlib import Path
from typing import Any

from converters.errors import ExportError

_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/[^/]+/?$")


def hub_id(path_or_hub_id: str | Path) -> str | None:
  """The Hub repo id a checkpoint came from: the id itself, or read off a Hub cache snapshot
  path (.../models--ORG--NAME/snapshots/HASH); None for any other local directory."""
  text = str(path_or_hub_id)
  m = _SNAPSHOT.search(text.replace("\\", "/"))
  if m:
    return m["repo"].replace("--", "/")
  return text if looks_like_hub_id(text) and not Path(text).expanduser().is_dir() else None


def looks_like_hub_id(text: str) -> bool:
  return text.count("/") == 1 and not text.startswith((".", "/", "~"))


def push(folder: str | Path, repo_id: str, private: bool = False, api: Any = None) -> str:
  """Upload ``folder`` to the model repo ``repo_id`` (created if missing); returns its URL.

  ``api``: a ``huggingface_hub.HfApi`` (default: one for the logged-in user).
  """
  folder = Path(folder)
  later = f"the export is in {folder}; push it later with `hf upload {repo_id} {folder}`"
  if repo_id.count("/") != 1 or not all(repo_id.split("/")):
    raise ExportError(f"--push-to-hub takes ORG/NAME, got {repo_id!r}; {later}.")
  try:
    if api is None:
      from huggingface_hub import HfApi

      api = HfApi()
    from huggingface_hub.errors import LocalTokenNotFoundError
  except ImportError as e:
    raise ExportError(f"--push-to-hub needs huggingface_hub; {later}.") from e
  failures = (LocalTokenNotFoundError, *_network_errors())
  try:
    api.whoami()
    url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    api.upload_folder(
      repo_id=repo_id,
      folder_path=str(folder),
      repo_type="model",
      commit_message="Upload from jaxtune",
    )
  except failures as e:
    raise ExportError(_why(e, repo_id, getattr(api, "endpoint", None), later)) from e
  return str(url)


def _network_errors() -> tuple[type[BaseException], ...]:
  """What a push raises when it gets no answer or a refusal: huggingface_hub's own errors,
  OSError (requests' connection errors are OSErrors) and the base error of the HTTP client
  huggingface_hub imported (httpx, or httpx2 in huggingface_hub 2), whose ConnectError and
  timeouts are no OSErrors."""
  from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

  clients = (sys.modules.get(name) for name in ("httpx", "httpx2"))
  http = tuple(c.HTTPError for c in clients if c is not None and hasattr(c, "HTTPError"))
  return (HfHubHTTPError, OfflineModeIsEnabled, OSError, *http)


def _why(e: BaseException, repo_id: str, endpoint: str | None, later: str) -> str:
  from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

  if isinstance(e, LocalTokenNotFoundError):
    return (
      f"--push-to-hub {repo_id} needs Hub credentials (run `hf auth login` or set HF_TOKEN); "
      f"{later}."
    )
  if isinstance(e, OfflineModeIsEnabled):
    return f"--push-to-hub cannot reach the Hub (HF_HUB_OFFLINE is set) to push {repo_id}; {later}."
  status = getattr(getattr(e, "response", None), "status_code", None)
  if status in (401, 403):
    return (
      f"the Hub refused to push {repo_id} (HTTP {status}: check that the token may write to "
      f"it); {later}."
    )
  if status is not None:
    return f"the Hub answered HTTP {status} to the push of {repo_id}; {later}."
  # No answer at all: "[Errno 111] Connection refused" -> "connection refused".
  text = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
  cause = re.sub(r"^\[Errno -?\d+\]\s*", "", text).rstrip(".")
  cause = cause[:1].lower() + cause[1:]
  at = f" at {endpoint}" if endpoint else ""
  return f"--push-to-hub could not reach the Hub{at} to push {repo_id} ({cause}); {later}."
