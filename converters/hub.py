"""--push-to-hub: an export directory uploaded to a Hub model repository.

Through ``huggingface_hub.HfApi.upload_folder`` (large files go by the Hub's chunked
transfer, and an interrupted push started again skips what already arrived). Every failure
is an ``ExportError`` sentence that says the export stays on disk and how to push it later.
"""

from pathlib import Path
from typing import Any

from jaxtune.errors import ExportError


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
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled
  except ImportError as e:
    raise ExportError(f"--push-to-hub needs huggingface_hub; {later}.") from e
  try:
    api.whoami()
  except (LocalTokenNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as e:
    raise ExportError(_why(e, later)) from e
  try:
    url = api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    api.upload_folder(
      repo_id=repo_id,
      folder_path=str(folder),
      repo_type="model",
      commit_message="Upload from jaxtune",
    )
  except (OfflineModeIsEnabled, HfHubHTTPError, OSError) as e:
    raise ExportError(_why(e, later)) from e
  return str(url)


def _why(e: BaseException, later: str) -> str:
  from huggingface_hub.errors import LocalTokenNotFoundError, OfflineModeIsEnabled

  if isinstance(e, LocalTokenNotFoundError):
    return f"--push-to-hub needs Hub credentials (run `hf auth login` or set HF_TOKEN); {later}."
  if isinstance(e, OfflineModeIsEnabled):
    return f"--push-to-hub cannot reach the Hub (HF_HUB_OFFLINE is set); {later}."
  status = getattr(getattr(e, "response", None), "status_code", None)
  if status in (401, 403):
    return f"the Hub refused the upload (HTTP {status}: check the token's write access); {later}."
  text = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
  return f"--push-to-hub failed ({text.rstrip('.')}); {later}."
