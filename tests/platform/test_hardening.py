"""Hardened defaults: a deployment as docker/compose.yaml configures it passes Django's deployment checks, the
platform does not start without a secret key, logins are throttled per account and per address, and
passwords follow the validators."""

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.test import Client

REPO_ROOT = Path(__file__).resolve().parents[2]
# ${NAME:-default} and ${NAME:?message}, as compose substitutes them.
COMPOSE_VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def compose_environment(given: dict[str, str]) -> dict[str, str]:
    """The environment docker/compose.yaml gives the platform's services, its variables taken from `given`."""
    document = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())

    def substitute(match: re.Match) -> str:
        name, kind, rest = match.groups()
        if name in given:
            return given[name]
        if kind == "?":
            raise AssertionError(f"compose requires {name}: {rest}")
        return rest or ""

    return {
        name: COMPOSE_VARIABLE.sub(substitute, str(value)) for name, value in document["x-loom"]["environment"].items()
    }


def manage(arguments: list[str], environment: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    """manage.py in a process of its own with exactly this environment (the image's LOOM_HOME in tmp_path)."""
    base = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)]),
        "LOOM_HOME": str(tmp_path),
    }
    return subprocess.run(
        [sys.executable, "manage.py", *arguments],
        cwd=REPO_ROOT,
        env=base | environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_compose_deployment_passes_djangos_deployment_checks(tmp_path):
    environment = compose_environment({"LOOM_SECRET_KEY": secrets.token_urlsafe(50)})
    assert environment["LOOM_HTTPS"] == "1"
    result = manage(["check", "--deploy", "--fail-level", "WARNING"], environment, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # W021 (HSTS preload) is the one check settings silence, on purpose: preloading is the domain owner's call.
    assert "System check identified no issues (1 silenced)." in result.stdout


def test_plain_http_without_loom_https_is_what_the_deployment_checks_warn_of(tmp_path):
    environment = compose_environment({"LOOM_SECRET_KEY": secrets.token_urlsafe(50)}) | {"LOOM_HTTPS": "0"}
    result = manage(["check", "--deploy"], environment, tmp_path)
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in result.stderr


def test_without_a_secret_key_and_debug_off_the_platform_refuses_to_start(tmp_path):
    result = manage(["check"], {}, tmp_path)
    assert result.returncode != 0
    assert "ImproperlyConfigured: LOOM_SECRET_KEY is not set" in result.stderr


def test_the_embedded_trial_with_debug_on_starts_without_a_secret_key(tmp_path):
    result = manage(["check"], {"LOOM_DEBUG": "1"}, tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def ada(platform_user):
    return platform_user


def log_in(client: Client, username: str, password: str):
    return client.post("/login/", {"username": username, "password": password})


def logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


@pytest.mark.django_db
def test_an_account_is_locked_after_the_failure_limit_even_with_the_right_password(ada):
    (user, password), limit = ada, settings.AXES_FAILURE_LIMIT
    # Each wrong password from an address of its own: only the account's count reaches the limit.
    statuses = [
        log_in(Client(REMOTE_ADDR=f"10.0.0.{attempt + 1}"), user.username, "wrong password").status_code
        for attempt in range(limit)
    ]
    assert statuses == [200] * (limit - 1) + [429]
    fresh = Client(REMOTE_ADDR="10.0.1.1")
    assert log_in(fresh, user.username, password).status_code == 429
    assert not logged_in(fresh)


@pytest.mark.django_db
def test_an_address_is_locked_after_the_failure_limit_for_any_account(ada):
    (user, password), limit = ada, settings.AXES_FAILURE_LIMIT
    attacker = Client(REMOTE_ADDR="10.0.2.1")
    # A different account name each time: only the address's count reaches the limit.
    statuses = [log_in(attacker, f"guess{attempt}", "wrong password").status_code for attempt in range(limit)]
    assert statuses == [200] * (limit - 1) + [429]
    assert log_in(attacker, user.username, password).status_code == 429
    assert not logged_in(attacker)
    # The account itself is not locked: from another address the right password works.
    elsewhere = Client(REMOTE_ADDR="10.0.3.1")
    assert log_in(elsewhere, user.username, password).status_code == 302
    assert logged_in(elsewhere)


@pytest.mark.django_db
def test_behind_the_tls_proxy_an_address_is_the_one_the_proxy_forwarded(ada, settings):
    """Every login reaches the platform from the proxy: one stranger's failures lock the stranger's address, not
    everyone's, and what a client writes into X-Forwarded-For itself does not move it to a fresh address."""
    settings.LOOM_HTTPS = True
    (user, password), limit = ada, settings.AXES_FAILURE_LIMIT
    proxy = "172.18.0.5"
    statuses = [
        log_in(Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR=f"10.9.{attempt}.1, 198.51.100.7"), f"guess{attempt}",
               "wrong password").status_code
        for attempt in range(limit)
    ]  # fmt: skip
    assert statuses == [200] * (limit - 1) + [429]
    assert (
        log_in(Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="198.51.100.7"), user.username, password).status_code
        == 429
    )
    colleague = Client(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="203.0.113.20")
    assert log_in(colleague, user.username, password).status_code == 302
    assert logged_in(colleague)


@pytest.mark.django_db
def test_failures_below_the_limit_let_the_right_password_in(ada):
    (user, password), limit = ada, settings.AXES_FAILURE_LIMIT
    client = Client(REMOTE_ADDR="10.0.4.1")
    for _ in range(limit - 1):
        log_in(client, user.username, "wrong password")
    assert log_in(client, user.username, password).status_code == 302
    assert logged_in(client)


@pytest.mark.parametrize("weak", ["password", "12345678901", "short1!"])
def test_the_password_validators_refuse_weak_passwords(weak):
    with pytest.raises(ValidationError):
        validate_password(weak)


def test_a_long_uncommon_passphrase_is_accepted():
    validate_password("correct horse battery staple")


@pytest.mark.django_db
def test_create_api_user_refuses_a_weak_password_and_creates_no_one(django_user_model):
    with pytest.raises(CommandError, match="--password: .*too common"):
        call_command("create_api_user", "eve", "--password", "password")
    assert not django_user_model.objects.filter(username="eve").exists()


@pytest.mark.django_db
def test_create_api_user_refuses_a_password_like_the_username():
    with pytest.raises(CommandError, match="too similar to the username"):
        call_command("create_api_user", "margaret.hamilton", "--password", "margaret.hamilton1")
