"""Where the command line finds the platform and its token: LOOM_URL and LOOM_TOKEN when set (CI, tests),
else the file `loom login` wrote, readable by its owner alone."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

URL_VARIABLE = "LOOM_URL"
TOKEN_VARIABLE = "LOOM_TOKEN"


class NotLoggedIn(LookupError):
    """Neither the environment nor a credentials file says which platform to talk to."""


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str


def credentials_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "loom" / "credentials.json"


def save_credentials(credentials: Credentials) -> Path:
    """Write the file with mode 0600 from its first byte: the token never sits in a file others can read."""
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump({"url": credentials.url, "token": credentials.token}, handle)
    os.replace(temporary, path)
    return path


def load_credentials() -> Credentials:
    """The environment's LOOM_URL / LOOM_TOKEN over the file's, each on its own."""
    stored: dict = {}
    path = credentials_path()
    if path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise NotLoggedIn(f"cannot read {path} ({error}); run `loom login URL` again") from None
    url = os.environ.get(URL_VARIABLE) or stored.get("url")
    token = os.environ.get(TOKEN_VARIABLE) or stored.get("token")
    if not url or not token:
        raise NotLoggedIn(f"not logged in: run `loom login URL`, or set {URL_VARIABLE} and {TOKEN_VARIABLE}")
    return Credentials(url, token)
