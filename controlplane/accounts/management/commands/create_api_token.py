from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.accounts.actions import do_create_api_token
from controlplane.accounts.models import API_SCOPES, Team
from controlplane.errors import ControlPlaneError


class Command(BaseCommand):
    help = (
        "Create an API token for a member of a team and print its plaintext once "
        "(only its sha256 is stored). Scopes: " + ", ".join(API_SCOPES) + "."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--user", required=True, help="username of the member")
        parser.add_argument("--team", required=True, help="team slug (or name)")
        parser.add_argument("--name", required=True, help="what the token is for")
        parser.add_argument(
            "--scopes",
            required=True,
            help="comma-separated, e.g. read,register,promote",
        )

    def handle(self, *args, **options) -> None:
        user_model = get_user_model()
        try:
            user = user_model.objects.get(
                **{user_model.USERNAME_FIELD: options["user"]}
            )
        except user_model.DoesNotExist as exc:
            raise CommandError(f"no user {options['user']!r}") from exc
        team = (
            Team.objects.filter(slug=options["team"]).first()
            or Team.objects.filter(name=options["team"]).first()
        )
        if team is None:
            raise CommandError(f"no team {options['team']!r}")
        scopes = [s.strip() for s in options["scopes"].split(",") if s.strip()]
        if not scopes:
            raise CommandError(
                "--scopes needs at least one of " + ", ".join(API_SCOPES)
            )
        try:
            token, plaintext = do_create_api_token(
                user, team, options["name"], scopes, actor="system:cli"
            )
        except ControlPlaneError as exc:
            raise CommandError(exc.message) from exc
        # The plaintext alone on stdout, so `TOKEN=$(manage.py create_api_token ...)`
        # works; the rest goes to stderr.
        self.stderr.write(
            f"created token {token.name!r} ({token.prefix}…) for {user} in "
            f"{team.slug} with scopes {', '.join(token.scopes)}; it is shown once:"
        )
        self.stdout.write(plaintext)
