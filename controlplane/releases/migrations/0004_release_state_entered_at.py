"""Release.state_entered_at and Release.reopened_at: the control state the pipeline
read from the audit log until now, kept on the release. Filled from that log once:
the newest release.transition into the release's current state (else its creation),
and the newest one back to registered (else none)."""

import django.utils.timezone
from django.db import migrations, models


def fill_from_audit_log(apps, schema_editor):
    Release = apps.get_model("releases", "Release")
    AuditEvent = apps.get_model("audit", "AuditEvent")
    entered: dict[tuple[str, str], object] = {}  # (release id, state) -> newest
    for release_id, after, created in (
        AuditEvent.objects.filter(verb="release.transition", object_type="release")
        .order_by("created", "id")
        .values_list("object_id", "after", "created")
        .iterator()
    ):
        state = after.get("state") if isinstance(after, dict) else None
        if state:
            entered[(release_id, state)] = created
    releases = []
    for release in Release.objects.only("id", "state", "created").iterator():
        key = str(release.pk)
        release.state_entered_at = entered.get((key, release.state), release.created)
        release.reopened_at = entered.get((key, "registered"))
        releases.append(release)
    Release.objects.bulk_update(
        releases, ["state_entered_at", "reopened_at"], batch_size=500
    )


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0001_initial"),
        ("releases", "0003_gate_policy"),
    ]

    operations = [
        migrations.AddField(
            model_name="release",
            name="reopened_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="release",
            name="state_entered_at",
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
        migrations.RunPython(fill_from_audit_log, migrations.RunPython.noop),
    ]
