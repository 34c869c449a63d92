from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from loom.accounts.services import create_api_token, ensure_user


class Command(BaseCommand):
    help = "Create a user (if missing) and print a new API token for scripts."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--password", help="Also set this password for logging in to the pages.")
        parser.add_argument("--token-name", default="cli")

    def handle(self, *args, username, password, token_name, **options):
        if password:
            # The same rules as AUTH_PASSWORD_VALIDATORS apply everywhere a person chooses a password.
            try:
                validate_password(password, get_user_model()(username=username))
            except ValidationError as error:
                raise CommandError(f"--password: {' '.join(error.messages)}") from error
        user = ensure_user(username, password)
        self.stdout.write(create_api_token(user, token_name))
