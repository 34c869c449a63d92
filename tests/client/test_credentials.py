"""Where the command line keeps the platform's address and token: a file only its owner can read,
and the environment over it."""

import stat

import pytest

from loom_client.credentials import Credentials, NotLoggedIn, credentials_path, load_credentials, save_credentials


@pytest.fixture(autouse=True)
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("LOOM_URL", raising=False)
    monkeypatch.delenv("LOOM_TOKEN", raising=False)
    return tmp_path / "config"


def test_saved_credentials_are_readable_by_their_owner_alone_and_read_back(config_home):
    path = save_credentials(Credentials("https://loom.example.org", "loom_secret"))
    assert path == config_home / "loom" / "credentials.json" == credentials_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials() == Credentials("https://loom.example.org", "loom_secret")
    # Saved again (another login), the file keeps its mode and holds the new token only.
    save_credentials(Credentials("https://loom.example.org", "loom_newer"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials().token == "loom_newer"


def test_the_environment_overrides_the_file_each_variable_on_its_own(monkeypatch):
    save_credentials(Credentials("https://loom.example.org", "loom_secret"))
    monkeypatch.setenv("LOOM_TOKEN", "loom_from_ci")
    assert load_credentials() == Credentials("https://loom.example.org", "loom_from_ci")
    monkeypatch.setenv("LOOM_URL", "http://127.0.0.1:8000")
    assert load_credentials() == Credentials("http://127.0.0.1:8000", "loom_from_ci")


def test_without_a_login_the_error_says_how_to_log_in(config_home):
    with pytest.raises(NotLoggedIn, match="run `loom login URL`, or set LOOM_URL and LOOM_TOKEN"):
        load_credentials()
    path = config_home / "loom" / "credentials.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(NotLoggedIn, match="cannot read .*credentials.json"):
        load_credentials()
