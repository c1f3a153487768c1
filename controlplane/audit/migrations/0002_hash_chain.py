"""The audit log's hash chain: prev_hash and event_hash on every event, the chain
head, and the chain computed over the events already written (in id order)."""

from django.db import migrations, models

from controlplane.audit import chain


def backfill_chain(apps, schema_editor):
    AuditEvent = apps.get_model("audit", "AuditEvent")
    AuditChainHead = apps.get_model("audit", "AuditChainHead")
    prev_hash, last_id = chain.GENESIS, None
    for event in AuditEvent.objects.order_by("id").iterator():
        event_hash = chain.event_hash(event, prev_hash)
        AuditEvent.objects.filter(pk=event.pk).update(
            prev_hash=prev_hash, event_hash=event_hash
        )
        prev_hash, last_id = event_hash, event.pk
    AuditChainHead.objects.update_or_create(
        pk=1, defaults={"last_event_id": last_id, "last_hash": prev_hash}
    )


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="auditevent",
            name="prev_hash",
            field=models.CharField(default="", max_length=64),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="auditevent",
            name="event_hash",
            field=models.CharField(default="", max_length=64),
            preserve_default=False,
        ),
        migrations.CreateModel(
            name="AuditChainHead",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True,
                        primary_key=True,
                        serialize=False,
                        verbose_name="ID",
                    ),
                ),
                ("last_event_id", models.BigIntegerField(blank=True, null=True)),
                ("last_hash", models.CharField(blank=True, max_length=64)),
            ],
        ),
        migrations.RunPython(backfill_chain, migrations.RunPython.noop),
    ]
